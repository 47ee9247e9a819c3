"""Tree vs chain speculation with the n-gram proposer on real weights, CPU: target
Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, `--quantization auto`), the prompt sets of
bench/spec_acceptance.py (code generation, whole-file edits), greedy.

1. Replay (as spec_acceptance.py's): the greedy output is generated once without speculation;
   then at every decode step the proposer drafts from prompt + output so far (k = 4 levels,
   every step) and the accepted length is read off the output: for a chain, its common prefix;
   for a tree, its longest root path along the output. Tokens per verify and draft tokens per
   verify for chains and for tree budgets `--budgets`.
2. Engine: the same prompts through `LLM.generate` without speculation, with n-gram chains and
   with n-gram trees (`--engine-budget`), and (`--draft`) with Qwen2.5-Coder-0.5B drafting
   chains of `--chain-ks` tokens and best-first trees (`--engine-budget` nodes, comma-separated
   for several, `--topk` children, up to `--levels` levels): decode tok/s, acceptance, the
   histogram of accepted drafts per verify step (the profile bench/draft_cost.py replays), and
   greedy output equal to plain decoding; `--host-levels`: the draft trees again with their
   levels built on the host (`spec/tree_graph.py` off). Every drafting step is pinned to the configuration
   measured (chain or tree, k = the cap): the adaptive budget would otherwise switch by the
   CPU's step costs and mix configurations. `--adaptive` measures that switching instead (the
   engine picks tree, chain or no drafts per step from its measured costs), and `--copies N`
   runs each prompt set N times over in one batch (e.g. `--sets codegen --copies 4`: 16 at once).

    python bench/spec_tree.py [--budgets 8,12,16,24] [--engine-budget 12] [--draft] [--topk 2]
                              [--levels 4] [--chain-ks 4] [--skip-ngram] [--skip-replay]
                              [--threads 2] [--host-levels] [--one-at-a-time] [--adaptive]
                              [--copies N] [--sets codegen,edit]
Writes bench/results/cpu/spec_tree.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402
from spec_acceptance import build_prompts  # noqa: E402

from luceio import LLM, SamplingParams  # noqa: E402
from luceio.spec import NgramProposer  # noqa: E402

TARGET = "qwen2.5-coder-1.5b"
K = 4
OUT = os.path.join(os.path.dirname(__file__), "results", "cpu", "spec_tree.json")


def accepted_len(proposer: NgramProposer, history: list[int], future: list[int], k: int) -> tuple[int, int]:
    """(accepted drafts, draft tokens) of one verify step at this point of a greedy output."""
    tokens = np.asarray(history, dtype=np.int64)
    if proposer.tree_budget:
        tree = proposer.tree(tokens, k)
        kids = tree.children()
        cur, a = 0, 0
        while a < len(future):
            nxt = next((c for c in kids[cur] if tree.tokens[c - 1] == future[a]), None)
            if nxt is None:
                break
            cur, a = nxt, a + 1
        return a, tree.num_nodes
    from luceio.spec import ProposalInput
    draft = proposer.propose([ProposalInput(history, k)]).drafts[0]
    a = 0
    while a < len(draft) and a < len(future) and draft[a] == future[a]:
        a += 1
    return a, len(draft)


def replay(proposer, prompt: list[int], out: list[int]) -> dict:
    """Every decode step drafts (k = 4, fewer near the end); steps without drafts are plain."""
    o, verify, acc, drafted = 1, 0, 0, 0
    while o < len(out):
        k = min(K, len(out) - o - 1)
        a, n = accepted_len(proposer, prompt + out[:o], out[o:o + k], k) if k > 0 else (0, 0)
        if n:
            verify += 1
            acc += a
            drafted += n
        o += a + 1
    return {"verify_steps": verify, "accepted": acc, "draft_tokens": drafted}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="8,12,16,24")
    ap.add_argument("--engine-budget", default="12", help="tree budget(s), comma-separated")
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--edit-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="engine runs: each prompt alone (batch 1), not all at once")
    ap.add_argument("--draft", action="store_true", help="draft-model chains and trees too")
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--skip-ngram", action="store_true", help="engine runs: no n-gram rows")
    ap.add_argument("--skip-replay", action="store_true", help="no n-gram replay rows")
    ap.add_argument("--levels", type=int, default=K, help="tree levels (draft tokens per path)")
    ap.add_argument("--chain-ks", default=str(K), help="draft-model chain lengths")
    ap.add_argument("--host-levels", action="store_true",
                    help="draft trees also with their levels built on the host")
    ap.add_argument("--adaptive", action="store_true",
                    help="engine runs: the engine's own choice of tree / chain / no drafts per "
                         "step (SpecDecoder.mode), not pinned to the configuration")
    ap.add_argument("--copies", type=int, default=1,
                    help="engine runs: each prompt set N times over (batches N times larger)")
    ap.add_argument("--sets", default="codegen,edit", help="prompt sets to run")
    ap.add_argument("--passes", type=int, default=1,
                    help="engine runs: each set N times over in the same engine, a row a pass "
                         "(from the second on, the adaptive cost model has measured this batch)")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    common = dict(device="cpu", max_model_len=4096, cpu_threads=a.threads)
    llm = LLM(TARGET, **common)
    sets = {name: prompts * a.copies for name, prompts in build_prompts(llm.get_tokenizer(), 4, 3).items()
            if name in a.sets.split(",")}
    max_tokens = {"codegen": a.gen_tokens, "edit": a.edit_tokens}
    results = {"env": env_info(), "target": TARGET, "k": K, "levels": a.levels,
               "one_at_a_time": a.one_at_a_time, "adaptive": a.adaptive, "copies": a.copies,
               "max_tokens": max_tokens, "passes": a.passes,
               "replay": [], "engine": []}

    def generate(engine_llm, prompts, n):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
        engine_llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # warm
        t = time.perf_counter()
        if a.one_at_a_time:  # batch 1: each prompt alone, one after the other
            outs = [engine_llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                    for p in prompts]
        else:
            outs = engine_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                       use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], time.perf_counter() - t

    greedy = {}
    passes = [{}] if a.passes == 1 else [{"pass": i + 1} for i in range(a.passes)]
    for name, prompts in sets.items():
        for tag in passes:
            toks, wall = generate(llm, prompts, max_tokens[name])
            greedy.setdefault(name, toks)
            results["engine"].append({"set": name, "method": "none", **tag, "wall_s": round(wall, 2),
                                      "tok_s": round(sum(map(len, toks)) / wall, 2)})
            print(results["engine"][-1], flush=True)
    for budget in [] if a.skip_replay else [0] + [int(b) for b in a.budgets.split(",")]:
        prop = NgramProposer(tree_budget=budget)
        for name, prompts in sets.items():
            runs = [replay(prop, p, o) for p, o in zip(prompts, greedy[name])]
            tot = {k: sum(r[k] for r in runs) for k in runs[0]}
            row = {"set": name, "budget": budget or "chain", **tot,
                   "tokens_per_verify": round((tot["accepted"] + tot["verify_steps"])
                                              / max(tot["verify_steps"], 1), 3),
                   "drafts_per_verify": round(tot["draft_tokens"] / max(tot["verify_steps"], 1), 2)}
            results["replay"].append(row)
            print(row, flush=True)
        write_json(a.out, results)
    del llm
    budgets = [int(b) for b in str(a.engine_budget).split(",")]
    configs = [] if a.skip_ngram else [
        ("ngram chain", K, dict(speculative_method="ngram")),
        (f"ngram tree {budgets[0]}", K, dict(speculative_method="ngram",
                                             spec_tree_budget=budgets[0]))]
    if a.draft:
        draft = dict(speculative_method="draft", draft_model="qwen2.5-coder-0.5b")
        configs += [(f"draft chain k{k}", k, draft) for k in map(int, a.chain_ks.split(","))]
        configs += [(f"draft tree {b} top{a.topk} levels{a.levels}{host}", a.levels,
                     dict(draft, spec_tree_budget=b, spec_tree_topk=a.topk))
                    for b in budgets for host in ["", " host levels"][:1 + a.host_levels]]
    for label, k, kw in configs:
        spec_llm = LLM(TARGET, num_speculative_tokens=k, **common, **kw)
        if label.endswith(" host levels"):
            spec_llm.engine.spec.proposer.tree_graph = None
        if a.adaptive:
            label += " adaptive"
        else:
            pin(spec_llm.engine.spec, "tree" if kw.get("spec_tree_budget") else "chain")
        for name, prompts in sets.items():
            for tag in passes:
                toks, wall = generate(spec_llm, prompts, max_tokens[name])
                st = spec_llm.engine.spec.stats
                before = dict(getattr(spec_llm, "_bench_counts", {"a": 0, "d": 0, "v": 0}))
                spec_llm._bench_counts = {"a": st.num_accepted_tokens, "d": st.num_draft_tokens,
                                          "v": st.num_verify_steps}
                acc, drafted, verify = (spec_llm._bench_counts[c] - before[c] for c in "adv")
                hist_before = getattr(spec_llm, "_bench_hist", {})
                hist = {n: c - hist_before.get(n, 0) for n, c in st.accepted_histogram.items()}
                spec_llm._bench_hist = dict(st.accepted_histogram)
                row = {"set": name, "method": label, **tag, "wall_s": round(wall, 2),
                       "tok_s": round(sum(map(len, toks)) / wall, 2),
                       "greedy_exact": toks == greedy[name], "accepted": acc, "drafted": drafted,
                       "verify_steps": verify,
                       "tokens_per_verify": round((acc + verify) / verify, 3) if verify else None,
                       "accepted_histogram": {n: c for n, c in sorted(hist.items()) if c}}
                results["engine"].append(row)
                print(row, flush=True)
                write_json(a.out, results)
        del spec_llm


def pin(spec, mode: str) -> None:
    """Every eligible step drafts in `mode` at the cap (see the module docstring), cold draft
    caches caught up whatever the catch-up rule would decide."""
    spec.mode = lambda batch_size, step=None: mode
    spec._catch_up = lambda picked, batch_size, mode, cap: picked
    spec.k_for = lambda r, cap: max(0, min(cap, r.max_tokens - r.num_output_tokens - 1,
                                           r.max_model_len - r.num_tokens - 1))


if __name__ == "__main__":
    main()
