"""The dense GEMV (kernels/dense_gemv.py) against what a decode step runs without it, over the
projections of the Qwen2.5-0.5B / 1.5B and Llama-3.1-8B shapes, and a sweep of its tile fields.

    python bench/dense_gemv_sweep.py [--quick] [--rows 1] [--out bench/results/h200]

Baseline per matrix: cuBLAS's F.linear of one bf16 row (with the bias where the model has one);
for `down` the SiLU-and-mul kernel plus F.linear, which the GEMV's GLU form replaces. Timing:
`qgemm.time_per_call` (one CUDA graph of >= 32 calls cycling through weight copies spanning
256 MiB, so the weight comes from HBM; with PDL where the config table turns it on, as in the
engine). Every config is checked against the torch reference first. The best config is the
one with the lowest geometric mean of time over all matrices; its fields are printed as a
`--set` string for bench/step_profile.py and written to `dense_gemv_best.txt`.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info  # noqa: E402
from qgemm import time_per_call, weight_copies  # noqa: E402

from luceio.kernels import configs, silu_and_mul  # noqa: E402
from luceio.kernels.dense_gemv import dense_gemv, dense_gemv_ref  # noqa: E402

# (N, K, bias, glu) of each projection at a decode step
MODELS = {
    "qwen2.5-0.5b": {"qkv": (1152, 896, True, False), "o": (896, 896, False, False),
                     "gate_up": (9728, 896, False, False), "down": (896, 4864, False, True)},
    "qwen2.5-1.5b": {"qkv": (2048, 1536, True, False), "o": (1536, 1536, False, False),
                     "gate_up": (17920, 1536, False, False), "down": (1536, 8960, False, True)},
    "llama-3.1-8b": {"qkv": (6144, 4096, False, False), "o": (4096, 4096, False, False),
                     "gate_up": (28672, 4096, False, False), "down": (4096, 14336, False, True)},
}
HEADS = {"qwen2.5-0.5b": (151936, 896, False, False)}  # the LM head: timed with the table's
# config only (a 272 MB matrix in every variant would take most of the sweep)
GRID = dict(dense_gemv_block_n=[4, 8, 16], dense_gemv_block_k=[256, 512, 1024],
            dense_gemv_num_warps=[2, 4, 8], dense_gemv_split_min_programs=[132, 528, 2112])
MAX_ACC_PER_THREAD = 64  # fp32 accumulators a thread holds (BLOCK_N * BLOCK_K / threads)
QUICK = dict(dense_gemv_block_n=[4, 8], dense_gemv_block_k=[512], dense_gemv_num_warps=[4],
             dense_gemv_split_min_programs=[264])


def matrices(rows: int, dev):
    for model, projs in MODELS.items():
        for name, (n, k, bias, glu) in projs.items():
            w = (torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16)
            b = (torch.randn(n, device=dev) * 0.1).to(torch.bfloat16) if bias else None
            x = torch.randn(rows, 2 * k if glu else k, device=dev).to(torch.bfloat16)
            yield model, name, x, w, b, glu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    table = dataclasses.replace(configs.get_config(dev), dense_gemv_max_m=max(8, a.rows))
    base = dataclasses.replace(table, dense_gemv_wide_min_n=0)  # variants: one tile for all
    grid = QUICK if a.quick else GRID
    variants = [v for v in (dict(zip(grid, values)) for values in itertools.product(*grid.values()))
                if v["dense_gemv_block_n"] * v["dense_gemv_block_k"]
                <= MAX_ACC_PER_THREAD * 32 * v["dense_gemv_num_warps"]]
    rows_out, times = [], {i: [] for i in range(len(variants))}
    for model, name, x, w, b, glu in matrices(a.rows, dev):
        copies = weight_copies(w, w.numel() * 2)
        if glu:
            def cublas(c):
                return lambda: F.linear(silu_and_mul(x), c)
        else:
            def cublas(c):
                return lambda: F.linear(x, c, b)
        row = {"model": model, "matrix": name, "N": w.shape[0], "K": w.shape[1], "M": a.rows,
               "glu": glu, "cublas_us": round(time_per_call([cublas(c) for c in copies],
                                                            a.repeats) * 1e6, 2),
               "configs": []}
        ref = dense_gemv_ref(x, w, b, glu=glu).float()
        with configs.use_config(table):  # the config table as it stands (its wide tile too)
            row["table_us"] = round(time_per_call(
                [lambda c=c: dense_gemv(x, c, b, glu=glu) for c in copies], a.repeats) * 1e6, 2)
        for i, fields in enumerate(variants):
            with configs.use_config(dataclasses.replace(base, **fields)):
                out = dense_gemv(x, w, b, glu=glu).float()
                ok = bool(torch.allclose(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()))
                us = time_per_call([lambda c=c: dense_gemv(x, c, b, glu=glu) for c in copies],
                                   a.repeats) * 1e6
            times[i].append(us if ok else float("inf"))
            row["configs"].append({**fields, "us": round(us, 2), "ok": ok})
        best = min(row["configs"], key=lambda c: c["us"])
        row["best"] = best
        row["speedup_best_vs_cublas"] = round(row["cublas_us"] / best["us"], 3)
        print(json.dumps({k: row[k] for k in ("model", "matrix", "M", "cublas_us", "table_us")}),
              "best", json.dumps(best), flush=True)
        rows_out.append(row)
        del copies
        torch.cuda.empty_cache()
    heads = []
    for model, (n, k, bias, glu) in HEADS.items():
        w = (torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16)
        x = torch.randn(a.rows, k, device=dev).to(torch.bfloat16)
        with configs.use_config(table):
            us = time_per_call([lambda: dense_gemv(x, w)], a.repeats) * 1e6
        heads.append({"model": model, "matrix": "lm_head", "N": n, "K": k,
                      "cublas_us": round(time_per_call([lambda: F.linear(x, w)], a.repeats) * 1e6, 2),
                      "table_us": round(us, 2)})
        print(json.dumps(heads[-1]), flush=True)
    geo = {i: math.exp(sum(map(math.log, t)) / len(t)) for i, t in times.items()}
    order = sorted(geo, key=geo.get)
    top = variants[order[0]]
    cublas_geo = math.exp(sum(math.log(r["cublas_us"]) for r in rows_out) / len(rows_out))
    for r in rows_out:
        r["chosen"] = r["configs"][order[0]]
        r["speedup_chosen_vs_cublas"] = round(r["cublas_us"] / r["chosen"]["us"], 3)
    summary = {"env": env_info(), "rows_of_x": a.rows, "chosen": top,
               "chosen_geomean_us": round(geo[order[0]], 2), "cublas_geomean_us": round(cublas_geo, 2),
               "ranking": [{**variants[i], "geomean_us": round(geo[i], 2)} for i in order[:10]],
               "rows": rows_out, "lm_heads": heads}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"dense_gemv_sweep_m{a.rows}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    setting = ",".join(f"{k}={v}" for k, v in top.items())
    with open(os.path.join(a.out, "dense_gemv_best.txt"), "w") as f:
        f.write(setting + "\n")
    print("chosen", setting, "geomean", summary["chosen_geomean_us"], "us; cuBLAS",
          summary["cublas_geomean_us"], "us")
    for r in rows_out:
        print(f"  {r['model']:14s} {r['matrix']:8s} cuBLAS {r['cublas_us']:8.2f} us  chosen "
              f"{r['chosen']['us']:8.2f} us  {r['speedup_chosen_vs_cublas']:.2f}x  table "
              f"{r['table_us']:8.2f} us  {r['cublas_us'] / r['table_us']:.2f}x")


if __name__ == "__main__":
    main()
