"""What AsyncEngine costs per step over calling LLMEngine.step() in a loop: the same requests
(DELTA streaming, greedy, no EOS; each output's tokens counted by its consumer) on the same
engine, driven three ways in alternating trials: `sync` (step() in a loop), `handoff` (the floor
of any design that hands each step to an event loop: one call_soon_threadsafe per step, nothing
else) and `async` (AsyncEngine). Reported against sync: the median ratio of neighbouring trials,
the ratio of the fastest trials, and CPU time (all threads) per step.
On the CPU with random weights at a bench/common.py shape (default: the tests' tiny model, where a
step is almost all host work, so an overhead shows in full). Writes
bench/results/cpu/async_overhead.json. `--device cuda`: bf16 weights on the GPU, CUDA graphs
(the issue's goal: AsyncEngine within 3% of LLMEngine.step).

    python bench/async_overhead.py [--shape tiny] [--batch 1,8,64] [--new 256] [--trials 15]
                                   [--device cpu|cuda] [--out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, random_model, write_json  # noqa: E402

from luceio import AsyncEngine, EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from luceio.sampling_params import RequestOutputKind  # noqa: E402

PROMPT_LEN = 16


def make_engine(shape: str, threads: int, device: str = "cpu") -> LLMEngine:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    args = EngineArgs(model="random", dtype=str(dtype).removeprefix("torch."), device=device,
                      cpu_threads=threads, max_model_len=512, num_kv_blocks=4096,
                      max_num_seqs=64, seed=0)
    return LLMEngine(args, model=random_model(shape, dtype, device))


def requests(engine: LLMEngine, batch: int, new: int):
    vocab = engine.runner.cfg.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    return prompts, params


def sync_trial(engine: LLMEngine, prompts, params) -> tuple[float, float, int]:
    """Wall and CPU seconds, and engine steps, to run the requests with step() in a loop."""
    for p in prompts:
        engine.add_request(None, p, params)
    steps, t, cpu = engine.counters["steps"], time.perf_counter(), time.process_time()
    n = 0
    while engine.has_unfinished_requests():
        for out in engine.step():  # what the async consumers do with each output
            n += len(out.outputs[0].token_ids)
    assert n == params.max_tokens * len(prompts)
    return time.perf_counter() - t, time.process_time() - cpu, engine.counters["steps"] - steps


def async_trial(engine: LLMEngine, prompts, params) -> tuple[float, float, int]:
    """The same through AsyncEngine, one consumer task per request reading every output."""
    async def consume(ae: AsyncEngine, prompt, p) -> int:
        n = 0
        async for out in ae.generate(prompt, p):
            n += len(out.outputs[0].token_ids)
        return n

    async def run():
        ae = AsyncEngine(engine)
        await consume(ae, prompts[0], params.clone(max_tokens=2))  # starts the engine's thread
        steps, t, cpu = engine.counters["steps"], time.perf_counter(), time.process_time()
        counts = await asyncio.gather(*(consume(ae, p, params) for p in prompts))
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
        assert counts == [params.max_tokens] * len(prompts)
        await ae.shutdown()
        return wall, cpu, engine.counters["steps"] - steps
    return asyncio.run(run())


def handoff_trial(engine: LLMEngine, prompts, params) -> tuple[float, float, int]:
    """The least a design that hands each step's outputs to an event loop can cost: step() in a
    loop on a thread, one call_soon_threadsafe per step to a callback that counts the tokens
    (no queues, no streams, no consumer tasks)."""
    async def run():
        loop = asyncio.get_running_loop()
        done, counted = loop.create_future(), [0]

        def count(outs):
            counted[0] += sum(len(o.outputs[0].token_ids) for o in outs)

        def drive():
            while engine.has_unfinished_requests():
                loop.call_soon_threadsafe(count, engine.step())
            loop.call_soon_threadsafe(done.set_result, None)

        for p in prompts:
            engine.add_request(None, p, params)
        steps, t, cpu = engine.counters["steps"], time.perf_counter(), time.process_time()
        thread = threading.Thread(target=drive)
        thread.start()
        await done
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
        thread.join()
        assert counted[0] == params.max_tokens * len(prompts)
        return wall, cpu, engine.counters["steps"] - steps
    return asyncio.run(run())


TRIALS = {"sync": sync_trial, "handoff": handoff_trial, "async": async_trial}


def measure(engine: LLMEngine, batch: int, new: int, trials: int) -> dict:
    prompts, params = requests(engine, batch, new)
    sync_trial(engine, prompts, params)  # warm-up
    wall: dict[str, list[float]] = {k: [] for k in TRIALS}  # ms per step, one per trial
    cpu: dict[str, list[float]] = {k: [] for k in TRIALS}
    for _ in range(trials):  # alternating, so drift on a shared machine hits all alike
        for name, trial in TRIALS.items():
            seconds, cpu_seconds, steps = trial(engine, prompts, params)
            wall[name].append(seconds / steps * 1e3)
            cpu[name].append(cpu_seconds / steps * 1e3)
    row = {"batch": batch, "new_tokens": new, "steps": steps}
    for mode in ("handoff", "async"):
        ratios = [a / b for a, b in zip(wall[mode], wall["sync"])]
        row[mode] = {  # neighbouring trials share the machine's state: their ratio cancels drift
            "paired_wall_ratio_median": round(statistics.median(ratios), 4),
            "fastest_wall_ratio": round(min(wall[mode]) / min(wall["sync"]), 4),
            "fastest_overhead_us_per_step": round((min(wall[mode]) - min(wall["sync"])) * 1e3, 1),
            "cpu_ratio_median": round(statistics.median(cpu[mode]) /
                                      statistics.median(cpu["sync"]), 4)}
    row["sync_fastest_ms_per_step"] = round(min(wall["sync"]), 4)
    row["trials_wall_ms_per_step"] = {k: [round(v, 4) for v in vs] for k, vs in wall.items()}
    print(f"batch {batch:3d}: LLMEngine.step {row['sync_fastest_ms_per_step']:.3f} ms/step; " +
          "; ".join(f"{mode} x{r['paired_wall_ratio_median']:.3f} paired median, "
                    f"x{r['fastest_wall_ratio']:.3f} fastest "
                    f"({r['fastest_overhead_us_per_step']:+.1f} us/step), CPU "
                    f"x{r['cpu_ratio_median']:.3f}"
                    for mode, r in ((m, row[m]) for m in ("handoff", "async"))))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "async_overhead.json"))
    a = ap.parse_args()
    engine = make_engine(a.shape, a.threads, a.device)
    rows = [measure(engine, int(b), a.new, a.trials) for b in a.batch.split(",")]
    write_json(a.out, {"env": env_info(), "shape": a.shape, "device": a.device,
                       "torch_threads": a.threads,
                       "cpu_count": os.cpu_count(), "rows": rows})


if __name__ == "__main__":
    main()
