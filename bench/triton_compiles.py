"""Which Triton compiles (and which slow engine steps) land in gpu_bench.py's concurrency section:
Triton's JIT cache hook prints every in-memory cache miss (a compile, or a load from the disk
cache) with a timestamp, the engine's step pipeline prints every step over `--slow-ms`, and
each concurrency phase prints its start and result. The section runs twice in one process,
so the second pass shows what a warmed process does. GPU only (the CPU path runs no Triton).

    python bench/triton_compiles.py [--slow-ms 60] > compiles.log
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import triton

sys.path.insert(0, os.path.dirname(__file__))
import gpu_bench  # noqa: E402

from luceio import pipeline  # noqa: E402

T0 = time.perf_counter()


def _now() -> float:
    return round((time.perf_counter() - T0) * 1000, 1)


def _on_miss(**kw):
    print(f"[{_now()} ms] COMPILE-MISS {str(kw.get('repr', '?'))[:400]}", flush=True)
    return None  # go on and compile


def _on_compiled(**kw):
    print(f"[{_now()} ms] COMPILED {str(kw.get('repr', '?'))[:120]}", flush=True)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slow-ms", type=float, default=60.0)
    a = ap.parse_args()
    triton.knobs.runtime.jit_cache_hook = _on_miss
    triton.knobs.runtime.jit_post_compile_hook = _on_compiled
    step = pipeline.StepPipeline.step

    def timed_step(self):
        t = time.perf_counter()
        out = step(self)
        ms = (time.perf_counter() - t) * 1000
        if ms > a.slow_ms:
            sch = self.engine.scheduler
            print(f"[{_now()} ms] SLOW STEP {ms:.1f} ms running={len(sch.running)} "
                  f"waiting={len(sch.waiting)}", flush=True)
        return out
    pipeline.StepPipeline.step = timed_step
    concurrent = gpu_bench._concurrent

    async def phase(engine, n, prompt, new):
        print(f"[{_now()} ms] PHASE n={n} new={new}", flush=True)
        r = await concurrent(engine, n, prompt, new)
        print(f"[{_now()} ms] PHASE END n={n} new={new} {r}", flush=True)
        return r
    gpu_bench._concurrent = phase
    gpu_bench.section_concurrency(True, None, 1)
    gpu_bench.section_concurrency(True, None, 1)


if __name__ == "__main__":
    main()
