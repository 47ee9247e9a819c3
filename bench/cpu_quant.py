"""CPU benchmark of quantized weights on real GGUF files, in one run: luceio's quantized path
(`--quantization auto`) vs the same file dequantized at load (`--quantization none`), in fp32
and bf16, vs llama.cpp's `llama-bench` on the same files and thread count. Decode tok/s at
batch 1, prefill tok/s of a 512-token prompt, and process memory after loading (each luceio
configuration runs in a fresh process, so resident memory is its own). Writes
bench/results/cpu/cpu_quant.json and prints a table.

    bash ../shared/tools/llamacpp/build.sh cpu SRC BUILD        # once (~3 min on 2 cores)
    python bench/cpu_quant.py --llama-bench BUILD/bin/llama-bench [--models ...] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402

PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."


def run_one(cfg: dict) -> dict:
    """One luceio configuration, in this (fresh) process."""
    import psutil
    import torch

    from luceio import LLM, SamplingParams
    from luceio.loader.resolve import resolve_model

    path = resolve_model(cfg["model"])
    t = time.perf_counter()
    llm = LLM(path, device="cpu", dtype=cfg["dtype"], quantization=cfg["quantization"],
              cpu_threads=cfg["threads"], max_model_len=2048, enable_prefix_caching=False)
    load_s = time.perf_counter() - t
    rss_loaded = psutil.Process().memory_info().rss
    tok = llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]),
                     add_special_tokens=False)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4))
    eng = llm.engine
    # decode: time the steps after the first token
    eng.add_request("d", {"prompt_token_ids": ids},
                    SamplingParams(temperature=0, max_tokens=cfg["new"] + 1, ignore_eos=True))
    eng.step()  # prefill + first token
    n0, t = eng.stats["generation_tokens"], time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    decode = (eng.stats["generation_tokens"] - n0) / (time.perf_counter() - t)
    # prefill: a 512-token prompt, one token out
    g = torch.Generator().manual_seed(0)
    long_ids = torch.randint(100, 20000, (512,), generator=g).tolist()
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": long_ids}], SamplingParams(temperature=0, max_tokens=1))
    prefill = 512 / (time.perf_counter() - t)
    return {"decode_tok_s": round(decode, 2), "prefill_tok_s": round(prefill, 1),
            "load_s": round(load_s, 1), "rss_after_load_MiB": round(rss_loaded / 2**20),
            "rss_peak_MiB": round(psutil.Process().memory_info().rss / 2**20),
            "weight_MiB": round(eng.memory_stats().weight_bytes / 2**20, 1)}


def luceio(cfg: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)],
                         capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": out.stderr[-1500:]}
    return json.loads(lines[-1])


def llama_cpp(bench: str, path: str, threads: int, new: int) -> dict:
    out = subprocess.run([bench, "-m", path, "-p", "512", "-n", str(new), "-r", "3", "-t",
                          str(threads), "-o", "json"], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        return {"error": out.stderr[-1500:]}
    rows = {("pp" if r["n_prompt"] else "tg"): r for r in json.loads(out.stdout)}
    return {"decode_tok_s": round(rows["tg"]["avg_ts"], 2),
            "prefill_tok_s": round(rows["pp"]["avg_ts"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--configs", default="auto:float32,auto:bfloat16,none:float32,none:bfloat16")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "cpu_quant.json"))
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(json.loads(a.one))), flush=True)
        return
    from luceio.loader.resolve import resolve_model
    results = {"env": env_info(), "cores": os.cpu_count(), "threads": a.threads,
               "new_tokens": a.new, "models": {}}
    for model in a.models.split(","):
        rows = results["models"].setdefault(model, {})
        if a.llama_bench:
            rows["llama.cpp"] = llama_cpp(a.llama_bench, resolve_model(model), a.threads, a.new)
            print(model, "llama.cpp", rows["llama.cpp"], flush=True)
        for c in a.configs.split(","):
            quant, dtype = c.split(":")
            rows[f"luceio {quant} {dtype}"] = r = luceio(
                {"model": model, "quantization": quant, "dtype": dtype, "threads": a.threads,
                 "new": a.new})
            print(model, c, r, flush=True)
        ref = rows.get("llama.cpp", {})
        for name, r in rows.items():
            if name != "llama.cpp" and "decode_tok_s" in r and "decode_tok_s" in ref:
                r["decode_vs_llama_cpp"] = round(r["decode_tok_s"] / ref["decode_tok_s"], 2)
                r["prefill_vs_llama_cpp"] = round(r["prefill_tok_s"] / ref["prefill_tok_s"], 2)
        write_json(a.out, results)
    print("\n| model | engine | decode tok/s | vs llama.cpp | prefill tok/s | vs llama.cpp | RSS after load MiB |")
    print("|---|---|---|---|---|---|---|")
    for model, rows in results["models"].items():
        for name, r in rows.items():
            print(f"| {model} | {name} | {r.get('decode_tok_s', '-')} | "
                  f"{r.get('decode_vs_llama_cpp', '')} | {r.get('prefill_tok_s', '-')} | "
                  f"{r.get('prefill_vs_llama_cpp', '')} | {r.get('rss_after_load_MiB', '-')} |")


if __name__ == "__main__":
    main()
