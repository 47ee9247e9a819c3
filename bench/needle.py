"""Needle in a haystack on the CPU with real weights (Qwen2.5-Coder-1.5B-Instruct target,
0.5B draft): does the model still retrieve a fact planted at some depth of a long prompt when
speculative prefill drops most of the prompt, or when bounded residency keeps only part of the
KV on the device? One row per (length, depth, setting); results are appended as they come.

    python bench/needle.py [--lengths 2048,4096,8192] [--depths 0.1,0.3,0.5,0.7,0.9]
        [--keeps 0.5,0.25,0.1] [--budgets 1024,2048] [--policies keys,spec]
        [--out bench/results/cpu/needle.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info  # noqa: E402

from luceio import EngineArgs, LLMEngine, SamplingParams  # noqa: E402

FILLER = [
    "The harbour town woke early, and the fishing boats left before the light reached the hills.",
    "Most of the old library's books were moved to the new building across the river last spring.",
    "A gardener who plants tomatoes too early risks losing them to a late frost.",
    "The committee met on Thursday to discuss the budget for the coming year's road repairs.",
    "Bread rises faster in a warm kitchen, which is why bakers start before dawn in winter.",
    "The museum's new wing displays pottery recovered from a shipwreck off the southern coast.",
    "Cyclists prefer the valley road because the mountain pass is steep and often closed.",
    "In the evening the market square fills with stalls selling roasted nuts and hot cider.",
    "The train to the capital stops at four stations and takes a little under three hours.",
    "Her grandmother kept bees, and every autumn the family shared jars of dark honey.",
    "The school orchestra practised the same symphony for months before the spring concert.",
    "Rain had washed away part of the footpath, so hikers took the longer route by the lake.",
    "The lighthouse keeper wrote the weather in a logbook every morning for forty years.",
    "Engineers replaced the bridge's wooden beams with steel after the flood of that decade.",
    "A small cafe near the station serves soup and sandwiches to travellers at lunchtime.",
    "The village festival ends each year with a parade of lanterns along the canal.",
]
NEEDLE = "The secret passcode for the east vault is {code}."
QUESTION = "What is the secret passcode for the east vault? Reply with the passcode only."


def build(tok, n_tokens: int, depth: float, code: str, seed: int) -> list[int]:
    """Chat prompt of about n_tokens: filler with the needle at `depth`, then the question."""
    rng = random.Random(seed)
    sentences, size = [], 0
    while size < n_tokens - 80:
        s = rng.choice(FILLER)
        sentences.append(s)
        size += len(tok.encode(" " + s, add_special_tokens=False))
    sentences.insert(int(depth * len(sentences)), NEEDLE.format(code=code))
    text = " ".join(sentences)
    msgs = [{"role": "user", "content": f"Read this document.\n\n{text}\n\n{QUESTION}"}]
    return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True),
                      add_special_tokens=False)


def make(args_kw: dict, share: LLMEngine | None = None) -> LLMEngine:
    """An engine; with `share`, one on the same target weights and tokenizer (loaded once)."""
    args = EngineArgs(model="qwen2.5-coder-1.5b", dtype="bfloat16", device="cpu",
                      max_model_len=9216, enable_prefix_caching=False,
                      max_num_batched_tokens=2048, **args_kw)
    if share is None:
        return LLMEngine(args)
    return LLMEngine(args, model=share.runner.model, tokenizer=share.tokenizer)


def ask(eng: LLMEngine, ids: list[int], keep: float | None) -> tuple[str, float]:
    t = time.perf_counter()
    eng.add_request("q", {"prompt_token_ids": ids},
                    SamplingParams(temperature=0, max_tokens=12, spec_prefill_keep=keep))
    text = ""
    while eng.has_unfinished_requests():
        for out in eng.step():
            text = out.outputs[0].text
    return text, time.perf_counter() - t


def memoize(fn, cache: dict):
    def wrapped(ids):
        key = tuple(ids)
        if key not in cache:
            cache[key] = fn(ids)
        return cache[key]
    return wrapped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--keeps", default="0.5,0.25,0.1")
    ap.add_argument("--budgets", default="1024,2048")
    ap.add_argument("--policies", default="keys,spec")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated setting names to run "
                    "(plain, keep_0.25, resident_1024_keys, ...); default all")
    ap.add_argument("--out", default="bench/results/cpu/needle.json")
    a = ap.parse_args()
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    lengths, depths = [int(x) for x in a.lengths.split(",")], floats(a.depths)
    keeps, budgets = floats(a.keeps), [int(x) for x in a.budgets.split(",") if x]

    kv = 320 << 20  # bytes of KV per engine: one 9K-token bf16 sequence of the 1.5B
    base = make(dict(draft_model="qwen2.5-coder-0.5b", cpu_threads=a.threads,
                     kv_cache_memory=kv))
    memo: dict = {}  # one draft scoring pass per prompt, shared by every engine's draft
    base.spec_prefill.scores = memoize(base.spec_prefill.scores, memo)
    bounded = {}
    for policy in a.policies.split(","):
        for b in budgets:
            extra = dict(draft_model="qwen2.5-coder-0.5b") if policy == "spec" else {}
            eng = make(dict(kv_resident_tokens=b, kv_resident_policy=policy,
                            cpu_threads=a.threads, kv_cache_memory=kv, **extra), share=base)
            if eng.spec_prefill is not None:
                eng.spec_prefill.scores = memoize(eng.spec_prefill.scores, memo)
            bounded[f"resident_{b}_{policy}"] = (b, eng)
    tok = base.tokenizer
    res = {"env": env_info(), "target": "qwen2.5-coder-1.5b (Q4_K_M GGUF, run in bf16)",
           "draft": "qwen2.5-coder-0.5b", "rows": []}
    for n in lengths:
        for d in depths:
            code = f"{random.Random(n * 100 + int(d * 10)).randint(1000, 9999)}-{'KLMNPQRS'[int(d * 7)]}"
            ids = build(tok, n, d, code, seed=n + int(d * 100))
            runs = [("plain", base, None)] + [(f"keep_{k}", base, k) for k in keeps] + \
                [(name, eng, None) for name, (b, eng) in bounded.items() if b < len(ids)]
            if a.only:
                runs = [r for r in runs if r[0] in a.only.split(",")]
            for name, eng, keep in runs:
                text, secs = ask(eng, ids, keep)
                row = {"length": n, "tokens": len(ids), "depth": d, "setting": name, "found": code in text,
                       "answer": text.strip(), "seconds": round(secs, 1)}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                os.makedirs(os.path.dirname(a.out), exist_ok=True)
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)
    summary: dict = {}
    for r in res["rows"]:
        s = summary.setdefault(r["setting"], {})
        s.setdefault(str(r["length"]), []).append(r["found"])
    res["retrieval_rate"] = {k: {n: f"{sum(v)}/{len(v)}" for n, v in s.items()}
                             for k, s in summary.items()}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["retrieval_rate"], indent=1))


if __name__ == "__main__":
    main()
