"""The CPU decode matvecs of a git revision against this tree's, in one process: every quantized
tensor of the real GGUF once per round (a decode step's matmuls, the LM head included, M = 1;
`--rows 2,5`: as many activation rows, a few requests' step or a speculative verify),
the two sides alternating round by round, each prepared by its own `qdot_cpu.prepare` (its
own layouts) and called through its own `qdot_cpu.matvec`.

    python bench/cpu_kernels_ab.py --base 6508cc1 [--models ...] [--activations int8,int16]
                                   [--rows 1,2,5]

The base revision's qdot_cpu.py, qdot_kernels_cpu.py, qdot8_kernels_cpu.py (and the IR files) are read with
`git show` into a temporary package (`luceio_base.kernels`, its `quant` the tree's). This box's
memory bandwidth drifts by 20-40% from minute to minute (other tenants); rounds alternate, so
both sides see the same drift, and the result is the median over rounds of old/new per round,
with its quartiles. Writes bench/results/cpu/cpu_kernels_ab.json (`--out`).
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402

FILES = ("qdot_cpu.py", "qdot_kernels_cpu.py", "qdot8_kernels_cpu.py", "numba_cache.py",
         "qdot_ir_cpu.py", "qdot8_ir_cpu.py")
"""The kernels' files (numba_cache.py, qdot_ir_cpu.py and qdot8_ir_cpu.py only from the
sessions that added them: skipped where absent; without numba_cache.py the base's kernels would
fail to import and its int8 activations be refused)."""


def base_package(rev: str, root: str):
    """`luceio_base.kernels.qdot_cpu` at git revision `rev`, written under `root`."""
    pkg = os.path.join(root, "luceio_base", "kernels")
    os.makedirs(pkg)
    open(os.path.join(root, "luceio_base", "__init__.py"), "w").close()
    open(os.path.join(pkg, "__init__.py"), "w").close()
    with open(os.path.join(pkg, "quant.py"), "w") as f:
        f.write("from luceio.kernels.quant import *  # noqa: F401,F403\n"
                "from luceio.kernels.quant import QuantWeight  # noqa: F401\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in FILES:
        got = subprocess.run(["git", "show", f"{rev}:luceio/kernels/{name}"], cwd=repo,
                             capture_output=True, text=True)
        if got.returncode:
            if name in FILES[-3:]:
                continue
            raise RuntimeError(got.stderr)
        with open(os.path.join(pkg, name), "w") as f:
            f.write(got.stdout)
    sys.path.insert(0, root)
    return importlib.import_module("luceio_base.kernels.qdot_cpu")


def compare(model: str, activations: str, base, rounds: int, rows: int = 1) -> dict:
    from cpu_qlinear import gguf_linears

    from luceio.kernels import qdot_cpu
    sides = {"base": base, "tree": qdot_cpu}
    weights = {name: [] for name in sides}
    for w in gguf_linears(model):
        for name, mod in sides.items():
            weights[name].append(mod.prepare(w, torch.float32, activations))
    xs = {k: np.random.default_rng(0).standard_normal((rows, k), dtype=np.float32)
          for k in {w.shape[1] for w in weights["tree"]}}
    outs = [np.zeros((rows, w.shape[0]), np.float32) for w in weights["tree"]]
    times = {name: [] for name in sides}
    for r in range(rounds + 1):
        order = list(sides) if r % 2 else list(sides)[::-1]
        for name in order:
            mod, ws = sides[name], weights[name]
            t = time.perf_counter()
            for w, out in zip(ws, outs):
                mod.matvec(xs[w.shape[1]], w, out)
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - t)
    ratios = [b / t for b, t in zip(times["base"], times["tree"])]
    nbytes = sum(w.nbytes for w in weights["tree"])
    med = {name: statistics.median(v) for name, v in times.items()}
    return {"model": model, "activations": activations, "rows": rows, "rounds": rounds,
            "base_ms": round(med["base"] * 1e3, 2), "tree_ms": round(med["tree"] * 1e3, 2),
            "base_GBps": round(nbytes / med["base"] / 1e9, 1),
            "tree_GBps": round(nbytes / med["tree"] / 1e9, 1),
            "speedup_quartiles": [round(float(q), 3) for q in np.percentile(ratios, [25, 50, 75])]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--activations", default="int8,int16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1", help="activation rows per matvec, e.g. 1,2,5")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "cpu_kernels_ab.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from luceio.kernels import qdot_cpu
    kinds = [k for k in a.activations.split(",") if k != "int8" or qdot_cpu.int8_available()]
    results = {"env": env_info(), "base": a.base, "threads": a.threads, "rows": []}
    with tempfile.TemporaryDirectory() as root:
        base = base_package(a.base, root)
        for model in a.models.split(","):
            for kind in kinds:
                for rows in (int(v) for v in a.rows.split(",")):
                    row = compare(model, kind, base, a.rounds, rows)
                    results["rows"].append(row)
                    print(row, flush=True)
                    write_json(a.out, results)


if __name__ == "__main__":
    main()
