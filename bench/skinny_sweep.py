"""The skinny quantized GEMM's launch config (kernels/quant_triton.py `_skinny_kernel`, `tl.dot` on
dequantized tiles; the path of 9-32 rows of x on sm_90) swept over tile sizes, warps and
pipelining depth at the matrices a speculative verify step multiplies, beside what the arch's
table runs at each row count (the int8 GEMV up to `gemv_max_m` rows) and cuBLAS on the weight
dequantized to bf16 (read 3.5x the bytes).

    python bench/skinny_sweep.py [--rows 5,16,25] [--qtypes q4_k,q6_k] [--shapes 1.5b,8b]
        [--block-ns 32,64,128] [--block-ks 64,128,256] [--warps 4,8] [--stages 3,4]
        [--swaps 0,1] [--split-mins 256,1056] [--packeds 0,1] [--prefetches 0,1]
        [--out DIR] [--json-name skinny_sweep.json]

Every config's output is checked against the fp32 product of the same inputs (as
bench/qgemm.py: rtol 1e-2, atol 1e-2 x max |y|) before it is timed; a config that fails or does
not compile is recorded as such. Timing as bench/qgemm.py: one CUDA graph of launches cycling
through weight copies spanning 256 MiB (each launch reads its weight from HBM). The swept
configs run with `gemv_max_m` 1, so every row count of two or more takes the dot kernel; the
"table" rows are what the engine runs today. `summary`: per config and row count, the geometric
mean over the matrices of its time over the table's.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth, env_info, write_json  # noqa: E402
from qgemm import time_per_call, verify, weight_copies  # noqa: E402

from luceio.kernels import configs, prepare_weight  # noqa: E402
from luceio.kernels.quant import dequantize, nbytes, random_quant_weight  # noqa: E402
from luceio.kernels.quant_x import quantize_x_ref  # noqa: E402
from luceio.kernels.quant_triton import quant_matmul_skinny  # noqa: E402

SHAPES = {
    "1.5b": {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536),
             "down": (1536, 8960)},
    "8b": {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def _label(cfg) -> str:
    return (f"n{cfg.qgemm_block_n} k{cfg.qgemm_block_k} w{cfg.qgemm_num_warps} "
            f"s{cfg.qgemm_num_stages} swap{int(cfg.qgemm_swap)} "
            f"split{cfg.qgemm_split_k_min_programs} packed{int(cfg.qgemm_packed)}"
            + (" prefetch1" if cfg.qgemm_prefetch_scales else ""))


def fields(label: str) -> dict:
    """The config fields a `_label` names."""
    n, k, w, s, sw, sm, *pk = label.split()
    pf = pk[1:] == ["prefetch1"]
    return dict(qgemm_block_n=int(n[1:]), qgemm_block_k=int(k[1:]), qgemm_num_warps=int(w[1:]),
                qgemm_num_stages=int(s[1:]), qgemm_swap=bool(int(sw[4:])),
                qgemm_split_k_min_programs=int(sm[5:]),
                qgemm_packed=bool(pk and int(pk[0][6:])), qgemm_prefetch_scales=pf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="5,16,25")
    ap.add_argument("--qtypes", default="q4_k,q6_k")
    ap.add_argument("--shapes", default="1.5b,8b")
    ap.add_argument("--block-ns", default="32,64,128")
    ap.add_argument("--block-ks", default="64,128,256")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--swaps", default="0", help="qgemm_swap values (0,1)")
    ap.add_argument("--packeds", default="0",
                    help="qgemm_packed values (0,1)")
    ap.add_argument("--prefetches", default="0",
                    help="qgemm_prefetch_scales values (0,1; packed tiles only)")
    ap.add_argument("--split-mins", default="",
                    help="qgemm_split_k_min_programs values ('' keeps the table's)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    ap.add_argument("--json-name", default="skinny_sweep.json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    table = configs.get_config(dev)
    split_mins = _ints(a.split_mins) or [table.qgemm_split_k_min_programs]
    grid = [replace(table, gemv_max_m=1, qgemm_block_n=n, qgemm_block_k=k, qgemm_num_warps=w,
                    qgemm_num_stages=s, qgemm_swap=bool(sw), qgemm_split_k_min_programs=sm,
                    qgemm_packed=bool(pk), qgemm_prefetch_scales=bool(pf))
            for n, k, w, s, sw, sm, pk, pf in itertools.product(
                _ints(a.block_ns), _ints(a.block_ks), _ints(a.warps), _ints(a.stages),
                _ints(a.swaps), split_mins, _ints(a.packeds), _ints(a.prefetches))
            if pk or not pf]
    rows_m = _ints(a.rows)
    copy_gbps = copy_bandwidth() / 1e9
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; {len(grid)} configs", flush=True)
    results = []
    for shape in a.shapes.split(","):
        for name, (n, k) in SHAPES[shape].items():
            for qtype in a.qtypes.split(","):
                w = prepare_weight(random_quant_weight(qtype, n, k, device=dev), torch.bfloat16)
                w_bytes, w32 = nbytes(w), dequantize(w)
                weights = weight_copies(w, w_bytes)
                dense = w32.to(torch.bfloat16)
                dense_copies = weight_copies(dense, dense.numel() * 2)
                for m in rows_m:
                    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
                    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                    exact = x.float() @ w32.T
                    base = dict(shape=shape, matrix=name, N=n, K=k, qtype=qtype, M=m,
                                weight_bytes=w_bytes)

                    def run(cfg, label: str, exact_for=exact):
                        with configs.use_config(cfg):
                            try:
                                ok, err = verify(quant_matmul_skinny(x, w), exact_for)
                                t = time_per_call([lambda wc=wc: quant_matmul_skinny(x, wc, out=out)
                                                   for wc in weights], a.repeats)
                            except Exception as e:  # out of resources for this tile
                                print(f"  {label}: {type(e).__name__}: "
                                      f"{str(e).splitlines()[0][:100]}", flush=True)
                                return dict(base, config=label, error=type(e).__name__)
                        return dict(base, config=label, us=round(t * 1e6, 2), ok=ok,
                                    max_err=err,
                                    pct_copy=round(100 * w_bytes / t / 1e9 / copy_gbps, 1))

                    int8_x = m <= table.gemv_max_m
                    rows = [run(table, "table", quantize_x_ref(x) @ w32.T if int8_x else exact)]
                    t = time_per_call([lambda wc=wc: F.linear(x, wc) for wc in dense_copies],
                                      a.repeats)
                    rows.append(dict(base, config="cublas bf16", us=round(t * 1e6, 2),
                                     pct_copy=round(100 * w_bytes / t / 1e9 / copy_gbps, 1)))
                    for cfg in grid:
                        label = _label(cfg)
                        rows.append(run(cfg, label))
                    best = min((r for r in rows[2:] if r.get("ok")), key=lambda r: r["us"],
                               default=None)
                    print(f"{shape} {name} {qtype} M={m}: table {rows[0].get('us')} us "
                          f"({rows[0].get('pct_copy')}%), cublas {rows[1]['us']} us, best "
                          f"{best and best['config']} {best and best['us']} us "
                          f"({best and best['pct_copy']}%)", flush=True)
                    results += rows
                weights = dense_copies = None
                torch.cuda.empty_cache()
                write_json(os.path.join(a.out, a.json_name),  # so far (a time limit may cut in)
                           {"env": env_info(), "copy_GBps": copy_gbps, "table": table.source,
                            "results": results})
    summary = {}
    for m in rows_m:
        table_us = {(r["shape"], r["matrix"], r["qtype"]): r["us"] for r in results
                    if r["M"] == m and r["config"] == "table" and r.get("ok")}
        by_cfg: dict[str, list[float]] = {}
        for r in results:
            key = (r["shape"], r["matrix"], r["qtype"])
            if r["M"] == m and r["config"] != "table" and key in table_us:
                ratio = r["us"] / table_us[key] if r.get("ok", True) and "us" in r else math.inf
                by_cfg.setdefault(r["config"], []).append(ratio)
        summary[m] = sorted(((c, round(math.exp(sum(map(math.log, v)) / len(v)), 3))
                             for c, v in by_cfg.items() if all(map(math.isfinite, v))),
                            key=lambda cv: cv[1])[:8]
        print(f"M={m}: time / table's, geometric mean, best: {summary[m]}", flush=True)
    # the config best over every row count (geometric mean of its per-M means), as fields
    ranked = {}
    for m, best in summary.items():
        for c, v in best:
            if c != "cublas bf16":
                ranked.setdefault(c, {})[m] = v
    full = {c: math.exp(sum(map(math.log, v.values())) / len(v)) for c, v in ranked.items()
            if len(v) == len(summary)}
    if full:
        top = min(full, key=full.get)
        summary["best"] = {"config": top, "ratio": round(full[top], 3), "fields": fields(top)}
        print("BEST " + json.dumps(summary["best"]["fields"]) + f" ({top}: {full[top]:.3f})",
              flush=True)
    write_json(os.path.join(a.out, a.json_name),
               {"env": env_info(), "copy_GBps": copy_gbps, "table": table.source,
                "summary": summary, "results": results})


if __name__ == "__main__":
    main()
