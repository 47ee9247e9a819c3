"""Where a few-row step should leave `qdot_cpu.matvec` for the dense path (dequantized bf16
tiles times bf16 x, oneDNN): a real GGUF's decode-step matrices (the LM head aside: a step
asks it for the logits rows only) at M activation rows, both ways alternating in one process.
`quant_cpu.QDOT_DENSE_MIN_ROWS` is chosen from this.

    python bench/cpu_dense_rows.py [--models qwen2.5-coder-1.5b,...] [--activations int8,int16]
                                   [--rows 4,8,12,16,20,24,32,48]

Each row: ms per step (the median over rounds) for matvec and for the dense path.
Writes bench/results/cpu/cpu_dense_rows.json (`--out`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402


def measure(model: str, activations: str, rows: list[int], rounds: int) -> list[dict]:
    from cpu_qlinear import gguf_linears

    from luceio.kernels import quant_cpu as qc
    from luceio.kernels import qdot_cpu
    qdot_cpu.set_activations(activations)
    ws = [qc.prepare_cpu_weight(w, torch.float32) for w in gguf_linears(model)]
    vocab = max(w.shape[0] for w in ws)
    ws = [w for w in ws if w.shape[0] < vocab]  # the LM head: the logits rows only
    old, out = dict(qc.QDOT_DENSE_MIN_ROWS), []
    try:
        for m in rows:
            xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in ws}}
            t = {"matvec": [], "dense": []}
            for r in range(rounds + 1):  # round 0 warms up
                for side in (("matvec", "dense") if r % 2 else ("dense", "matvec")):
                    qc.QDOT_DENSE_MIN_ROWS[activations] = 1 if side == "dense" else 1 << 30
                    start = time.perf_counter()
                    for w in ws:
                        qc.qdot_linear(xs[w.shape[1]], w)
                    if r:
                        t[side].append(time.perf_counter() - start)
            row = {"model": model, "activations": activations, "rows": m,
                   **{f"{k}_ms": round(statistics.median(v) * 1e3, 1) for k, v in t.items()}}
            out.append(row)
            print(row, flush=True)
    finally:
        qc.QDOT_DENSE_MIN_ROWS.update(old)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b,smollm2-135m")
    ap.add_argument("--activations", default="int8,int16")
    ap.add_argument("--rows", default="4,8,12,16,20,24,32,48")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "cpu_dense_rows.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from luceio.kernels import qdot_cpu
    kinds = [k for k in a.activations.split(",") if k == "int16" or qdot_cpu.int8_available()]
    results = {"env": env_info(), "threads": a.threads, "rows": []}
    for model in a.models.split(","):
        for kind in kinds:
            results["rows"] += measure(model, kind, [int(v) for v in a.rows.split(",")],
                                       a.rounds)
            write_json(a.out, results)


if __name__ == "__main__":
    main()
