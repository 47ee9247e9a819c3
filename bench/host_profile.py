"""Where a decode step's host time goes: cProfile over `--steps` batch-1 decode steps of
`LLMEngine.step` (random weights at a real shape through the load path, CUDA graphs, overlapped
scheduling as the engine defaults), after the same steps timed without the profiler.

    python bench/host_profile.py [--shape qwen2.5-0.5b] [--types bf16,Q4_K_M] [--context 512]
                                 [--steps 200] [--batch 1] [--out bench/results/h200]

`--eager`: without CUDA graphs (every kernel launched from Python each step).
`--batch N`: N requests decode together (the step's host work grows with it: scheduling,
batch building, output processing).

Per row: the unprofiled step time, then the functions with the most own time (`tottime`) and
the most time including callees (`cumtime`), in microseconds per step. cProfile slows Python
calls (roughly 2x on small functions), so the shares matter, not the absolute numbers.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info  # noqa: E402
from decode_gguf import random_model  # noqa: E402
from gpu_bench import make_engine  # noqa: E402

from luceio import SamplingParams  # noqa: E402


def _start(eng, ctx: int, steps: int, batch: int) -> None:
    vocab = eng.runner.cfg.vocab_size
    for _ in range(batch):
        eng.add_request(None, torch.randint(0, vocab, (ctx,)).tolist(),
                        SamplingParams(temperature=0, max_tokens=2 * steps + 64, ignore_eos=True))
    while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        eng.step()
    for _ in range(16):
        eng.step()
    torch.cuda.synchronize()


def _rows(stats: pstats.Stats, key: int, steps: int, n: int) -> list:
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][key])[:n]
    out = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in entries:
        where = f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}:{line}"
        out.append([f"{where}({name})", round(ncalls / steps, 2),
                    round(tottime * 1e6 / steps, 1), round(cumtime * 1e6 / steps, 1)])
    return out


def profile(eng, ctx: int, steps: int, batch: int = 1) -> dict:
    _start(eng, ctx, steps, batch)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    plain_us = (time.perf_counter() - t) * 1e6 / steps
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    profiled_us = (time.perf_counter() - t) * 1e6 / steps
    eng.abort_request([r.request_id for r in list(eng.scheduler.running)])
    while eng.has_unfinished_requests():
        eng.step()
    stats = pstats.Stats(prof)
    return {"steps": steps, "step_us": round(plain_us, 1), "profiled_step_us": round(profiled_us, 1),
            "columns": ["function", "calls/step", "own us/step", "cum us/step"],
            "by_own_time": _rows(stats, 2, steps, 40), "by_cum_time": _rows(stats, 3, steps, 40)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--types", default="bf16,Q4_K_M")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    ap.add_argument("--json-name", default="host_profile.json")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (--enforce-eager)")
    a = ap.parse_args()
    results = {"env": env_info(), "shape": a.shape, "context": a.context, "batch": a.batch,
               "eager": a.eager, "rows": []}
    os.makedirs(a.out, exist_ok=True)
    for kind in a.types.split(","):
        model = random_model(a.shape, kind, a.context + 2048)
        eng = make_engine(model, a.context + 1024, kv_gib=2 if a.batch <= 8 else 8,
                          max_num_seqs=max(8, a.batch), enforce_eager=a.eager)
        row = {"type": kind, **profile(eng, a.context, a.steps, a.batch)}
        results["rows"].append(row)
        print(json.dumps({k: row[k] for k in ("type", "step_us", "profiled_step_us")}), flush=True)
        for r in row["by_own_time"][:25]:
            print("  ", r, flush=True)
        del eng, model
        torch.cuda.empty_cache()
        with open(os.path.join(a.out, a.json_name), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
