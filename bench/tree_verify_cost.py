"""What a verify step costs on the GPU by its number of draft rows, batch 1: a plain decode step
and a chain verify of k drafts (CUDA graphs), tree verifies of N nodes on the tree graphs of an
engine with `spec_tree_budget` N, and the same trees eagerly (an engine without tree graphs),
on random weights at a real shape through the load path (decode_gguf.py's `random_model`). Each step is the runner's own `prepare` + `execute` on one request with
`--context` cached tokens, timed as the median of `--repeats` back-to-back steps (synchronised).
Tokens per verify from bench/spec_tree.py divided by these costs give the speedup a tree buys.

    python bench/tree_verify_cost.py [--shape qwen2.5-1.5b] [--type Q4_K_M] [--context 512]
Writes OUT/tree_verify_cost.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402
from decode_gguf import random_model  # noqa: E402
from gpu_bench import make_engine  # noqa: E402

from luceio import SamplingParams  # noqa: E402
from luceio.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402
from luceio.spec.tree import DraftTree  # noqa: E402


def binary_tree(n: int) -> DraftTree:
    """n nodes, two children per node, breadth first (depth ~log2 n)."""
    return DraftTree(list(range(100, 100 + n)), [(i - 1) // 2 if i else -1 for i in range(n)])


def step_ms(eng, req, n_new: int, spec: list[int], tree, repeats: int) -> float:
    sched = SchedulerOutput([ScheduledRequest(req, n_new, spec, tree)], [])
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        inp = eng.runner.prepare(sched, eng.kv)
        eng.runner.execute(inp)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _engine_and_request(model, a, **kw):
    eng = make_engine(model, a.context + 512, kv_gib=2, max_num_seqs=8, num_speculative_tokens=4,
                      speculative_method="ngram", **kw)
    vocab = eng.runner.cfg.vocab_size
    eng.add_request("r", torch.randint(0, vocab, (a.context,)).tolist(),
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.step()  # the prompt: its KV is cached; the request decodes from here
    req = eng.scheduler.requests["r"]
    assert eng.kv.allocate_slots(req, 64)  # room for the largest verify
    return eng, req


def _tree_ms(eng, req, tree, repeats):
    req.spec_token_ids, req.spec_tree = list(tree.tokens), tree
    ms = step_ms(eng, req, tree.num_nodes + 1, req.spec_token_ids, tree, repeats)
    req.spec_token_ids, req.spec_tree = [], None
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    a = ap.parse_args()
    model = random_model(a.shape, a.type, a.context + 1024)
    eng, req = _engine_and_request(model, a)
    rows = []
    plain = step_ms(eng, req, 1, [], None, a.repeats)
    rows.append({"step": "plain decode (graph)", "rows": 1, "ms": round(plain, 3)})
    for k in (2, 4):
        req.spec_token_ids = list(range(200, 200 + k))
        ms = step_ms(eng, req, k + 1, req.spec_token_ids, None, a.repeats)
        rows.append({"step": f"chain verify k={k} (graph)", "rows": k + 1, "ms": round(ms, 3)})
    req.spec_token_ids = []
    ms = _tree_ms(eng, req, binary_tree(8), a.repeats)
    rows.append({"step": "tree of 8 nodes (eager)", "rows": 9, "ms": round(ms, 3)})
    del eng, req
    for n in (4, 8, 12, 16, 24, 32):
        eng, req = _engine_and_request(model, a, spec_tree_budget=n)
        ms = _tree_ms(eng, req, binary_tree(n), a.repeats)
        rows.append({"step": f"tree of {n} nodes (tree graph)", "rows": n + 1, "ms": round(ms, 3)})
        del eng, req
        torch.cuda.empty_cache()
    for r in rows:
        r["vs_plain"] = round(r["ms"] / plain, 2)
        print(r, flush=True)
    write_json(os.path.join(a.out, "tree_verify_cost.json"),
               {"env": env_info(), "shape": a.shape, "type": a.type, "context": a.context,
                "rows": rows})


if __name__ == "__main__":
    main()
