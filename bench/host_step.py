"""The engine's host work per decode step at many concurrent requests, on the CPU: scheduling,
batch building, sampling, output processing and detokenization, without the forward.

A one-layer Qwen2-shaped model (hidden 64, vocabulary 8,192: the real tokenizer's first ids,
its common pieces) with the real tokenizer that `bench/assist.py --export-tokenizer DIR`
wrote, so the forward and the logits are small (on a GPU, processing logits is device work)
and every step builds real text; `--batch` greedy requests decode together with overlapped
scheduling.

- `LLMEngine.step`: the step's wall time minus the wall time inside `ModelRunner.execute` (the
  forward), per step; the least of `--repeats` runs (this machine's speed varies run to run).
- `AsyncEngine`: output tokens per second with `--batch` concurrent streams (delta outputs),
  forward included; the best of `--repeats` runs.

`--baseline REV` runs the same measurements on git revision REV first (a temporary worktree,
in a subprocess, alternating with this tree), so both land in one JSON from one run:

    python bench/host_step.py --tokenizer .models/qwen2.5-coder-tok [--batch 64] [--baseline REV]
        [--out bench/results/cpu/host_step.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_checkpoint(tokenizer: str, folder: str) -> str:
    import torch
    import transformers
    cfg = transformers.Qwen2Config(vocab_size=8192, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=4096,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(folder)
    for name in os.listdir(tokenizer):
        if name != "config.json":
            shutil.copy(os.path.join(tokenizer, name), folder)
    return folder


def measure(model: str, batch: int, steps: int, repeats: int) -> dict:
    import torch
    from luceio import SamplingParams
    from luceio.async_engine import AsyncEngine
    from luceio.config import EngineArgs
    from luceio.engine import LLMEngine
    from luceio.sampling_params import RequestOutputKind
    args = EngineArgs(model=model, dtype="float32", device="cpu", max_model_len=2048,
                      max_num_seqs=batch, max_num_batched_tokens=8192, async_scheduling=True,
                      kv_cache_memory=512 << 20, cpu_threads=1)
    eng = LLMEngine(args)
    forward = [0.0]
    execute = eng.runner.execute

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return execute(*a, **k)
        finally:
            forward[0] += time.perf_counter() - t
    eng.runner.execute = timed
    vocab = eng.runner.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    def prompt():
        return torch.randint(0, vocab, (64,), generator=gen).tolist()

    def one_run() -> tuple[float, float]:
        for _ in range(batch):
            eng.add_request(None, prompt(), params)
        while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
            eng.step()
        n, forward[0] = 0, 0.0
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            n += 1
        wall = time.perf_counter() - t
        return wall / n * 1e6, (wall - forward[0]) / n * 1e6

    runs = [one_run() for _ in range(repeats + 1)][1:]  # the first compiles numba kernels
    aeng = AsyncEngine(eng)

    async def streams() -> float:
        async def consume():
            async for _ in aeng.generate(prompt(), params):
                pass
        t = time.perf_counter()
        await asyncio.gather(*(consume() for _ in range(batch)))
        return batch * steps / (time.perf_counter() - t)

    async def all_streams() -> list[float]:
        return [await streams() for _ in range(repeats)]
    rates = asyncio.run(all_streams())
    aeng.close()
    import luceio
    return {"luceio": os.path.dirname(luceio.__file__), "step_us": round(min(r[0] for r in runs), 1),
            "host_us": round(min(r[1] for r in runs), 1),
            "host_us_runs": [round(r[1], 1) for r in runs],
            "async_tok_s": round(max(rates), 1), "async_tok_s_runs": [round(r, 1) for r in rates]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2, help="alternations with --baseline")
    ap.add_argument("--baseline", help="a git revision measured alternately with this tree")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu", "host_step.json"))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.child, a.batch, a.steps, a.repeats)))
        return
    sys.path.insert(0, HERE)
    from common import env_info, source_trees
    tmp = tempfile.mkdtemp()
    model = tiny_checkpoint(a.tokenizer, os.path.join(tmp, "model"))
    try:
        with source_trees(os.path.dirname(HERE), a.baseline, tmp) as trees:
            results = {"env": env_info(), "batch": a.batch, "steps": a.steps,
                       "repeats": a.repeats, "runs": {name: [] for name in trees}}
            for _ in range(a.rounds if a.baseline else 1):
                for name, root in trees.items():
                    env = dict(os.environ, PYTHONPATH=root)
                    out = subprocess.run([sys.executable, os.path.join(HERE, "host_step.py"),
                                          "--tokenizer", a.tokenizer, "--child", model,
                                          "--batch", str(a.batch), "--steps", str(a.steps),
                                          "--repeats", str(a.repeats)], cwd=root, env=env,
                                         check=True, capture_output=True, text=True)
                    row = json.loads(out.stdout.strip().splitlines()[-1])
                    print(name, row, flush=True)
                    results["runs"][name].append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["best"] = {name: {"host_us": min(r["host_us"] for r in rows),
                              "step_us": min(r["step_us"] for r in rows),
                              "async_tok_s": max(r["async_tok_s"] for r in rows)}
                       for name, rows in results["runs"].items()}
    print(json.dumps(results["best"], indent=1))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
