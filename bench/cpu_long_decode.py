"""CPU decode at long contexts: the split attention (`decode_cpu.decode_attention_split`, each
request's keys in ranges on numba's threads, softmaxes merged) against one thread's
`decode_attention`, in one run.

1. Kernel: one layer's attention at the Qwen2.5-Coder-0.5B shape (14 query / 2 KV heads of 64,
   fp32 cache), batch 1, contexts `--contexts`; median of `--repeats` calls.
2. Engine: real Qwen2.5-Coder-0.5B (Q4_K_M GGUF, `--cpu-threads`), one request, decode tok/s
   after prompts of the same lengths (`--new` tokens, greedy), with the split path on and off
   (off: `_MIN_KEYS` raised past the context); the greedy tokens of both must agree.

    python bench/cpu_long_decode.py [--contexts 512,4096,8192] [--threads 2] [--new 32]
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

from luceio.kernels import decode_cpu  # noqa: E402

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
        row = {"context": ctx, "threads": threads, "splits": splits,
               "one_thread_ms": round(one, 3), "split_ms": round(split, 3),
               "speedup": round(one / split, 2)}
        print(row, flush=True)
        rows.append(row)
    return rows


def engine_rows(contexts, threads: int, new: int) -> list[dict]:
    from luceio import LLM, SamplingParams
    llm = LLM("qwen2.5-coder-0.5b", device="cpu", max_model_len=max(contexts) + new + 8,
              cpu_threads=threads)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    text = open(os.path.join(os.path.dirname(__file__), "..", "luceio", "engine.py")).read()
    ids = llm.get_tokenizer().encode(text * 8)
    rows = []
    default = decode_cpu._MIN_KEYS
    for ctx in contexts:
        prompt = ids[:ctx]
        got = {}
        for mode in ("split", "one thread"):
            decode_cpu._MIN_KEYS = default if mode == "split" else 1 << 30
            llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1),
                         use_tqdm=False)  # the prompt cached: the timed run decodes
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            wall = time.perf_counter() - t
            got[mode] = (out.outputs[0].token_ids, new / wall)
        decode_cpu._MIN_KEYS = default
        row = {"context": ctx, "threads": threads,
               "split_tok_s": round(got["split"][1], 2),
               "one_thread_tok_s": round(got["one thread"][1], 2),
               "speedup": round(got["split"][1] / got["one thread"][1], 2),
               "same_tokens": got["split"][0] == got["one thread"][0]}
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
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = {"env": env_info(), "kernel": kernel_rows(
        [int(c) for c in a.kernel_contexts.split(",")], a.threads, a.repeats)}
    if not a.skip_engine:
        res["engine"] = engine_rows([int(c) for c in a.contexts.split(",")], a.threads, a.new)
    write_json(a.out, res)


if __name__ == "__main__":
    main()
