"""One weight row at a time against four (`qdot_cpu.ONE_ROW_MIN_K`, int8 activations), in one
process: rounds alternate the two ways (the table's, and every K at 4 rows), so both see the
same memory bandwidth, which drifts on this box from minute to minute.

    python bench/cpu_one_row.py [--models qwen2.5-coder-1.5b,...] [--random q4_k,q6_k,...]
                                [--set q8_0=896,...]

- `--models`: every quantized matrix of a real GGUF's decode step (M = 1, the LM head
  included), time per (type, shape) and for the whole step;
- `--random`: random weights of those types at `--shapes`, every K at one row against every
  K at 4 rows (what the table's thresholds were chosen from), as many copies as exceed the
  caches.
Each row: the median over rounds of (4-row time / table time) per round, with quartiles.
Writes bench/results/cpu/cpu_one_row.json (`--out`).
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

FOUR = 1 << 30  # a threshold no K reaches: 4 rows at a time


def _ratios(four: list[float], other: list[float], name: str = "table") -> dict:
    r = [a / b for a, b in zip(four, other)]
    return {"four_rows_ms": round(statistics.median(four) * 1e3, 3),
            f"{name}_ms": round(statistics.median(other) * 1e3, 3),
            "four_over_table_quartiles": [round(float(q), 3) for q in np.percentile(r, [25, 50, 75])]}


def real_model(model: str, rounds: int) -> dict:
    from cpu_qlinear import gguf_linears
    from luceio.kernels import qdot_cpu
    ws = [qdot_cpu.prepare(w, torch.float32, "int8") for w in gguf_linears(model)]
    xs = {k: np.random.default_rng(0).standard_normal((1, k), dtype=np.float32)
          for k in {w.shape[1] for w in ws}}
    outs = [np.zeros((1, w.shape[0]), np.float32) for w in ws]
    table = dict(qdot_cpu.ONE_ROW_MIN_K)
    per = {side: collections.defaultdict(list) for side in ("four", "table")}
    total = {side: [] for side in per}
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for side in (("table", "four") if r % 2 else ("four", "table")):
                qdot_cpu.ONE_ROW_MIN_K.update(table if side == "table" else dict.fromkeys(table, FOUR))
                acc = collections.defaultdict(float)
                start = time.perf_counter()
                for w, out in zip(ws, outs):
                    t = time.perf_counter()
                    qdot_cpu.matvec(xs[w.shape[1]], w, out)
                    acc[w.qtype, tuple(w.shape)] += time.perf_counter() - t
                if r:
                    total[side].append(time.perf_counter() - start)
                    for key, v in acc.items():
                        per[side][key].append(v)
    finally:
        qdot_cpu.ONE_ROW_MIN_K.update(table)
    count = collections.Counter((w.qtype, tuple(w.shape)) for w in ws)
    rows = [{"qtype": q, "shape": list(s), "count": count[q, s],
             "one_row": s[1] >= table[q], **_ratios(per["four"][q, s], per["table"][q, s])}
            for q, s in sorted(per["four"], key=lambda key: -statistics.median(per["four"][key]))]
    return {"model": model, "rounds": rounds, "matrices": rows,
            "step": _ratios(total["four"], total["table"])}


def random_shapes(qtypes: list[str], shapes: list[tuple[int, int]], rounds: int) -> list[dict]:
    from luceio.kernels import qdot_cpu
    from luceio.kernels.quant import random_quant_weight
    rows = []
    for qtype in qtypes:
        old = qdot_cpu.ONE_ROW_MIN_K[qtype]
        for n, k in shapes:
            if k % (256 if qtype.endswith("_k") else 32):
                continue  # not whole blocks of the type
            copies = max(1, int(6e8 // (n * k * 0.6)))  # well beyond the caches
            ws = [qdot_cpu.prepare(random_quant_weight(qtype, n, k), torch.float32, "int8")
                  for _ in range(copies)]
            x = np.random.default_rng(0).standard_normal((1, k), dtype=np.float32)
            out = np.zeros((1, n), np.float32)
            times = {"four": [], "one": []}
            try:
                for r in range(rounds + 1):
                    for side in (("one", "four") if r % 2 else ("four", "one")):
                        qdot_cpu.ONE_ROW_MIN_K[qtype] = 0 if side == "one" else FOUR
                        t = time.perf_counter()
                        for w in ws:
                            qdot_cpu.matvec(x, w, out)
                        if r:
                            times[side].append((time.perf_counter() - t) / copies)
            finally:
                qdot_cpu.ONE_ROW_MIN_K[qtype] = old
            row = {"qtype": qtype, "shape": [n, k], "one_row_by_table": k >= old,
                   **_ratios(times["four"], times["one"], "one_row"),
                   "one_row_GBps": round(ws[0].nbytes / statistics.median(times["one"]) / 1e9, 1)}
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    ap.add_argument("--random", default="", help="qtypes of random weights (e.g. q4_k,q6_k)")
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336,3584x3584,2048x2048,"
                    "8960x1536,1536x8960,4864x896")
    ap.add_argument("--set", default="", help="thresholds to try instead of the table's, as "
                    "qtype=K,... (the real models' rows compare them with 4 rows)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "cpu_one_row.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from luceio.kernels import qdot_cpu
    if not qdot_cpu.int8_available():
        raise SystemExit("int8 activations need numba and AVX-512 VNNI")
    for item in filter(None, a.set.split(",")):
        qtype, k = item.split("=")
        qdot_cpu.ONE_ROW_MIN_K[qtype] = int(k)
    results = {"env": env_info(), "threads": a.threads, "table": dict(qdot_cpu.ONE_ROW_MIN_K),
               "models": [], "random": []}
    for model in filter(None, a.models.split(",")):
        results["models"].append(real_model(model, a.rounds))
        for row in results["models"][-1]["matrices"]:
            print(model, row, flush=True)
        print(model, "whole step", results["models"][-1]["step"], flush=True)
        write_json(a.out, results)
    if a.random:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
        results["random"] = random_shapes(a.random.split(","), shapes, max(4, a.rounds // 3))
        write_json(a.out, results)


if __name__ == "__main__":
    main()
