"""What `--cpu-activations int8` costs in quality and buys in speed, on real GGUF models, in one
process: two engines on the same file (`--cpu-activations int16` and `int8`) decode the same
prompts greedily (the prompt's prefill takes the dense bf16 path in both), their decode rates
measured in alternating A/B rounds.

Per model: decode tok/s of each kind (medians over rounds), and for each prompt and each pair
of int16, int8 and the exact path (the file dequantized to fp32 at load) the tokens both produce
identically before they first differ, with the mean |difference| of the chosen tokens'
logprobs over that shared prefix. Writes bench/results/cpu/cpu_activations.json.

    python bench/cpu_activations.py [--models qwen2.5-coder-0.5b,smollm2-135m] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, timed_decode, write_json  # noqa: E402

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Implement binary search over a sorted list in Python, with a docstring.",
    "Write a JavaScript function that debounces another function.",
    "Explain what a mutex is, in two sentences.",
    "Write a SQL query that returns the ten customers with the most orders.",
    "Write a Rust function that reverses the words of a string.",
]


def run(llm, ids, new):
    from luceio import SamplingParams
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": p} for p in ids],
                       SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0),
                       use_tqdm=False)
    return out, time.perf_counter() - t


def decode_rate(llm, ids, new):
    """tok/s of one request's decode steps (the first token, after the prefill, excluded)."""
    from luceio import SamplingParams
    llm.engine.add_request("rate", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=new + 1, ignore_eos=True))
    steps, seconds = timed_decode(llm.engine)  # a token a step: no speculation here
    return steps / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "cpu_activations.json"))
    a = ap.parse_args()
    from luceio import LLM
    from luceio.kernels import qdot_cpu
    from luceio.loader.resolve import resolve_model
    if not qdot_cpu.int8_available():
        sys.exit("this CPU has no AVX-512 VNNI (or numba is missing): int8 activations cannot run")
    results = {"env": env_info(), "threads": a.threads, "new_tokens": a.new, "models": {}}
    for model in a.models.split(","):
        llms = {kind: LLM(resolve_model(model), device="cpu", dtype="float32",
                          cpu_threads=a.threads, max_model_len=1024, enable_prefix_caching=False,
                          cpu_activations=kind) for kind in ("int16", "int8")}
        tok = llms["int16"].get_tokenizer()
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                          add_special_tokens=False) for p in PROMPTS]
        texts = {kind: run(llm, ids, a.new)[0] for kind, llm in llms.items()}
        exact = LLM(resolve_model(model), device="cpu", dtype="float32", quantization="none",
                    cpu_threads=a.threads, max_model_len=1024, enable_prefix_caching=False)
        texts["exact"] = run(exact, ids, a.new)[0]
        del exact
        rates = {"int16": [], "int8": []}
        for r in range(a.rounds):
            for kind in (("int16", "int8") if r % 2 == 0 else ("int8", "int16")):
                rates[kind].append(decode_rate(llms[kind], ids[0], a.new))
        prompts = []
        for i, p in enumerate(PROMPTS):
            row = {"prompt": p, "of": a.new}
            for x_kind, y_kind in (("int16", "int8"), ("exact", "int16"), ("exact", "int8")):
                x, y = (texts[k][i].outputs[0] for k in (x_kind, y_kind))
                same = next((j for j, (u, v) in enumerate(zip(x.token_ids, y.token_ids))
                             if u != v), len(x.token_ids))
                diffs = [abs(lx[t].logprob - ly[t].logprob)
                         for t, lx, ly in zip(x.token_ids[:same], x.logprobs, y.logprobs)]
                row[f"{y_kind}_vs_{x_kind}"] = {
                    "identical_tokens": same,
                    "mean_abs_logprob_diff": round(statistics.mean(diffs), 5) if diffs else None}
            prompts.append(row)
        row = {kind: round(statistics.median(v), 2) for kind, v in rates.items()}
        results["models"][model] = {
            "decode_tok_s": row,
            "decode_tok_s_rounds": {k: [round(x, 2) for x in v] for k, v in rates.items()},
            "int8_over_int16": round(row["int8"] / row["int16"], 2), "prompts": prompts}
        print(model, row, flush=True)
        for pair in ("int8_vs_int16", "int16_vs_exact", "int8_vs_exact"):
            print(f"  {pair}: identical tokens", [q[pair]["identical_tokens"] for q in prompts],
                  "mean |logprob diff|", [q[pair]["mean_abs_logprob_diff"] for q in prompts])
        del llms
    write_json(a.out, results)


if __name__ == "__main__":
    main()
