"""What a draft-model speculative step costs on the GPU, and the speedup it projects at the
acceptance measured on real weights. Target: random Q4_K_M weights at the Qwen2.5-1.5B shape;
draft: the 0.5B shape (both through the GGUF load path, bench/decode_gguf.py), batch 1, a
512-token prompt, CUDA graphs.

Per k (draft tokens): `propose_ms`, the draft model's k chain steps for one request
(`DraftModelProposer.propose`: the first step through the runner, the k - 1 after it in one
graph replay, `spec.chain`, the drafts read once; median, synchronised around each call),
against `k_x_one_step_ms`, k separate one-token proposals (a host read after each, as drafting
was before); `spec_step_ms`, a whole engine step that drafts k tokens with the draft model and
verifies them (the cost model pinned to chains of k); and `plain_step_ms`, a plain decode step
(overlapped, as plain decoding runs), both as wall time over consecutive steps. Per tree budget
(`--tree-budgets`, top-2 children, `--tree-levels` levels): `spec_step_ms` of an engine step
that drafts a best-first tree with the draft model and verifies it (its levels built on the
device, `spec.tree_graph`), and `host_levels_spec_step_ms`, the same step with the levels built
on the host (a read of each level's top-k), in the same run. Projection: tokens per
verify as measured on the real Qwen2.5-Coder-1.5B / 0.5B pair on the CPU, code generation,
greedy (`--acceptance`: bench/results/cpu/spec_tree_draft_sweep.json, written by `python
bench/spec_tree.py --draft ...`; chains of k it did not measure: its k = 4 acceptance as a
per-draft probability) times `plain_step_ms` over `spec_step_ms`. Random weights make the
drafts wrong here: only the times are measured. `--target qwen2.5-7b` times a 7B-shape target
(152,064 vocabulary rows against the draft's 151,936, as the real pair has) at the 1.5B pair's
acceptance, which a 7B target would not give exactly.

With `--profile`, torch.profiler (CUPTI) also records, per call, the kernels, the GPU's busy
time and the wall time of: the draft model's k = 4 chain proposal, a tree proposal at each
budget (levels on the device, and on the host), and whole engine steps (plain, chain k = 4,
tree): where a tree step's time goes (`profiles` in the JSON).

    python bench/draft_cost.py [--out bench/results/h200] [--repeats 20]
                               [--tree-budgets 8,16,22] [--tree-levels 8] [--profile]
                               [--target qwen2.5-1.5b] [--type Q4_K_M] [--ks 1,...,8]
                               [--json-name draft_cost.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info  # noqa: E402
from decode_gguf import random_model  # noqa: E402
from gpu_bench import make_engine  # noqa: E402
from step_profile import kernel_summary  # noqa: E402

from luceio import SamplingParams  # noqa: E402
from luceio.spec import _draft_proposer  # noqa: E402
from luceio.spec.proposer import ProposalInput  # noqa: E402

ACCEPTANCE_JSON = os.path.join(os.path.dirname(__file__), "results", "cpu",
                               "spec_tree_draft_sweep.json")


def measured_acceptance(path: str) -> dict:
    """{("chain", k) | ("tree", budget): tokens per verify} on code generation."""
    with open(path) as f:
        rows = json.load(f)["engine"]
    out = {}
    for r in rows:
        if r["set"] != "codegen" or not r.get("tokens_per_verify"):
            continue
        words = r["method"].split()
        if words[:2] == ["draft", "chain"]:
            out["chain", int(words[2][1:])] = r["tokens_per_verify"]
        elif words[:2] == ["draft", "tree"]:
            out["tree", int(words[2])] = r["tokens_per_verify"]
    return out


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def profiled(fn, calls: int) -> dict:
    """Kernels, GPU busy time and wall time per call of `fn` (after one warm call)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    k = kernel_summary(prof, calls, top=14, width=80)
    return {"calls": calls, "wall_us": round(wall * 1e6 / calls, 1),
            "gpu_busy_us": k["gpu_busy_us"], "kernels": k["kernels"], "copies": k["copies"],
            "top_kernels": k["top_kernels"]}


def tokens_per_verify(k: int, measured: dict) -> float:
    if ("chain", k) in measured:
        return measured["chain", k]
    a = (measured["chain", 4] - 1) / 4  # drafts accepted per draft at k = 4
    return (1 - a ** (k + 1)) / (1 - a)


def build(tree_budget: int = 0, levels: int = 8, target: str = "qwen2.5-1.5b",
          kind: str = "Q4_K_M"):
    """The target engine with the draft proposer, a request decoding after a 512-token prompt,
    and the pin that sets each step's mode and k."""
    eng = make_engine(random_model(target, kind, 2560), 2048, kv_gib=4,
                      max_num_seqs=8, speculative_method="ngram", num_speculative_tokens=levels,
                      spec_tree_budget=tree_budget)
    spec = eng.spec
    spec.proposer = _draft_proposer(eng.args, eng.runner, 2048,
                                    random_model("qwen2.5-0.5b", kind, 2560), eng.sampler)
    # pinned: the cost model would stop drafting at the random drafts' zero acceptance
    pin = {"mode": None, "k": 0}
    spec.mode = lambda batch_size, step=None: pin["mode"]
    spec.k_for = lambda r, cap: pin["k"]
    # and the catch-up: after the plain steps timed, the draft's cache is behind and the cost
    # model would not feed it at drafting's measured worth (the tree rows of the session 38 H200
    # run timed plain steps this way)
    spec._catch_up = lambda picked, batch_size, mode, cap: picked
    vocab = eng.runner.cfg.vocab_size
    eng.add_request(None, torch.randint(0, vocab, (512,)).tolist(),
                    SamplingParams(temperature=0, max_tokens=1400, ignore_eos=True))
    while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        eng.step()
    return eng, spec, pin, eng.scheduler.running[0]


def step_ms(eng, pin, mode: str | None, k: int, steps: int) -> float:
    """Wall time per engine step over `steps` consecutive ones (plain steps overlap)."""
    pin["mode"], pin["k"] = mode, k
    eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--acceptance", default=ACCEPTANCE_JSON)
    ap.add_argument("--tree-budgets", default="8,16,22")
    ap.add_argument("--tree-levels", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="profile proposals and steps")
    ap.add_argument("--target", default="qwen2.5-1.5b",
                    help="the target's shape (qwen2.5-7b: 152,064 rows, the 0.5B draft 151,936)")
    ap.add_argument("--type", default="Q4_K_M", help="both models' weights: Q4_K_M or bf16")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="chain lengths to time")
    ap.add_argument("--json-name", default="draft_cost.json")
    a = ap.parse_args()
    profiles: dict = {}
    measured = measured_acceptance(a.acceptance)
    eng, spec, pin, req = build(target=a.target, kind=a.type)

    def propose(k: int):
        return spec.proposer.propose([ProposalInput(list(req.all_token_ids), k, req, tree=False)])

    propose(8)  # the draft's prompt prefilled, its graphs warm
    step_ms(eng, pin, "chain", 8, 2)
    plain = step_ms(eng, pin, None, 0, 4 * a.repeats)
    rows = []
    for k in map(int, a.ks.split(",")):
        p = timed(lambda: propose(k), a.repeats)
        one = timed(lambda: [propose(1) for _ in range(k)], a.repeats)
        s = step_ms(eng, pin, "chain", k, a.repeats)
        tpv = tokens_per_verify(k, measured)
        row = {"k": k, "propose_ms": round(p, 3), "k_x_one_step_ms": round(one, 3),
               "spec_step_ms": round(s, 3), "plain_step_ms": round(plain, 3),
               "tokens_per_verify": round(tpv, 3), "measured_on_cpu": ("chain", k) in measured,
               "projected_speedup": round(tpv * plain / s, 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.profile:
        try:
            profiles["chain_k4_propose"] = profiled(lambda: propose(4), 10)
            for name, mode, k in (("plain_step", None, 0), ("chain_k4_step", "chain", 4)):
                pin["mode"], pin["k"] = mode, k
                profiles[name] = profiled(eng.step, 10)
        except Exception as e:  # noqa: BLE001 - the timings above still count
            profiles["error"] = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps({n: {f: v for f, v in p.items() if f != "top_kernels"}
                          if isinstance(p, dict) else p for n, p in profiles.items()}), flush=True)
    eng = spec = None  # the chain engine freed before the trees
    trees = []
    for budget in (int(b) for b in a.tree_budgets.split(",") if b):
        if ("tree", budget) not in measured:
            print(f"tree budget {budget}: no CPU acceptance measured, skipped", flush=True)
            continue
        try:
            t_eng, _, t_pin, _ = build(budget, a.tree_levels, a.target, a.type)
            step_ms(t_eng, t_pin, "tree", a.tree_levels, 2)
            t_plain = step_ms(t_eng, t_pin, None, 0, 4 * a.repeats)
            s = step_ms(t_eng, t_pin, "tree", a.tree_levels, a.repeats)
            tpv = measured["tree", budget]
            row = {"tree_budget": budget, "levels": a.tree_levels, "topk": 2,
                   "spec_step_ms": round(s, 3), "plain_step_ms": round(t_plain, 3),
                   "tokens_per_verify": tpv, "projected_speedup": round(tpv * t_plain / s, 2)}
            proposer = t_eng.spec.proposer
            if proposer.tree_graph is not None:  # the same step with the host-built levels
                graph, proposer.tree_graph = proposer.tree_graph, None
                step_ms(t_eng, t_pin, "tree", a.tree_levels, 2)
                h = step_ms(t_eng, t_pin, "tree", a.tree_levels, a.repeats)
                proposer.tree_graph = graph
                row.update(host_levels_spec_step_ms=round(h, 3),
                           host_levels_projected_speedup=round(tpv * t_plain / h, 2))
            if a.profile:
                t_req = t_eng.scheduler.running[0]

                def tree_propose():
                    return proposer.propose_trees([ProposalInput(
                        list(t_req.all_token_ids), a.tree_levels, t_req)])
                t_pin["mode"], t_pin["k"] = "tree", a.tree_levels
                got = {f"tree{budget}_propose": profiled(tree_propose, 10),
                       f"tree{budget}_step": profiled(t_eng.step, 10)}
                if proposer.tree_graph is not None:
                    graph, proposer.tree_graph = proposer.tree_graph, None
                    got[f"tree{budget}_propose_host_levels"] = profiled(tree_propose, 5)
                    proposer.tree_graph = graph
                print(json.dumps({n: {f: v for f, v in p.items() if f != "top_kernels"}
                                  for n, p in got.items()}), flush=True)
                profiles.update(got)
            chain = next((r for r in rows if r["k"] == 4), None)
            if chain is not None:  # the goal: a tree >= 1.3x the k = 4 chain
                row["vs_chain_k4"] = round(row["projected_speedup"] / chain["projected_speedup"], 2)
            del t_eng
        except Exception as e:  # noqa: BLE001 - a failed configuration is recorded, not fatal
            row = {"tree_budget": budget, "error": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps(row), flush=True)
        trees.append(row)
    best = max(rows, key=lambda r: r["projected_speedup"])
    results = {"env": env_info(), "target": f"{a.target} shape, random {a.type}",
               "draft": f"qwen2.5-0.5b shape, random {a.type}", "batch": 1, "prompt_tokens": 512,
               "acceptance_source": os.path.relpath(a.acceptance, os.path.dirname(__file__)),
               "measured_tokens_per_verify": {f"{m} {n}": v for (m, n), v in measured.items()},
               "rows": rows, "trees": trees, "best": best, "profiles": profiles}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, a.json_name), "w") as f:
        json.dump(results, f, indent=1)
    print("best:", json.dumps(best))


if __name__ == "__main__":
    main()
