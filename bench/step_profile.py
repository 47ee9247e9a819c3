"""Where a batch-1 decode step's time goes on the GPU: kernels launched per step, their summed
GPU time, the step's wall time, and the share of the step the GPU sat idle. Random weights at
real shapes through the load path (decode_gguf.py's `random_model`), CUDA graphs on and off.

    python bench/step_profile.py [--shapes qwen2.5-0.5b,qwen2.5-7b] [--types Q4_K_M]
                                 [--context 512] [--steps 32] [--out bench/results/h200]
                                 [--set FIELD=VALUE ...] [--no-eager] [--max-model-len N]

Steps are timed by torch.profiler (CUPTI): with CUDA graphs it still records the kernels the
graph runs. `idle_fraction` = 1 - (GPU time of the step's kernels, overlaps merged) / (wall
time per step), over `--steps` consecutive decode steps of one request. `top_kernels`: the
kernels with the most GPU time per step (name, launches per step, microseconds per step).
The profiler slows the host side, so `tok_s_unprofiled` (bench/gpu_bench.py's decode timing
of 128 tokens, same engine, just before) is the speed to quote; `--set` repeats every row
with kernel-config fields changed (`kernels/configs.py`; "a=1,b=2" changes two at once).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info  # noqa: E402
from decode_gguf import random_model  # noqa: E402
from gpu_bench import make_engine  # noqa: E402

from luceio import SamplingParams  # noqa: E402


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on other streams may overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def profile_decode(eng, ctx: int, steps: int) -> dict:
    vocab = eng.runner.cfg.vocab_size
    eng.add_request(None, torch.randint(0, vocab, (ctx,)).tolist(),
                    SamplingParams(temperature=0, max_tokens=steps + 24, ignore_eos=True))
    while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        eng.step()
    for _ in range(8):  # warm: graphs replayed, allocator settled
        eng.step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    while eng.has_unfinished_requests():
        eng.step()
    k = kernel_summary(prof, steps, top=12, width=90)
    step_us = wall * 1e6 / steps
    return {"steps": steps, "step_us": round(step_us, 1), "tok_s": round(steps / wall, 1),
            "kernels_per_step": k["kernels"], "copies_per_step": k["copies"],
            "gpu_busy_us_per_step": k["gpu_busy_us"],
            "idle_fraction": round(max(0.0, 1 - k["gpu_busy_us"] / step_us), 3),
            "top_kernels": k["top_kernels"]}


def kernel_summary(prof, calls: int, top: int = 12, width: int = 90) -> dict:
    """Per call of what a torch.profiler run recorded: kernels, copies (Memcpy / Memset), the
    GPU's busy time (the union of their spans) and the `top` kernels by time as (name, launches,
    microseconds)."""
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in gpu if not e.name.startswith(("Memcpy", "Memset"))]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    busy = _busy_us([(e.time_range.start, e.time_range.end) for e in gpu])
    return {"kernels": round(len(kernels) / calls, 1),
            "copies": round((len(gpu) - len(kernels)) / calls, 1),
            "gpu_busy_us": round(busy / calls, 1),
            "top_kernels": [(name[:width], round(len(v) / calls, 1), round(sum(v) / calls, 1))
                            for name, v in ranked]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-7b")
    ap.add_argument("--types", default="Q4_K_M")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    ap.add_argument("--json-name", default="step_profile.json")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                    help="run again with these kernel-config fields changed (an A/B in one run)")
    ap.add_argument("--no-eager", action="store_true", help="CUDA graphs only")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's max_model_len, which sizes the graphs' attention grids "
                         "(default: context + 512)")
    a = ap.parse_args()
    max_len = a.max_model_len or a.context + 512
    results = {"env": env_info(), "context": a.context, "max_model_len": max_len, "rows": []}
    path = os.path.join(a.out, a.json_name)
    os.makedirs(a.out, exist_ok=True)
    import contextlib
    import dataclasses

    from gpu_bench import luceio_decode_tps
    from luceio.kernels import configs
    variants = [("table", None)]
    base = configs.get_config(torch.device("cuda"))
    for item in a.set:
        changes = {}
        for change in item.split(","):
            field, value = change.split("=", 1)
            kind_of = type(getattr(base, field))
            changes[field] = value.lower() in ("1", "true") if kind_of is bool else kind_of(value)
        variants.append((item, dataclasses.replace(base, **changes)))
    for shape in a.shapes.split(","):
        for kind in a.types.split(","):
            model = random_model(shape, kind, max(a.context + 1024, max_len))
            for name, cfg in variants:
                for eager in (False,) if a.no_eager else (False, True):
                    with configs.use_config(cfg) if cfg is not None else contextlib.nullcontext():
                        eng = make_engine(model, max_len, kv_gib=2, max_num_seqs=8,
                                          enforce_eager=eager)
                        row = {"shape": shape, "type": kind, "config": name,
                               "cuda_graphs": not eager,
                               "tok_s_unprofiled": round(luceio_decode_tps(eng, a.context), 1),
                               **profile_decode(eng, a.context, a.steps)}
                    print(json.dumps(row), flush=True)
                    results["rows"].append(row)
                    del eng
                    torch.cuda.empty_cache()
                    with open(path, "w") as f:
                        json.dump(results, f, indent=1)
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
