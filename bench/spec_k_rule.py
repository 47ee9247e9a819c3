"""The per-request draft-length rule in the engine, batch 1, in one process: real
Qwen2.5-Coder-1.5B Q4_K_M on the CPU, spec_tree.py's prompt sets one prompt at a time (greedy,
`--tokens` each), n-gram drafts. Configurations, interleaved `--repeats` times (medians):
  plain        no speculation (a second engine)
  adaptive     the engine as it is: the cost model picks drafting steps, `spec.length` picks k
  ema rule     the same engine with session 35's k rule (bench/spec_length.py's EmaRule)
  pinned k4    every eligible step drafts 4 (`SpecDecoder.mode` -> chain, k = the cap)
Steps and draft counts move far less than wall times (only the cost model's choices follow measured
times); wall times on a 2-core machine move by 10-20% from process to process, so only rows of one
run compare.

    python bench/spec_k_rule.py [--sets edit,codegen] [--tokens 96] [--repeats 3]
Writes bench/results/cpu/spec_k_rule.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import spec_tree  # noqa: E402
from common import env_info, write_json  # noqa: E402
from spec_length import EmaRule  # noqa: E402

from luceio import LLM, SamplingParams  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "results", "cpu", "spec_k_rule.json")


def run(llm, prompts, tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
    eng = llm.engine
    steps0 = eng.counters["steps"]
    st = eng.spec.stats if eng.spec is not None else None
    d0, a0, v0 = (st.num_draft_tokens, st.num_accepted_tokens, st.num_verify_steps) if st else (0,) * 3
    t = time.perf_counter()
    outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
            for p in prompts]
    wall = time.perf_counter() - t
    row = {"wall_s": wall, "steps": eng.counters["steps"] - steps0, "tokens": sum(map(len, outs))}
    if st:
        row.update(drafts=st.num_draft_tokens - d0, accepted=st.num_accepted_tokens - a0,
                   verifies=st.num_verify_steps - v0)
    return row, [list(o) for o in outs]


def configure(spec, name: str) -> None:
    """Sets the engine's SpecDecoder to configuration `name` (instance overrides, undone first)."""
    for attr in ("mode", "k_for", "_record"):
        spec.__dict__.pop(attr, None)
    if name == "ema rule":
        rules: dict[str, EmaRule] = {}
        orig = spec._record

        def k_for(r, cap):
            room = min(r.max_tokens - r.num_output_tokens, r.max_model_len - r.num_tokens) - 1
            return max(0, min(rules.setdefault(r.request_id, EmaRule()).k(cap, 0.0), cap, room))

        def record(r, n, a, tree=False):
            rules.setdefault(r.request_id, EmaRule()).record(n, a)
            orig(r, n, a, tree)
        spec.k_for = k_for
        spec.__dict__["_record"] = record
    if name == "pinned k4":
        spec.mode = lambda batch_size, step=None: "chain"
        spec.k_for = lambda r, cap: max(0, min(cap, r.max_tokens - r.num_output_tokens - 1,
                                               r.max_model_len - r.num_tokens - 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", default="edit,codegen")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    common = dict(device="cpu", max_model_len=4096, cpu_threads=2)
    plain = LLM(spec_tree.TARGET, **common)
    spec = LLM(spec_tree.TARGET, speculative_method="ngram", num_speculative_tokens=4, **common)
    all_sets = spec_tree.build_prompts(plain.get_tokenizer(), 4, 3)
    sets = {s: all_sets[s] for s in a.sets.split(",")}
    for llm in (plain, spec):  # prefill every prompt once: the timed runs measure decoding
        llm.generate([{"prompt_token_ids": p} for v in sets.values() for p in v],
                     SamplingParams(temperature=0.0, max_tokens=1, use_speculation=False),
                     use_tqdm=False)
    configs = ["plain", "adaptive", "ema rule", "pinned k4"]
    rows, ref = [], {}
    for name, prompts in sets.items():
        samples = {c: [] for c in configs}
        for rep in range(a.repeats):
            for c in configs:
                if c != "plain":
                    configure(spec.engine.spec, c)
                row, outs = run(plain if c == "plain" else spec, prompts, a.tokens)
                ref.setdefault(name, outs)
                row["greedy_exact"] = outs == ref[name]
                samples[c].append(row)
                print(name, c, rep, {k: round(v, 2) if isinstance(v, float) else v
                                     for k, v in row.items()}, flush=True)
        base = statistics.median(r["wall_s"] for r in samples["plain"])
        for c in configs:
            med = statistics.median(r["wall_s"] for r in samples[c])
            last = samples[c][-1]
            rows.append({"set": name, "config": c, "median_wall_s": round(med, 3),
                         "walls": [round(r["wall_s"], 3) for r in samples[c]],
                         "tok_s": round(last["tokens"] / med, 2),
                         "speedup_vs_plain": round(base / med, 3),
                         "steps": [r["steps"] for r in samples[c]],
                         "mean_k": round(last["drafts"] / last["verifies"], 2)
                         if last.get("verifies") else None,
                         "greedy_exact": all(r["greedy_exact"] for r in samples[c]),
                         "runs": samples[c]})
            print({k: v for k, v in rows[-1].items() if k != "runs"}, flush=True)
    write_json(a.out, {"env": env_info(), "target": spec_tree.TARGET, "tokens": a.tokens,
                       "repeats": a.repeats, "command": "python bench/spec_k_rule.py "
                       + " ".join(sys.argv[1:]), "rows": rows})


if __name__ == "__main__":
    main()
