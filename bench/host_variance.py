"""Why the same batch-1 decode runs at different speeds in different engines of one process.

    python bench/host_variance.py [--shape qwen2.5-0.5b] [--type Q4_K_M] [--engines 4]
                                  [--out bench/results/h200]

One random-weight model (decode_gguf.py's `random_model`) and `--engines` engines built on it in
turn, CUDA graphs on. Each engine decodes 128 tokens three times (bench/gpu_bench.py's timing),
so the spread inside an engine can be told from the spread between engines; then 128 decode
steps run under cProfile and the functions with the most own time per step are kept. Variants,
alternating with the plain engines: the logits computed after the graph replay instead of inside
it (`cuda_graphs.LOGITS_ROWS = 0`); with `--all`, also torch's CPU thread pool at one thread and
the garbage collector frozen after warm-up (`gc.freeze`). Writes OUT/host_variance.json.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402
from decode_gguf import random_model  # noqa: E402
from gpu_bench import luceio_decode_tps, make_engine  # noqa: E402

from luceio import SamplingParams  # noqa: E402


def profiled_steps(engine, ctx: int, steps: int) -> tuple[float, list]:
    """Wall µs per decode step over `steps` steps under cProfile, and the top functions by own
    time: (file:line function, calls per step, own µs per step)."""
    vocab = engine.runner.cfg.vocab_size
    engine.add_request(None, torch.randint(0, vocab, (ctx,)).tolist(),
                       SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_output_tokens == 0
                                          for r in engine.scheduler.running):
        engine.step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    n = 0
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
    prof.disable()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n * 1e6
    st = pstats.Stats(prof)
    rows = sorted(((f"{os.path.basename(k[0])}:{k[1]} {k[2]}", v[1] / n, v[2] / n * 1e6)
                   for k, v in st.stats.items()), key=lambda r: -r[2])
    return wall, [(name, round(calls, 2), round(us, 1)) for name, calls, us in rows[:25]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--engines", type=int, default=3, help="engines per variant")
    ap.add_argument("--all", action="store_true", help="the thread-pool and gc variants too")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    a = ap.parse_args()
    model = random_model(a.shape, a.type, a.context + 1024)
    results = {"env": env_info(), "shape": a.shape, "type": a.type, "context": a.context,
               "torch_threads": torch.get_num_threads(), "rows": []}
    from luceio import cuda_graphs
    logits_rows = cuda_graphs.LOGITS_ROWS
    variants = [("plain", None), ("logits after the graph", "logits")] * a.engines
    if a.all:
        variants += [("torch_threads=1", "threads")] * 2 + [("gc.freeze", "freeze")] * 2
    for i, (name, how) in enumerate(variants):
        if how == "threads":
            torch.set_num_threads(1)
        cuda_graphs.LOGITS_ROWS = 0 if how == "logits" else logits_rows
        eng = make_engine(model, a.context + 512, kv_gib=2, max_num_seqs=8)
        luceio_decode_tps(eng, a.context, new=32)  # graphs captured, first steps run
        if how == "freeze":
            gc.collect()
            gc.freeze()
        tps = [round(luceio_decode_tps(eng, a.context), 1) for _ in range(3)]
        wall, top = profiled_steps(eng, a.context, 128)
        row = {"engine": i, "variant": name, "tok_s": tps, "profiled_step_us": round(wall, 1),
               "gc_counts": gc.get_count(), "top_own_time": top}
        print(f"engine {i} {name}: tok/s {tps}, profiled step {wall:.0f} us; top: "
              + "; ".join(f"{n} {us}" for n, _, us in top[:6]), flush=True)
        results["rows"].append(row)
        write_json(os.path.join(a.out, "host_variance.json"), results)
        if how == "freeze":
            gc.unfreeze()
        del eng
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
