"""CPU linear layers on quantized weights (kernels/quant_cpu.py) beside torch's dense and
quantized CPU matmuls, at the real shapes of Qwen2.5-Coder-0.5B and SmolLM2-135M.

    python bench/cpu_qlinear.py [--sections kernels,qtypes,models,quality] [--threads 1,2]

kernels: per-call time and GB/s (weight bytes / time) of F.linear fp32/bf16/fp16,
  torch._weight_int8pack_mm (bf16 x, per-row scales), torch._weight_int4pack_mm_for_cpu
  (group 32/64/128, bf16 x), quantized.linear_dynamic (fbgemm int8, fp32 x) and
  linear_dynamic_fp16, M = 1, 4 and 128; the int4/int8 kernels with fp16/fp32 x once (M = 1).
  Each call reads its weight from DRAM: calls rotate over copies spanning 320 MiB (64 MiB at
  M = 128, compute-bound), more than this box's L3 share. Random weights: only shapes matter.
qtypes: `cpu_quant_linear` per GGUF type vs F.linear bf16 and fp32 at [4864, 1024] (Qwen's
  gate/up rows; K a multiple of 256), M = 1 to 128: where the dense path starts to win.
models: every linear of a decode step of the real GGUFs (each tensor in its own type, the LM
  head included, q/k/v and gate/up unfused): the sum of per-call times at M = 1 and 4, ours vs
  the same weights dense bf16 and fp32, and vs the lossy alternative of requantizing every
  weight to one int4 plane (quantize_rtn int4: q4_1 per 32); load (prepare) time, packed bytes.
quality: relative RMS error against the exact fp32 dequantization, per GGUF type over the real
  tensors (up to 4096 rows each), of: our mapping (bf16 scales and zeros), dense bf16 and fp16,
  int8 per-row requantization (what _weight_int8pack_mm can hold), int4 per-32 requantization.
All timings interleave the alternatives and take the median of repeats: the box is shared.
Writes bench/results/cpu/cpu_qlinear.json (`--update`: keeps the sections this run skips; each
section records its own date and load average).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402

from luceio.kernels import quant_cpu as qc  # noqa: E402
from luceio.kernels.quant import (QTYPES, dequantize, ggml_to_qtype, quantize_rtn,  # noqa: E402
                                  repack_gguf)
from luceio.kernels.quant import nbytes as qnbytes  # noqa: E402
from luceio.kernels.quant import random_quant_weight  # noqa: E402

SHAPES = {  # [N, K]: fused qkv, o, fused gate/up, down, LM head
    "qwen-qkv": (1152, 896), "qwen-o": (896, 896), "qwen-gate_up": (9728, 896),
    "qwen-down": (896, 4864), "qwen-lm_head": (151936, 896),
    "smol-qkv": (960, 576), "smol-o": (576, 576), "smol-gate_up": (3072, 576),
    "smol-down": (576, 1536), "smol-lm_head": (49152, 576),
}
MODELS = ("qwen2.5-coder-0.5b", "smollm2-135m")
MiB = 1 << 20


def timed(fns: dict, reps: int = 7, min_s: float = 0.02) -> dict:
    """name -> (call) for a list of calls to rotate over: median seconds per call, interleaved."""
    loops = {}
    for name, calls in fns.items():
        t = time.perf_counter()
        for c in calls:
            c()
        loops[name] = max(1, math.ceil(min_s / max(time.perf_counter() - t, 1e-6)))
    times = collections.defaultdict(list)
    names = list(fns)
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            for _ in range(loops[name]):
                for c in fns[name]:
                    c()
            times[name].append((time.perf_counter() - t) / (loops[name] * len(fns[name])))
    return {name: statistics.median(ts) for name, ts in times.items()}


def copies(nbytes: int, budget: int) -> int:
    return max(1, math.ceil(budget / nbytes))


# ---- kernels --------------------------------------------------------------------------------

def kernel_variants(n: int, k: int, budget: int, slow: bool):
    """name -> (make_call(x_rows) -> list of calls, weight bytes)."""
    g = torch.Generator().manual_seed(0)
    wf = torch.randn(n, k, generator=g) * 0.02
    out = {}

    def add(name, weights, nbytes, dtype, fn):
        out[name] = (lambda m: [(lambda w=w, x=torch.randn(m, k).to(dtype): fn(x, w)) for w in weights],
                     nbytes)

    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        base = wf.to(dt)
        add(name, [base.clone() for _ in range(copies(base.nbytes, budget))], base.nbytes, dt, F.linear)
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    w8s = [w8.clone() for _ in range(copies(n * k, budget))]
    for dt, name in [(torch.bfloat16, "int8pack_bf16")] + (
            [(torch.float16, "int8pack_fp16"), (torch.float32, "int8pack_fp32")] if slow else []):
        s = (torch.rand(n, generator=g) * 1e-3).to(dt)
        add(name, w8s, n * k + s.nbytes, dt, lambda x, w, s=s: torch._weight_int8pack_mm(x, w, s))
    p4 = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    p4s = [p4.clone() for _ in range(copies(p4.nbytes, budget))]
    groups = [(32, torch.bfloat16), (64, torch.bfloat16), (128, torch.bfloat16)]
    if slow:
        groups += [(32, torch.float16), (32, torch.float32)]
    for group, dt in groups:
        if k % group:
            continue
        sz = torch.stack([torch.rand(k // group, n, generator=g) * 1e-3,
                          torch.randn(k // group, n, generator=g) * 1e-3], -1).to(dt)
        add(f"int4pack_g{group}_{str(dt)[6:]}", p4s, p4.nbytes + sz.nbytes, dt,
            lambda x, w, group=group, sz=sz: torch._weight_int4pack_mm_for_cpu(x, w, group, sz))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_per_channel is deprecated
        torch.backends.quantized.engine = "fbgemm"
        scales = (wf.abs().amax(1) / 127).double()
        qw = torch.quantize_per_channel(wf, scales, torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        packs = [torch.ops.quantized.linear_prepack(qw, None) for _ in range(copies(n * k, budget))]
        add("fbgemm_int8_dyn", packs, n * k + 8 * n, torch.float32, torch.ops.quantized.linear_dynamic)
        packs16 = [torch.ops.quantized.linear_prepack_fp16(wf, None)
                   for _ in range(copies(2 * n * k, budget))]
        add("fbgemm_fp16", packs16, 2 * n * k, torch.float32, torch.ops.quantized.linear_dynamic_fp16)
    return out


def bench_kernels(threads: list[int]) -> list[dict]:
    rows = []
    for shape, (n, k) in SHAPES.items():
        for m in (1, 4, 128):
            if m == 128 and "lm_head" in shape:
                continue  # prefill computes logits for the last token only
            slow = m == 1 and shape.endswith("-o")
            variants = kernel_variants(n, k, (64 if m == 128 else 320) * MiB, slow)
            for t in threads:
                torch.set_num_threads(t)
                res = timed({name: make(m) for name, (make, _) in variants.items()}, reps=5)
                row = {"shape": shape, "N": n, "K": k, "M": m, "threads": t,
                       "us": {name: round(s * 1e6, 1) for name, s in res.items()},
                       "GBps": {name: round(variants[name][1] / s / 1e9, 2) for name, s in res.items()}}
                rows.append(row)
                print(f"{shape:13s} M={m:<3d} t={t}  " + "  ".join(
                    f"{name} {row['us'][name]:.0f}us {row['GBps'][name]:.1f}GB/s" for name in res),
                    flush=True)
            del variants
    return rows


# ---- qtypes ---------------------------------------------------------------------------------

def bench_qtypes(threads: list[int], n: int = 4864, k: int = 1024) -> list[dict]:
    rows = []
    for qtype in QTYPES:
        w = random_quant_weight(qtype, n, k, generator=torch.Generator().manual_seed(0))
        packed = qc.pack_int4(w, torch.bfloat16)  # the int4pack path (qdot: cpu_quant.py --kernels)
        dense = dequantize(w)
        n_ours = copies(packed.nbytes, 320 * MiB)
        ours = [packed] + [qc.CpuPacked(packed.qtype, packed.shape, packed.packed.clone(),
                                        packed.scales_zeros.clone(), packed.chunk, packed.factors,
                                        packed.out_dtype) for _ in range(n_ours - 1)]
        bf16 = [dense.bfloat16() for _ in range(copies(2 * n * k, 320 * MiB))]
        fp32 = [dense.clone() for _ in range(copies(4 * n * k, 320 * MiB))]
        for t in threads:
            torch.set_num_threads(t)
            for m in (1, 4, 8, 16, 24, 32, 40, 64, 128):
                xb, xf = torch.randn(m, k).bfloat16(), torch.randn(m, k)
                few = slice(0, 4) if m >= 16 else slice(None)  # compute-bound: no need to rotate
                res = timed({"ours": [lambda p=p: qc.cpu_quant_linear(xb, p) for p in ours[few]],
                             "bf16": [lambda w=w: F.linear(xb, w) for w in bf16[few]],
                             "fp32": [lambda w=w: F.linear(xf, w) for w in fp32[few]]}, reps=5)
                path = "dense" if m >= qc.DENSE_MIN_ROWS[packed.planes] else "packed"
                row = {"qtype": qtype, "N": n, "K": k, "M": m, "threads": t, "path": path,
                       "bytes_per_weight": packed.nbytes / (n * k),
                       "us": {name: round(s * 1e6, 1) for name, s in res.items()},
                       "speedup_vs_bf16": round(res["bf16"] / res["ours"], 2),
                       "speedup_vs_fp32": round(res["fp32"] / res["ours"], 2)}
                rows.append(row)
                print(f"{qtype} M={m:<3d} t={t} {path:6s} ours {row['us']['ours']:.0f}us  bf16 "
                      f"{row['us']['bf16']:.0f}us  fp32 {row['us']['fp32']:.0f}us  "
                      f"x{row['speedup_vs_bf16']} vs bf16, x{row['speedup_vs_fp32']} vs fp32",
                      flush=True)
        del ours, bf16, fp32
    return rows


# ---- models ---------------------------------------------------------------------------------

def gguf_linears(model: str):
    """The QuantWeight of every 2-D quantized tensor a decode step multiplies by: all but the
    token embedding, unless it is also the LM head (no output.weight: tied)."""
    import gguf
    import numpy as np
    from luceio.loader.resolve import resolve_model
    reader = gguf.GGUFReader(resolve_model(model))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    for t in reader.tensors:
        qtype = ggml_to_qtype(t.tensor_type)
        if qtype is None or len(t.shape) != 2 or (t.name == "token_embd.weight" and not tied):
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        yield repack_gguf(np.asarray(t.data).reshape(n, -1), t.tensor_type, (n, k))


def bench_models(threads: list[int]) -> list[dict]:
    return [row for model in MODELS for row in bench_model(model, threads)]


def bench_model(model: str, threads: list[int]) -> list[dict]:
    start = time.perf_counter()
    weights = list(gguf_linears(model))
    read_s = time.perf_counter() - start
    torch.set_num_threads(threads[0])  # prepare_s under the first thread count
    start = time.perf_counter()
    packed = [qc.prepare_cpu_weight(w, torch.bfloat16) for w in weights]
    prepare_s = time.perf_counter() - start
    # the lossy alternative: every weight requantized to one int4 plane (q4_1, per 32)
    lossy = [qc.prepare_cpu_weight(quantize_rtn(dequantize(w), "int4"), torch.bfloat16)
             for w in weights]
    bf16 = [dequantize(w).bfloat16() for w in weights]
    fp32 = [dequantize(w) for w in weights]
    common = {"model": model, "types": dict(collections.Counter(w.qtype for w in weights)),
              "packed_MiB": round(sum(p.nbytes for p in packed) / MiB, 1),
              "gguf_MiB": round(sum(qnbytes(w) for w in weights) / MiB, 1),
              "bf16_MiB": round(sum(w.nbytes for w in bf16) / MiB, 1),
              "gguf_read_s": round(read_s, 2), "prepare_s": round(prepare_s, 2)}
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        for m in (1, 4):
            x = {k: torch.randn(m, k).bfloat16() for k in {w.shape[1] for w in weights}}
            xf = {k: v.float() for k, v in x.items()}
            res = timed({"ours": [lambda: [qc.cpu_quant_linear(x[p.shape[1]], p) for p in packed]],
                         "int4_requant": [lambda: [qc.cpu_quant_linear(x[p.shape[1]], p)
                                                   for p in lossy]],
                         "bf16": [lambda: [F.linear(x[w.shape[1]], w) for w in bf16]],
                         "fp32": [lambda: [F.linear(xf[w.shape[1]], w) for w in fp32]]},
                        reps=7, min_s=0)
            row = {**common, "threads": t, "M": m,
                   "linear_ms_per_step": {k: round(v * 1e3, 2) for k, v in res.items()},
                   "speedup_vs_bf16": round(res["bf16"] / res["ours"], 2),
                   "speedup_vs_fp32": round(res["fp32"] / res["ours"], 2)}
            rows.append(row)
            ms = row["linear_ms_per_step"]
            print(f"{model} M={m} t={t}: linears per step ours {ms['ours']} ms, bf16 "
                  f"{ms['bf16']} ms (x{row['speedup_vs_bf16']}), fp32 {ms['fp32']} ms "
                  f"(x{row['speedup_vs_fp32']}), all int4 (lossy) {ms['int4_requant']} ms; "
                  f"packed {row['packed_MiB']} MiB (GGUF {row['gguf_MiB']}, bf16 "
                  f"{row['bf16_MiB']}); prepare {prepare_s:.1f} s", flush=True)
    return rows


# ---- quality --------------------------------------------------------------------------------

def effective_weight(w) -> torch.Tensor:
    """What the packed kernel multiplies by: the planes with bf16-rounded scales and zeros."""
    codes, scale, zero = qc._planes(w)
    chunk, factors = qc._PLANE_LAYOUT[w.qtype]
    n, k = w.shape
    s, z = scale.bfloat16().float(), zero.bfloat16().float()
    v = (codes.float().view(n, -1, 32) - 8) * s[..., None] + z[..., None]
    v = v.view(n, k // chunk, len(factors), chunk) * torch.tensor(factors).view(-1, 1)
    return v.sum(2).view(n, k)


def int8_per_row(w: torch.Tensor) -> torch.Tensor:
    s = (w.abs().amax(1, keepdim=True) / 127).bfloat16().float().clamp_min(1e-30)
    return torch.round(w / s).clamp(-127, 127) * s


def int4_per_group(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = ((high - low) / 15).bfloat16().float().clamp_min(1e-30)
    z = low.bfloat16().float()
    return (torch.round((g - z) / s).clamp(0, 15) * s + z).view(n, k)


def bench_quality(max_rows: int = 4096) -> list[dict]:
    import gguf
    import numpy as np
    from luceio.loader.resolve import resolve_model
    sums = collections.defaultdict(lambda: collections.defaultdict(float))
    for model in MODELS:
        for t in gguf.GGUFReader(resolve_model(model)).tensors:
            qtype = ggml_to_qtype(t.tensor_type)
            if qtype is None or len(t.shape) != 2:
                continue
            k, n = int(t.shape[0]), int(t.shape[1])
            rows = min(n, max_rows)
            w = repack_gguf(np.asarray(t.data).reshape(n, -1)[:rows], t.tensor_type, (rows, k))
            exact = dequantize(w)
            variants = {"ours": effective_weight(w), "dense_bf16": exact.bfloat16().float(),
                        "dense_fp16": exact.half().float(), "int8_per_row": int8_per_row(exact),
                        "int4_per_32": int4_per_group(exact)}
            acc = sums[(model, qtype)]
            acc["tensors"] += 1
            acc["norm2"] += exact.norm().item() ** 2
            for name, v in variants.items():
                acc[name] += (v - exact).norm().item() ** 2
    rows = []
    for (model, qtype), acc in sums.items():
        row = {"model": model, "qtype": qtype, "tensors": int(acc["tensors"]),
               "rel_rms": {name: float(f"{math.sqrt(acc[name] / acc['norm2']):.3g}")
                           for name in ("ours", "dense_bf16", "dense_fp16", "int8_per_row",
                                        "int4_per_32")}}
        rows.append(row)
        print(f"{model} {qtype} ({row['tensors']} tensors): " + "  ".join(
            f"{name} {v:.2e}" for name, v in row["rel_rms"].items()), flush=True)
    return rows


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="kernels,qtypes,models,quality")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "cpu_qlinear.json"))
    ap.add_argument("--update", action="store_true",
                    help="keep the sections of an existing --out file that this run skips")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    out = {"sections": {}}
    if args.update and os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)
    out["machine"] = {**env_info(), "cpu": cpu_name(), "cores": os.cpu_count()}
    run = {"kernels": lambda: bench_kernels(threads), "qtypes": lambda: bench_qtypes(threads),
           "models": lambda: bench_models(threads), "quality": bench_quality}
    for name in args.sections.split(","):
        print(f"== {name}", flush=True)
        start = {"date": time.strftime("%Y-%m-%d %H:%M"), "loadavg_at_start": os.getloadavg()[0],
                 "threads": threads, "dense_min_rows": qc.DENSE_MIN_ROWS}
        rows = run[name]()
        out["sections"][name] = {**start, "loadavg_at_end": os.getloadavg()[0], "rows": rows}
    write_json(args.out, out)


if __name__ == "__main__":
    main()
