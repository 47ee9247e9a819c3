"""CPU benchmark of quantized weights on real GGUF files, in one run: luceio's quantized path
(`--quantization auto`) vs the same file dequantized at load (`--quantization none`), in fp32
and bf16, vs llama.cpp's `llama-bench` on the same files and thread count. Decode tok/s at
batch 1, prefill tok/s of a 512-token prompt, and process memory after loading (each luceio
configuration runs in a fresh process, so resident memory is its own). Writes
bench/results/cpu/cpu_quant.json and prints a table.

    bash ../shared/tools/llamacpp/build.sh cpu SRC BUILD        # once (~3 min on 2 cores)
    python bench/cpu_quant.py --llama-bench BUILD/bin/llama-bench [--models ...] [--threads 2]

`--depth N` adds decode after a prompt of N tokens on both engines (llama-bench -d N: the KV
of N tokens in the cache while decoding; luceio: a prompt of N random token ids, then the
timed steps after its first token).

`--kernels` adds, per model, the time of one decode step's linear layers (every quantized
tensor of the GGUF, the LM head included, M = 1) on each CPU kernel: qdot_cpu.py (each type
in its own bits, int16-quantized activations; and int8-quantized ones where the CPU has AVX-512
VNNI) and torch's int4 packed kernel (two 4-bit planes for the 5-, 6- and 8-bit types, bf16
activations), alternating, by qtype (medians of 5).
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
    depth = cfg.get("depth", 0)
    llm = LLM(path, device="cpu", dtype=cfg["dtype"], quantization=cfg["quantization"],
              cpu_threads=cfg["threads"], max_model_len=max(2048, depth + cfg["new"] + 16),
              enable_prefix_caching=False,
              cpu_activations=cfg.get("activations", "auto"))
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
    n0, t = eng.counters["generation_tokens"], time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    decode = (eng.counters["generation_tokens"] - n0) / (time.perf_counter() - t)
    at_depth = None
    if depth:  # decode after a prompt of `depth` tokens (random ids), as llama-bench -d
        g = torch.Generator().manual_seed(1)
        base = eng.counters["generation_tokens"]
        eng.add_request("deep", {"prompt_token_ids": torch.randint(100, 20000, (depth,),
                                                                   generator=g).tolist()},
                        SamplingParams(temperature=0, max_tokens=cfg["new"] + 1, ignore_eos=True))
        while eng.counters["generation_tokens"] == base:  # prefill, to the first token
            eng.step()
        n1, t = eng.counters["generation_tokens"], time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        at_depth = round((eng.counters["generation_tokens"] - n1) / (time.perf_counter() - t), 2)
    # prefill: a 512-token prompt, one token out
    g = torch.Generator().manual_seed(0)
    long_ids = torch.randint(100, 20000, (512,), generator=g).tolist()
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": long_ids}], SamplingParams(temperature=0, max_tokens=1))
    prefill = 512 / (time.perf_counter() - t)
    return {"decode_tok_s": round(decode, 2), "prefill_tok_s": round(prefill, 1),
            **({f"decode_at_{depth}_tok_s": at_depth} if depth else {}),
            "load_s": round(load_s, 1), "rss_after_load_MiB": round(rss_loaded / 2**20),
            "rss_peak_MiB": round(psutil.Process().memory_info().rss / 2**20),
            "weight_MiB": round(eng.memory_stats().weight_bytes / 2**20, 1)}


def kernels(model: str, threads: int, reps: int = 5) -> dict:
    """Per qtype: ms per decode step of its tensors on each kernel (medians, interleaved)."""
    import collections
    import statistics

    import torch

    from cpu_qlinear import gguf_linears
    from luceio.kernels import qdot_cpu, quant_cpu

    torch.set_num_threads(threads)
    weights = list(gguf_linears(model))
    forms = {"qdot": [qdot_cpu.prepare(w, torch.float32, "int16") for w in weights],
             "int4pack": [quant_cpu.pack_int4(w, torch.bfloat16) for w in weights]}
    if qdot_cpu.int8_available():
        forms["qdot_int8"] = [qdot_cpu.prepare(w, torch.float32, "int8") for w in weights]
    xs = {k: torch.randn(1, k) for k in {w.shape[1] for w in weights}}
    run = {"qdot": lambda w: quant_cpu.qdot_linear(xs[w.shape[1]], w),
           "qdot_int8": lambda w: quant_cpu.qdot_linear(xs[w.shape[1]], w),
           "int4pack": lambda w: quant_cpu.packed_mm(xs[w.shape[1]].bfloat16(), w)}
    times = {name: collections.defaultdict(list) for name in forms}
    for r in range(reps + 1):
        for name, ws in forms.items():
            per_type = collections.Counter()
            for w in ws:
                t = time.perf_counter()
                run[name](w)
                per_type[w.qtype] += time.perf_counter() - t
            for qtype, s in per_type.items():
                if r:  # the first round warms up
                    times[name][qtype].append(s)
    out = {}
    for qtype in times["qdot"]:
        ms = {name: round(statistics.median(times[name][qtype]) * 1e3, 2) for name in forms}
        out[qtype] = {"tensors": sum(w.qtype == qtype for w in weights), "ms": ms,
                      "int4pack_over_qdot": round(ms["int4pack"] / ms["qdot"], 2)}
        if "qdot_int8" in ms:
            out[qtype]["int16_over_int8"] = round(ms["qdot"] / ms["qdot_int8"], 2)
    out["MiB"] = {name: round(sum(w.nbytes for w in ws) / 2**20, 1) for name, ws in forms.items()}
    out["load_avg"] = round(os.getloadavg()[0], 2)
    return out


def luceio(cfg: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)],
                         capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": out.stderr[-1500:]}
    return json.loads(lines[-1])


def llama_cpp(bench: str, path: str, threads: int, new: int, depth: int = 0) -> dict:
    def run(*args):
        out = subprocess.run([bench, "-m", path, *args, "-r", "3", "-t", str(threads), "-o",
                              "json"], capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-1500:])
        return {("pp" if r["n_prompt"] else "tg"): r for r in json.loads(out.stdout)}
    try:
        rows = run("-p", "512", "-n", str(new))
        deep = run("-p", "0", "-n", str(new), "-d", str(depth)) if depth else None
    except RuntimeError as e:
        return {"error": str(e)}
    return {"decode_tok_s": round(rows["tg"]["avg_ts"], 2),
            "prefill_tok_s": round(rows["pp"]["avg_ts"], 1),
            **({f"decode_at_{depth}_tok_s": round(deep["tg"]["avg_ts"], 2)} if deep else {})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--depth", type=int, default=0,
                    help="also decode after a prompt of this many tokens (llama-bench -d)")
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--kernels", action="store_true", help="per-qtype kernel times (above)")
    ap.add_argument("--configs", default="auto:float32,auto:bfloat16,none:float32,none:bfloat16",
                    help="quantization:dtype[:cpu activations (auto, int16, int8)], ...")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "cpu_quant.json"))
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(json.loads(a.one))), flush=True)
        return
    from luceio.loader.resolve import resolve_model
    results = {"env": env_info(), "cores": os.cpu_count(), "threads": a.threads,
               "new_tokens": a.new, "load_avg_1min": {"start": round(os.getloadavg()[0], 2)},
               "models": {}}
    for model in a.models.split(","):
        rows = results["models"].setdefault(model, {})
        if a.llama_bench:
            rows["llama.cpp"] = llama_cpp(a.llama_bench, resolve_model(model), a.threads, a.new,
                                          a.depth)
            print(model, "llama.cpp", rows["llama.cpp"], flush=True)
        if a.kernels:
            results.setdefault("kernels", {})[model] = k = kernels(model, a.threads)
            print(model, "kernels", k, flush=True)
        for c in filter(None, a.configs.split(",")):
            quant, dtype, acts = (c.split(":") + ["auto"])[:3]
            name = f"luceio {quant} {dtype}" + (f" {acts}" if acts != "auto" else "")
            rows[name] = r = luceio(
                {"model": model, "quantization": quant, "dtype": dtype, "threads": a.threads,
                 "new": a.new, "activations": acts, "depth": a.depth})
            print(model, c, r, flush=True)
        ref = rows.get("llama.cpp", {})
        for name, r in rows.items():
            if name != "llama.cpp" and "decode_tok_s" in r and "decode_tok_s" in ref:
                r["decode_vs_llama_cpp"] = round(r["decode_tok_s"] / ref["decode_tok_s"], 2)
                r["prefill_vs_llama_cpp"] = round(r["prefill_tok_s"] / ref["prefill_tok_s"], 2)
                key = f"decode_at_{a.depth}_tok_s"
                if key in r and key in ref:
                    r[f"decode_at_{a.depth}_vs_llama_cpp"] = round(r[key] / ref[key], 2)
        results["load_avg_1min"]["end"] = round(os.getloadavg()[0], 2)
        write_json(a.out, results)
    deep = f"decode_at_{a.depth}"
    print("\n| model | engine | decode tok/s | vs llama.cpp | prefill tok/s | vs llama.cpp | "
          + (f"decode at {a.depth} tok/s | vs llama.cpp | " if a.depth else "")
          + "RSS after load MiB |")
    print("|---|---|---|---|---|---|---|" + ("---|---|" if a.depth else ""))
    for model, rows in results["models"].items():
        for name, r in rows.items():
            print(f"| {model} | {name} | {r.get('decode_tok_s', '-')} | "
                  f"{r.get('decode_vs_llama_cpp', '')} | {r.get('prefill_tok_s', '-')} | "
                  f"{r.get('prefill_vs_llama_cpp', '')} | "
                  + (f"{r.get(deep + '_tok_s', '-')} | {r.get(deep + '_vs_llama_cpp', '')} | "
                     if a.depth else "")
                  + f"{r.get('rss_after_load_MiB', '-')} |")


if __name__ == "__main__":
    main()
