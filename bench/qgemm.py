"""Skinny GEMM bandwidth on the GPU: luceio's quantized and dense Triton kernels
(kernels/quant_triton.py) beside cuBLAS bf16 (F.linear) at the linear-layer shapes of
Llama-3.1-8B and Qwen2.5-0.5B, M = 1, 4, 8, 16 rows of bf16 activations.

    python bench/qgemm.py [--out DIR] [--quick] [--repeats N] [--set FIELD=VALUE ...]

Each result is checked once against the fp32 product of the same inputs before it is timed
(rtol 1e-2, atol 1e-2 x max |y|: bf16 weights and outputs round at 2^-9, and |y| grows with K);
a failed check is recorded and makes the script exit 1. k-quants need K % 256 == 0 (Qwen's
K = 896 does not: GGUF files fall back to other types there), so those cells are skipped.
Timing: one CUDA graph of many launches, replayed `--repeats` times between CUDA events,
median per launch. The launches cycle through copies of the weight that together span
at least 256 MiB (over 4x the H200's L2), so each launch reads its weight from HBM, as a decode
step reads each layer's. Achieved bandwidth = (weight bytes + x bytes + output bytes) / time,
against a device-to-device copy (read + write) measured in the same run. Weights are random
codes and scales (`random_quant_weight`); only shapes and the layout matter for speed.
`dequantize_triton` (the prefill path's first half) is timed once per quantized matrix:
bandwidth = (quantized bytes read + bf16 bytes written) / time. `--set` overrides fields of the
arch's KernelConfig (compare launch configs). Writes DIR/qgemm.json (`--json-name`; default DIR
bench/results/h200).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth, cuda_median_ms, env_info, write_json  # noqa: E402

from luceio.kernels import configs, prepare_weight  # noqa: E402
from luceio.kernels.quant import dequantize, nbytes, random_quant_weight  # noqa: E402
from luceio.kernels.quant_x import quantize_x_ref  # noqa: E402
from luceio.kernels.quant_triton import (dense_matmul_skinny, dequantize_triton,  # noqa: E402
                                         quant_matmul_skinny)

MODELS = {
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                     "down": (4096, 14336)},
    "qwen2.5-0.5b": {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896),
                     "down": (896, 4864)},
}
QTYPES = ["q4_k", "q5_0", "q6_k", "q8_0", "bf16"]
ROWS = [1, 4, 8, 16]
QUICK = dict(matrices=[("llama-3.1-8b", "gate_up"), ("llama-3.1-8b", "o"),
                       ("qwen2.5-0.5b", "down")], qtypes=["q4_k", "bf16"], rows=[1, 16])
SPAN_BYTES = 256 << 20


def weight_copies(w, nbytes_one: int) -> list:
    """Enough copies of w (fresh allocations) to span SPAN_BYTES, at most 1024."""
    count = min(1024, max(1, math.ceil(SPAN_BYTES / nbytes_one)))
    if isinstance(w, torch.Tensor):
        return [w] + [w.clone() for _ in range(count - 1)]
    return [w] + [prepare_weight(replace(w, **{n: t.clone() for n, t in w.tensors().items()}),
                                 torch.bfloat16) for _ in range(count - 1)]


def time_per_call(fns, repeats: int) -> float:
    """Median seconds per call over `repeats` replays of a CUDA graph that calls every fn in
    turn (at least 32 calls); eager launches if this stack cannot capture."""
    calls = [fns[i % len(fns)] for i in range(max(32, len(fns)))]
    for fn in fns[:2]:
        fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in calls:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        run = graph.replay
    except RuntimeError as e:
        print(f"  (no CUDA graph: {str(e).splitlines()[0][:80]}; timing eager launches)")

        def run():
            for fn in calls:
                fn()
    run()
    return cuda_median_ms(run, repeats) / 1e3 / len(calls)


def verify(out: torch.Tensor, exact: torch.Tensor) -> tuple[bool, float]:
    err = (out.float() - exact).abs().max().item()
    atol = 1e-2 * exact.abs().max().item()
    return bool(torch.allclose(out.float(), exact, rtol=1e-2, atol=atol)), err


def bench_matrix(n: int, k: int, qtype: str, rows: list[int], repeats: int, dev) -> list[dict]:
    if qtype == "bf16":
        w = (torch.randn(n, k, device=dev) * 0.03).to(torch.bfloat16)
        w_bytes, w32 = w.numel() * 2, w.float()
        kernel = dense_matmul_skinny
    else:
        # the form the engine keeps on the GPU (q4_k/q5_k scale pairs interleaved)
        w = prepare_weight(random_quant_weight(qtype, n, k, device=dev), torch.bfloat16)
        w_bytes, w32 = nbytes(w), dequantize(w)
        kernel = quant_matmul_skinny
    weights = weight_copies(w, w_bytes)
    dense = w if qtype == "bf16" else w32.to(torch.bfloat16)  # what cuBLAS reads
    dense_copies = weight_copies(dense, dense.numel() * 2)
    results = []
    dq = {}
    if qtype != "bf16":
        got = dequantize_triton(w, torch.bfloat16).float()  # at most 1 bf16 ulp (FMA) off
        ok = bool(torch.allclose(got, w32.bfloat16().float(), rtol=2**-8, atol=0))
        t = time_per_call([lambda w=wc: dequantize_triton(w, torch.bfloat16) for wc in weights],
                          repeats)
        dq = dict(dequant_us=t * 1e6, dequant_GBps=(w_bytes + 2 * n * k) / t / 1e9,
                  dequant_ok=ok)
    for m in rows:
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        exact = x.float() @ w32.T
        # up to gemv_max_m rows of a quantized weight run the int8 GEMV: exact for the
        # int8-rounded x
        int8_x = qtype != "bf16" and m <= configs.get_config(dev).gemv_max_m
        ok, err = verify(kernel(x, w), quantize_x_ref(x) @ w32.T if int8_x else exact)
        ok_ref, err_ref = verify(F.linear(x, dense), exact)
        t = time_per_call([lambda w=wc: kernel(x, w, out=out) for wc in weights], repeats)
        t_ref = time_per_call([lambda w=wc: F.linear(x, w) for wc in dense_copies], repeats)
        act = 2 * m * (k + n)
        results.append(dict(N=n, K=k, qtype=qtype, M=m, weight_bytes=w_bytes, copies=len(weights),
                            us=t * 1e6, GBps=(w_bytes + act) / t / 1e9, ok=ok, max_err=err,
                            cublas_bf16_us=t_ref * 1e6,
                            cublas_bf16_GBps=(dense.numel() * 2 + act) / t_ref / 1e9,
                            cublas_ok=ok_ref, cublas_max_err=err_ref, **dq))
    del weights, dense_copies
    torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"),
                    help="folder for qgemm.json")
    ap.add_argument("--quick", action="store_true", help="3 matrices, q4_k and bf16, M = 1, 16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json-name", default="qgemm.json")
    ap.add_argument("--rows", default=None, help="comma-separated M values (default 1,4,8,16)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a KernelConfig field (integers), e.g. gemv_block_n=32")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/qgemm.py needs a CUDA or ROCm GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    matrices = QUICK["matrices"] if args.quick else \
        [(model, name) for model, mats in MODELS.items() for name in mats]
    qtypes = QUICK["qtypes"] if args.quick else QTYPES
    rows = QUICK["rows"] if args.quick else ROWS
    if args.rows:
        rows = [int(v) for v in args.rows.split(",")]

    copy_bps = copy_bandwidth(dev)
    cfg = configs.get_config(dev)
    if args.set:
        cfg = replace(cfg, **{f: int(v) for f, v in (a.split("=", 1) for a in args.set)},
                      source=f"{cfg.source}; overridden: {', '.join(args.set)}")
    print(f"{torch.cuda.get_device_name(dev)} ({configs.device_arch(dev)}): device copy "
          f"{copy_bps / 1e9:.0f} GB/s (read + write); config: {cfg.source}")
    print(f"{'matrix':22s} {'N x K':>12s} {'qtype':>5s} {'M':>3s} {'us':>8s} {'GB/s':>7s} "
          f"{'%copy':>6s} {'cuBLAS us':>10s} {'GB/s':>7s} {'speedup':>8s} check")
    results = []
    for model, name in matrices:
        n, k = MODELS[model][name]
        for qtype in qtypes:
            if qtype.endswith("_k") and k % 256:
                print(f"{model + ' ' + name:22s} {f'{n}x{k}':>12s} {qtype:>5s} skipped: K % 256")
                continue
            with configs.use_config(cfg):
                found = bench_matrix(n, k, qtype, rows, args.repeats, dev)
            first = found[0]
            if "dequant_us" in first:
                print(f"{model + ' ' + name:22s} {f'{n}x{k}':>12s} {qtype:>5s} dequantize_triton "
                      f"to bf16: {first['dequant_us']:.1f} us, {first['dequant_GBps']:.0f} GB/s "
                      f"{'ok' if first['dequant_ok'] else 'FAIL'}")
            for r in found:
                r.update(model=model, matrix=name, pct_copy=100 * r["GBps"] * 1e9 / copy_bps,
                         speedup_vs_cublas=r["cublas_bf16_us"] / r["us"])
                results.append(r)
                print(f"{model + ' ' + name:22s} {f'{n}x{k}':>12s} {qtype:>5s} {r['M']:3d} "
                      f"{r['us']:8.1f} {r['GBps']:7.0f} {r['pct_copy']:5.1f}% "
                      f"{r['cublas_bf16_us']:10.1f} {r['cublas_bf16_GBps']:7.0f} "
                      f"{r['speedup_vs_cublas']:7.2f}x "
                      f"{'ok' if r['ok'] else 'FAIL'} ({r['max_err']:.2g})", flush=True)
    failed = [r for r in results if not (r["ok"] and r.get("dequant_ok", True))]
    write_json(os.path.join(args.out, args.json_name),
               dict(env=env_info(), copy_GBps=copy_bps / 1e9, quick=args.quick,
                    repeats=args.repeats, config=configs.config_to_dict(cfg), results=results))
    if failed:
        print(f"{len(failed)} results failed their check", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
