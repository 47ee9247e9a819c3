"""CPU decode at long contexts: the decode path's attention (`rows_attention_cpu`: a request's
rows, query heads as vector lanes, each key read once) against the kernel before it
(`decode_cpu`: a row at a time, the split attention `decode_attention_split` on numba's threads
from `_MIN_KEYS` keys, or one thread's `decode_attention`), in one run.

1. Kernel: one layer's attention at the Qwen2.5-Coder-0.5B shape (14 query / 2 KV heads of 64,
   fp32 cache), batch 1, contexts `--kernel-contexts`; median of `--repeats` calls.
2. Engine: a real model (`--model`, default Qwen2.5-Coder-0.5B Q4_K_M, `--cpu-threads`), one
   request, decode tok/s after prompts of `--contexts` tokens (`--new` tokens, greedy), with
   each kernel (before: the decoder's step plan dropped, so every layer takes `decode_cpu`),
   for each `--kv-cache-dtypes` (fp32 and bf16 caches); with `--ngram` also with n-gram
   speculation (the prompt is a source file repeated, so drafts hit, as in an edit). The
   kernels alternate, `--rounds` runs each, medians; each run's greedy tokens are compared
   with the first engine's on the rows kernel (plain, fp32 cache).

    python bench/cpu_long_decode.py [--contexts 512,4096,8192] [--threads 2] [--new 32]
        [--ngram] [--model qwen2.5-coder-1.5b] [--kv-cache-dtypes auto,bfloat16]
Writes bench/results/cpu/cpu_long_decode.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import cpu_median_ms, env_info, write_json  # noqa: E402

from luceio.kernels import decode_cpu, rows_attention_cpu  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "results", "cpu", "cpu_long_decode.json")


def kernel_rows(contexts, threads: int, repeats: int) -> list[dict]:
    import numba
    from luceio.kernels.rotary import build_cos_sin_cache
    numba.set_num_threads(threads)
    heads, kv_heads, dim, bs = 14, 2, 64, 16
    rows = []
    for ctx in contexts:
        blocks = ctx // bs + 1
        kv = np.random.default_rng(0).standard_normal((2, blocks, bs, kv_heads, dim),
                                                      dtype=np.float32)
        qkv = np.random.default_rng(1).standard_normal((1, (heads + 2 * kv_heads) * dim),
                                                       dtype=np.float32)
        cos_sin = build_cos_sin_cache(dim, ctx + 1, 10000.0).numpy()
        pos = np.array([ctx - 1]), np.array([ctx - 1])
        tables = np.arange(blocks, dtype=np.int32)[None]
        lens = np.array([ctx], dtype=np.int32)
        none = np.zeros(0, np.float32)
        out = np.empty((1, heads * dim), np.float32)
        args = (qkv, cos_sin, pos[0], kv, pos[1], tables, lens, heads, none, none, 1e-6, out,
                dim ** -0.5, 0)
        splits = max(decode_cpu.attention_splits(lens, 0), 2)
        one = cpu_median_ms(lambda: decode_cpu.decode_attention(*args), repeats)
        split = cpu_median_ms(lambda: decode_cpu.decode_attention_split(*args, splits), repeats)
        plan = rows_attention_cpu.RowsAttention(np.array([0, 1]), lens, np.array([-1]), tables,
                                                heads, kv_heads, dim)
        rows_ms = cpu_median_ms(lambda: plan(qkv, cos_sin, pos[0], kv, pos[1], none, none,
                                             1e-6, out, dim ** -0.5), repeats)
        row = {"context": ctx, "threads": threads, "rows_kernel_ms": round(rows_ms, 3),
               "splits": splits, "one_thread_ms": round(one, 3), "split_ms": round(split, 3),
               "rows_vs_split": round(split / rows_ms, 2)}
        print(row, flush=True)
        rows.append(row)
    return rows


def engine_rows(model: str, contexts, threads: int, new: int, ngram: bool, rounds: int,
                kv_dtypes: list[str]) -> list[dict]:
    from luceio import LLM, SamplingParams
    from luceio.models.cpu_decode import CpuDecoder
    kw = dict(device="cpu", max_model_len=max(contexts) + new + 8, cpu_threads=threads)
    llms = {}  # "plain" / "ngram", suffixed "_bf16kv" for --kv-cache-dtype bfloat16
    for kv in kv_dtypes:
        tag = "" if kv == "auto" else "_bf16kv"
        llms["plain" + tag] = LLM(model, kv_cache_dtype=kv, **kw)
        if ngram:
            llms["ngram" + tag] = LLM(model, speculative_method="ngram", kv_cache_dtype=kv, **kw)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0)
    text = open(os.path.join(os.path.dirname(__file__), "..", "luceio", "engine.py")).read()
    ids = next(iter(llms.values())).get_tokenizer().encode(text * 8)
    batch = CpuDecoder._batch
    rows = []
    for ctx in contexts:
        prompt = ids[:ctx]
        row = {"context": ctx, "threads": threads, "rounds": rounds}
        tokens = {}
        for name, llm in llms.items():
            llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1),
                         use_tqdm=False)  # the prompt cached: the timed runs decode
            times = {"rows": [], "before": []}
            for _ in range(rounds):  # the kernels alternate: the box's drift hits both
                for kernel in times:
                    CpuDecoder._batch = batch if kernel == "rows" else \
                        (lambda self, p, m: batch(self, p, m)[:4] + (None,))
                    t = time.perf_counter()
                    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
                    times[kernel].append(new / (time.perf_counter() - t))
                    o = out.outputs[0]
                    tokens.setdefault((name, kernel), (o.token_ids, [
                        lp[tok].logprob for lp, tok in zip(o.logprobs, o.token_ids)]))
            CpuDecoder._batch = batch
            for kernel, v in times.items():
                row[f"{name}_{kernel}_tok_s"] = round(float(np.median(v)), 2)
            row[f"{name}_speedup"] = round(row[f"{name}_rows_tok_s"] / row[f"{name}_before_tok_s"], 2)
        # greedy tokens, and their log-probabilities bit for bit, against plain decoding with
        # the rows kernel (the CPU decode path is batch-invariant: a verify step's rows equal
        # decode steps; the kernel before sums long contexts in other ranges and may part at a
        # near tie)
        first = (next(iter(llms)), "rows")
        for (name, kernel), (ids_, lps) in tokens.items():
            if (name, kernel) != first:
                row[f"{name}_{kernel}_same_tokens"] = ids_ == tokens[first][0]
                row[f"{name}_{kernel}_same_logprobs"] = lps == tokens[first][1]
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,4096,8192")
    ap.add_argument("--kernel-contexts", default="512,2048,8192,32768")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--ngram", action="store_true", help="also with n-gram speculation")
    ap.add_argument("--rounds", type=int, default=3, help="timed runs of each kernel (medians)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--kv-cache-dtypes", default="auto,bfloat16",
                    help="engines with these --kv-cache-dtype values")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = {"env": env_info(), "kernel": kernel_rows(
        [int(c) for c in a.kernel_contexts.split(",")], a.threads, a.repeats)}
    if not a.skip_engine:
        res["engine"] = engine_rows(a.model, [int(c) for c in a.contexts.split(",")], a.threads,
                                    a.new, a.ngram, a.rounds, a.kv_cache_dtypes.split(","))
    write_json(a.out, res)


if __name__ == "__main__":
    main()
