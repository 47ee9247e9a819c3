"""Weights interleaved by 4 rows (`qdot_cpu.interleave`) against the row-major layout, in one
process: rounds alternate the two (each with the kernels it takes: the interleaved one, or 4
rows / one row by `qdot_cpu.ONE_ROW_MIN_K`), so both see the same memory bandwidth, which
drifts on this box from minute to minute.

    python bench/cpu_interleave.py [--models qwen2.5-coder-1.5b,...] [--activations int8,int16]
                                   [--rows 1,2,5] [--random q4_k,q6_k,... --shapes NxK,...]

- `--models`: every quantized matrix of a real GGUF's decode step (the LM head included),
  time per (type, shape) and for the whole step, at each count of activation rows (1: a
  decode step; 2-7: a few requests or a speculative verify);
- `--random`: random weights of those types at `--shapes`, as many copies as exceed the caches.
Each row: the median over rounds of (row-major time / interleaved time) per round, with
quartiles. Writes bench/results/cpu/cpu_interleave.json (`--out`).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402


def _ratios(before: list[float], after: list[float]) -> dict:
    r = [a / b for a, b in zip(before, after)]
    return {"row_major_ms": round(statistics.median(before) * 1e3, 3),
            "interleaved_ms": round(statistics.median(after) * 1e3, 3),
            "speedup_quartiles": [round(float(q), 3) for q in np.percentile(r, [25, 50, 75])]}


def compare(weights, activations: str, rows: int, rounds: int) -> dict:
    """weights: QuantWeights; each prepared both ways (the interleaved form is a copy)."""
    from luceio.kernels import qdot_cpu
    pairs = [(qdot_cpu.prepare(w, torch.float32, activations, interleaved=False),
              qdot_cpu.prepare(w, torch.float32, activations)) for w in weights]
    xs = {k: np.random.default_rng(0).standard_normal((rows, k), dtype=np.float32)
          for k in {w.shape[1] for w in weights}}
    outs = [np.zeros((rows, w.shape[0]), np.float32) for w in weights]
    for (plain, inter), out in zip(pairs, outs):  # the same products, to fp32 rounding
        check = out.copy()
        qdot_cpu.matvec(xs[plain.shape[1]], plain, out)
        qdot_cpu.matvec(xs[plain.shape[1]], inter, check)
        assert np.abs(out - check).max() <= 1e-5 * max(1e-30, float(np.abs(out).max()))
    per = {side: collections.defaultdict(list) for side in (0, 1)}
    total = {side: [] for side in per}
    for r in range(rounds + 1):  # round 0 warms up
        for side in ((1, 0) if r % 2 else (0, 1)):
            acc = collections.defaultdict(float)
            start = time.perf_counter()
            for pair, out in zip(pairs, outs):
                w = pair[side]
                t = time.perf_counter()
                qdot_cpu.matvec(xs[w.shape[1]], w, out)
                acc[w.qtype, tuple(w.shape)] += time.perf_counter() - t
            if r:
                total[side].append(time.perf_counter() - start)
                for key, v in acc.items():
                    per[side][key].append(v)
    count = collections.Counter((w.qtype, tuple(w.shape)) for w in weights)
    inter = {(w.qtype, tuple(w.shape)): p[1].interleaved for w, p in zip(weights, pairs)}
    nbytes = collections.Counter()
    for w, p in zip(weights, pairs):
        nbytes[w.qtype, tuple(w.shape)] += p[0].nbytes
    matrices = []
    for key in sorted(per[0], key=lambda key: -statistics.median(per[0][key])):
        row = {"qtype": key[0], "shape": list(key[1]), "count": count[key],
               "interleaved": inter[key], **_ratios(per[0][key], per[1][key])}
        row["interleaved_GBps"] = round(nbytes[key] / statistics.median(per[1][key]) / 1e9, 1)
        matrices.append(row)
    return {"activations": activations, "rows": rows, "rounds": rounds, "matrices": matrices,
            "step": _ratios(total[0], total[1]),
            "step_GBps": [round(sum(nbytes.values()) / statistics.median(total[s]) / 1e9, 1)
                          for s in (0, 1)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    ap.add_argument("--activations", default="int8,int16")
    ap.add_argument("--rows", default="1,2,5", help="activation rows per matvec")
    ap.add_argument("--random", default="", help="qtypes of random weights (e.g. q4_k,q6_k)")
    ap.add_argument("--shapes", default="14336x4096,4096x14336,18944x3584,8960x1536,1536x8960")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "cpu_interleave.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from luceio.kernels import qdot_cpu
    kinds = [k for k in a.activations.split(",") if k == "int16" or qdot_cpu.int8_available()]
    results = {"env": env_info(), "threads": a.threads, "one_row_table": qdot_cpu.ONE_ROW_MIN_K,
               "models": [], "random": []}
    for model in filter(None, a.models.split(",")):
        from cpu_qlinear import gguf_linears
        weights = list(gguf_linears(model))
        for kind in kinds:
            for rows in (int(v) for v in a.rows.split(",")):
                res = {"model": model, **compare(weights, kind, rows, a.rounds)}
                results["models"].append(res)
                for row in res["matrices"]:
                    print(model, kind, rows, row, flush=True)
                print(model, kind, rows, "whole step", res["step"], res["step_GBps"], flush=True)
                write_json(a.out, results)
    from luceio.kernels.quant import random_quant_weight
    for qtype in filter(None, a.random.split(",")):
        for n, k in (tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")):
            copies = max(1, int(6e8 // (n * k * 0.6)))  # well beyond the caches
            weights = [random_quant_weight(qtype, n, k) for _ in range(copies)]
            for kind in kinds:
                res = {"qtype": qtype, "shape": [n, k], "copies": copies,
                       **compare(weights, kind, 1, max(4, a.rounds // 2))}
                res.pop("matrices")
                results["random"].append(res)
                print(res, flush=True)
                write_json(a.out, results)


if __name__ == "__main__":
    main()
