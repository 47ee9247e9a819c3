"""CPU benchmark on real weights: load time and greedy decode tokens/s, luceio vs HF
transformers on the same GGUF (fp32), in one run. Writes bench/results/cpu/cpu_bench.json.

    python bench/cpu_bench.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--new 64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, timed_decode, write_json  # noqa: E402

from luceio import LLM, SamplingParams  # noqa: E402
from luceio.loader.resolve import resolve_model  # noqa: E402

PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."


def bench_luceio(name: str, new: int, dtype: str = "float32") -> dict:
    """luceio at its best thread count (1 and 2 tried), like transformers below."""
    runs = [_luceio_run(name, new, dtype, threads) for threads in (1, 2)]
    return max(runs, key=lambda r: r["decode_tok_s"])


def _luceio_run(name: str, new: int, dtype: str, threads: int) -> dict:
    t = time.perf_counter()
    llm = LLM(name, dtype=dtype, device="cpu", cpu_threads=threads)
    load = time.perf_counter() - t
    tok = llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]),
                     add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    eng = llm.engine
    eng.add_request("b", {"prompt_token_ids": ids}, params)
    _, seconds = timed_decode(eng)
    decode = (new - 1) / seconds
    return {"load_s": round(load, 2), "decode_tok_s": round(decode, 2), "threads": torch.get_num_threads(),
            "ids": ids}


def bench_hf(name: str, ids: list[int], new: int, dtype=torch.float32) -> dict:
    """Transformers at its best thread count (1 and 2 tried) for this dtype."""
    from transformers import AutoModelForCausalLM
    path = resolve_model(name)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).to(dtype).eval()
    load = time.perf_counter() - t
    x = torch.tensor([ids])
    best = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        tps = _hf_decode(model, x, new)
        if tps > best.get("decode_tok_s", 0):
            best = {"load_s": round(load, 2), "decode_tok_s": round(tps, 2), "threads": threads}
    return best


def _hf_decode(model, x, new: int) -> float:
    def run(n):
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t
    run(4)
    return (new - 1) / (run(new) - run(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu", "cpu_bench.json"))
    a = ap.parse_args()
    res = {"env": env_info(), "cores": os.cpu_count(), "new_tokens": a.new, "models": {}}
    for name in a.models.split(","):
        for dtype in a.dtypes.split(","):
            lu = bench_luceio(name, a.new, dtype)
            hf = bench_hf(name, lu.pop("ids"), a.new, getattr(torch, dtype))
            row = {"luceio": lu, "transformers": hf,
                   "decode_speedup": round(lu["decode_tok_s"] / hf["decode_tok_s"], 2)}
            print(name, dtype, row, flush=True)
            res["models"][f"{name} {dtype}"] = row
    write_json(a.out, res)


if __name__ == "__main__":
    main()
