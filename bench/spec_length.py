"""Per-request draft length (k) rules replayed on real greedy outputs, CPU, no timing: target
Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, `--quantization auto`), the prompt sets of
bench/spec_acceptance.py (code generation, whole-file edits), n-gram drafts (and `--draft`: the
0.5B draft model's greedy drafts, read off one teacher-forced pass as spec_acceptance.py does).

Each greedy output is generated once without speculation; then each rule steps through it as
the engine would at batch 1 (one verify a step, k from the rule, the accepted length read off
the output) and counts target steps and draft tokens. With a step of k drafts costing 1 + d*k
plain steps (d: a draft token's cost, drafting and verifying), the projected speedup over plain
decoding is tokens / (steps + d * drafts). Rules:
  fixed         k = 4 every step
  ema           session 35's rule: k = ceil(moving average of accepted drafts, alpha 0.5) + 1,
                idle below 0.25 (a reference copy, kept here to compare)
  length(d=..)  the engine's rule now (`luceio.spec.length.DraftLength`) told the draft cost d

The projection uses `--true-cost` as d per proposer. On this CPU a step verifying 4 n-gram drafts
took 2.4 plain steps at batch 1 (bench/spec_k_rule.py's pinned row: d ~ 0.35 with all of it
counted per draft); on a GPU a 5-token verify costs ~1.2 plain steps (d ~ 0.05).

    python bench/spec_length.py [--draft] [--gen-tokens 64] [--edit-tokens 96] [--cache F]
                                [--costs 0.07,0.35] [--true-cost ngram=0.07,draft=0.35]
Writes bench/results/cpu/spec_length.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402
from spec_acceptance import FixedK as FixedRule  # noqa: E402
from spec_acceptance import build_prompts, draft_propose_fn, ngram_propose_fn  # noqa: E402
from spec_acceptance import step_through as replay_steps  # noqa: E402

from luceio import LLM, SamplingParams  # noqa: E402
from luceio.spec.length import DraftLength  # noqa: E402

TARGET, DRAFT, K = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", 4
OUT = os.path.join(os.path.dirname(__file__), "results", "cpu", "spec_length.json")


class EmaRule:
    """Session 35's per-request rule (reference copy)."""

    def __init__(self):
        self.ema, self.idle = None, 0

    def k(self, cap: int, _cost: float) -> int:
        if self.ema is None:
            return cap
        if self.ema < 0.25:
            self.idle += 1
            return 1 if self.idle % 8 == 0 else 0
        return math.ceil(self.ema) + 1

    def record(self, _n: int, a: int) -> None:
        self.ema = a if self.ema is None else 0.5 * a + 0.5 * self.ema


def step_through(out: list[int], propose, rule, d: float) -> dict:
    """One output at batch 1 (spec_acceptance.step_through), counts under this bench's names."""
    c = replay_steps(out, len(out), propose, rule, d)
    return {"tokens": len(out) - 1, "steps": c["num_steps"], "drafts": c["num_draft_tokens"],
            "verifies": c["num_verify_steps"], "accepted": c["num_accepted_tokens"]}


def generate(a, max_tokens: dict) -> tuple[dict, dict, dict]:
    """The prompt sets, their greedy outputs, and (`--draft`) whether the draft model's argmax
    equals each output token (one teacher-forced pass)."""
    llm = LLM(TARGET, device="cpu", max_model_len=4096, cpu_threads=a.threads)
    sets = build_prompts(llm.get_tokenizer(), 4, 3)
    greedy, hits = {}, {}
    for name, prompts in sets.items():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, ignore_eos=True,
                                           max_tokens=max_tokens[name], use_speculation=False),
                            use_tqdm=False)
        greedy[name] = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    if a.draft:
        small = LLM(DRAFT, device="cpu", max_model_len=4096, cpu_threads=a.threads,
                    enable_prefix_caching=False)
        for name, prompts in sets.items():
            seqs = [{"prompt_token_ids": p + o} for p, o in zip(prompts, greedy[name])]
            outs = small.generate(seqs, SamplingParams(temperature=0, max_tokens=1,
                                                       prompt_logprobs=0), use_tqdm=False)
            hits[name] = [[ro.prompt_logprobs[len(p) + i][o[i]].rank == 1 for i in range(len(o))]
                          for p, o, ro in zip(prompts, greedy[name], outs)]
    return sets, greedy, hits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--edit-tokens", type=int, default=96)
    ap.add_argument("--draft", action="store_true", help="draft-model rows too")
    ap.add_argument("--costs", default="0.02,0.05,0.1,0.2,0.35", help="d told to the length rule")
    ap.add_argument("--true-cost", default="ngram=0.07,draft=0.35",
                    help="d used for the projected speedup, per proposer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default="", help="a JSON file keeping the prompts, greedy outputs "
                    "and draft hits between runs (written if missing)")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    max_tokens = {"codegen": a.gen_tokens, "edit": a.edit_tokens}
    if a.cache and os.path.exists(a.cache):
        with open(a.cache) as f:
            data = json.load(f)
        sets, greedy, hits = data["sets"], data["greedy"], data["hits"]
    else:
        sets, greedy, hits = generate(a, max_tokens)
        if a.cache:
            with open(a.cache, "w") as f:
                json.dump({"sets": sets, "greedy": greedy, "hits": hits}, f)
    proposers = {"ngram": {name: [ngram_propose_fn(p, o) for p, o in zip(sets[name], greedy[name])]
                           for name in sets}}
    if hits:
        proposers["draft"] = {name: [draft_propose_fn(p, o, h) for p, o, h in
                                     zip(sets[name], greedy[name], hits[name])] for name in sets}
    true = dict(kv.split("=") for kv in a.true_cost.split(","))
    rules = [("fixed", FixedRule, 0.0), ("ema", EmaRule, 0.0)] + \
        [(f"length(d={d})", lambda: DraftLength(0.5, 8), float(d)) for d in a.costs.split(",")]
    rows = []
    for method, by_set in proposers.items():
        d_true = float(true[method])
        for name, fns in by_set.items():
            for label, make, d in rules:
                c = {"tokens": 0, "steps": 0, "drafts": 0, "verifies": 0, "accepted": 0}
                for fn, out in zip(fns, greedy[name]):
                    for key, v in step_through(out, fn, make(), d).items():
                        c[key] += v
                speedup = c["tokens"] / (c["steps"] + d_true * c["drafts"])
                rows.append({"method": method, "set": name, "rule": label, **c,
                             "mean_k": round(c["drafts"] / max(c["verifies"], 1), 2),
                             "tokens_per_step": round(c["tokens"] / c["steps"], 3),
                             "true_cost": d_true, "projected_speedup": round(speedup, 3)})
                r = rows[-1]
                print(f"{method:5s} {name:7s} {label:16s} steps {r['steps']:4d} drafts "
                      f"{r['drafts']:4d} mean k {r['mean_k']:.2f} tokens/step "
                      f"{r['tokens_per_step']:.3f} projected {r['projected_speedup']:.3f}x "
                      f"(d={d_true})", flush=True)
    write_json(a.out, {"env": env_info(), "target": TARGET, "draft": DRAFT if a.draft else None,
                       "k_cap": K, "max_tokens": max_tokens, "command": "python bench/spec_length.py "
                       + " ".join(sys.argv[1:]), "rows": rows})


if __name__ == "__main__":
    main()
