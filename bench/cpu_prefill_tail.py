"""Time to first token on the CPU when most of the prompt is already cached: a prompt whose
first `--context` tokens a request before it left in the prefix cache, followed by a tail of
T new tokens (a chat's next turn, an agent's tool result, a prompt's last chunk), on real GGUF
weights. Each row times `LLM.generate(..., max_tokens=1)` for that prompt, the tail fresh each
time (random tokens, so nothing of it is cached), median of `--repeats`.

Two rules for the tail's rows, alternated in one process:
- `by_rows` (session 44, the code's rule): a quantized weight multiplies M rows on the matvec
  kernels below `quant_cpu.dense_min_rows` and on dequantized bf16 tiles from there on, in a
  prompt's step as in any other;
- `dense` (sessions 13-43): a step computing prompt tokens multiplied every quantized weight on
  the dense path whatever M was, a one-token tail's step on the CPU decode path included
  (restored here by patching `quant_cpu.takes_dense_path` and the decode path's projections).

    python bench/cpu_prefill_tail.py [--model qwen2.5-coder-1.5b] [--context 512]
        [--tails 1,9,16,32,63,128] [--repeats 3] [--threads 2]
Writes bench/results/cpu/cpu_prefill_tail.json (`--out`).
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

from luceio import LLM, SamplingParams  # noqa: E402
from luceio.kernels import quant_cpu  # noqa: E402
from luceio.models import cpu_decode  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "results", "cpu", "cpu_prefill_tail.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--context", type=int, default=512, help="cached prompt tokens")
    ap.add_argument("--tails", default="1,9,16,32,63,128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    llm = LLM(a.model, device="cpu", max_model_len=a.context + 1024, cpu_threads=a.threads)
    vocab = llm.engine.runner.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, vocab - 100, (a.context,), generator=g).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([{"prompt_token_ids": prefix}], greedy, use_tqdm=False)  # cached from here on
    by_rows, projection = quant_cpu.takes_dense_path, cpu_decode._Projection.__call__

    def dense(m, w):
        return quant_cpu.in_prefill() or by_rows(m, w)

    def dense_projection(self, x, x_np):  # the CPU decode path's projections took it too
        if quant_cpu.in_prefill():
            y = self.lin(x)
            return y, y.numpy()
        return projection(self, x, x_np)

    rules = {"by_rows": (by_rows, projection), "dense": (dense, dense_projection)}
    for t in (1, 9):  # warm: buffers, numba's first calls
        llm.generate([{"prompt_token_ids": prefix + [7] * t}], greedy, use_tqdm=False)
    rows = []
    for t in (int(v) for v in a.tails.split(",")):
        times = {r: [] for r in rules}
        for rep in range(a.repeats):
            # each run gets a tail of its own (a run caches its tail's full blocks), and the
            # rules take turns going first
            for name in sorted(rules, reverse=rep % 2 == 1):
                tail = torch.randint(100, vocab - 100, (t,), generator=g).tolist()
                quant_cpu.takes_dense_path, cpu_decode._Projection.__call__ = rules[name]
                try:
                    start = time.perf_counter()
                    llm.generate([{"prompt_token_ids": prefix + tail}], greedy, use_tqdm=False)
                    times[name].append(time.perf_counter() - start)
                finally:
                    quant_cpu.takes_dense_path, cpu_decode._Projection.__call__ = rules["by_rows"]
        row = {"tail": t, **{f"{r}_ms": round(1e3 * statistics.median(v), 1)
                             for r, v in times.items()}}
        row["speedup"] = round(row["dense_ms"] / row["by_rows_ms"], 2)
        rows.append(row)
        print(row, flush=True)
    write_json(a.out, {"env": env_info(), "model": a.model, "context": a.context,
                       "threads": a.threads, "repeats": a.repeats, "rows": rows})


if __name__ == "__main__":
    main()
