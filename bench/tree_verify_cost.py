"""What a verify step costs on the GPU by its number of draft rows, at batch 1/4/16 (every
request of the batch verifying the same shape): a plain decode step and a chain verify of k
drafts (CUDA graphs), tree verifies of N nodes on the tree graphs of an engine with
`spec_tree_budget` N, and (`--eager`) a tree on an engine without tree graphs, on random
weights at a real shape through the load path (decode_gguf.py's `random_model`). Each step is
the runner's own `prepare` + `execute` on requests with `--context` cached tokens, timed as
the median of `--repeats` back-to-back steps (synchronised).
Tokens per verify from bench/spec_tree.py divided by these costs give the speedup a tree buys.

    python bench/tree_verify_cost.py [--shape qwen2.5-1.5b] [--type Q4_K_M] [--context 512]
        [--chain-ks 2,4] [--ab gemv_row_blocks=2 --ab-rounds 2] [--profile]
Writes OUT/tree_verify_cost.json (`--json-name`). `--ab FIELD=JSON` times every step under the
arch's kernel config and under that one change to it, alternating, in one process; several
changes separated by `|` (`--ab 'a=1|a=1;b=2'`) each take their turn after the table's.
`--profile` adds, per step, what torch.profiler (CUPTI; it sees the kernels a CUDA graph runs)
records over `--repeats` more steps: kernels a step, the GPU's busy microseconds a step (the
union of kernel spans) against the profiled step's wall time, and the kernels with the most GPU
time (bench/step_profile.py's `kernel_summary`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402
from decode_gguf import random_model  # noqa: E402
from gpu_bench import make_engine  # noqa: E402
from step_profile import kernel_summary  # noqa: E402

from luceio import SamplingParams  # noqa: E402
from luceio.kernels import configs  # noqa: E402
from luceio.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402
from luceio.spec.tree import DraftTree  # noqa: E402


def binary_tree(n: int) -> DraftTree:
    """n nodes, two children per node, breadth first (depth ~log2 n)."""
    return DraftTree(list(range(100, 100 + n)), [(i - 1) // 2 if i else -1 for i in range(n)])


def step_ms(eng, reqs, n_new: int, spec: list[int], tree, repeats: int,
            profile: dict | None = None) -> float:
    """Median time of one step that gives every request in `reqs` the same verify rows;
    `profile`: a dict the step's profile (`--profile`) is written into."""
    sched = SchedulerOutput([ScheduledRequest(r, n_new, list(spec), tree) for r in reqs], [])
    for r in reqs:
        r.spec_token_ids, r.spec_tree = list(spec), tree
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        inp = eng.runner.prepare(sched, eng.kv)
        eng.runner.execute(inp)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    if profile is not None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(repeats):
                inp = eng.runner.prepare(sched, eng.kv)
                eng.runner.execute(inp)
            torch.cuda.synchronize()
            wall_us = (time.perf_counter() - t) * 1e6 / repeats
        summary = kernel_summary(prof, repeats, top=16, width=100)
        profile.update(summary, profiled_step_us=round(wall_us, 1))
    for r in reqs:
        r.spec_token_ids, r.spec_tree = [], None
    return statistics.median(times)


def _engine_and_requests(model, a, batch: int, **kw):
    # graphs are captured for verify steps of up to num_speculative_tokens drafts: a longer
    # chain would run eagerly
    k_max = max([4] + [int(v) for v in a.chain_ks.split(",") if v])
    eng = make_engine(model, a.context + 512, kv_gib=4, max_num_seqs=max(8, batch),
                      num_speculative_tokens=k_max, speculative_method="ngram", **kw)
    vocab = eng.runner.cfg.vocab_size
    for i in range(batch):
        eng.add_request(f"r{i}", torch.randint(0, vocab, (a.context,)).tolist(),
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while any(r.num_computed_tokens < a.context for r in eng.scheduler.requests.values()):
        eng.step()  # the prompts: their KV is cached; the requests decode from here
    reqs = [eng.scheduler.requests[f"r{i}"] for i in range(batch)]
    for r in reqs:
        assert eng.kv.allocate_slots(r, 64)  # room for the largest verify
    return eng, reqs


def measure(model, a, batch: int) -> list[dict]:
    """The steps' times at one batch size, with the kernel config in force."""
    eng, reqs = _engine_and_requests(model, a, batch)
    prof = {} if a.profile else None
    plain = step_ms(eng, reqs, 1, [], None, a.repeats, prof)
    found = [{"step": "plain decode (graph)", "rows": 1, "ms": round(plain, 3), "profile": prof}]
    for k in (int(v) for v in a.chain_ks.split(",") if v):
        prof = {} if a.profile else None
        ms = step_ms(eng, reqs, k + 1, list(range(200, 200 + k)), None, a.repeats, prof)
        found.append({"step": f"chain verify k={k} (graph)", "rows": k + 1, "ms": round(ms, 3),
                      "profile": prof})
    if a.eager and batch == 1:
        ms = step_ms(eng, reqs, 9, binary_tree(8).tokens, binary_tree(8), a.repeats)
        found.append({"step": "tree of 8 nodes (eager)", "rows": 9, "ms": round(ms, 3)})
    del eng, reqs
    for n in (int(v) for v in a.trees.split(",") if v):
        eng, reqs = _engine_and_requests(model, a, batch, spec_tree_budget=n)
        tree = binary_tree(n)
        prof = {} if a.profile else None
        ms = step_ms(eng, reqs, n + 1, tree.tokens, tree, a.repeats, prof)
        found.append({"step": f"tree of {n} nodes (tree graph)", "rows": n + 1,
                      "ms": round(ms, 3), "profile": prof})
        del eng, reqs
        torch.cuda.empty_cache()
    for r in found:
        r.update(batch=batch, vs_plain=round(r["ms"] / plain, 2))
        if r.get("profile") is None:
            r.pop("profile", None)
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--trees", default="4,8,16,24", help="tree sizes ('' for none)")
    ap.add_argument("--chain-ks", default="2,4", help="chain verify lengths")
    ap.add_argument("--eager", action="store_true", help="also an eager tree of 8 nodes")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--ab", default=None,
                    help="FIELD=JSON[;FIELD=JSON...] or a JSON object of fields: alternate "
                         "the arch's kernel config and this change to it "
                         "(--ab-rounds times each, one process, one model); several "
                         "changes separated by |")
    ap.add_argument("--ab-rounds", type=int, default=2)
    ap.add_argument("--profile", action="store_true",
                    help="also profile each step's kernels (torch.profiler)")
    ap.add_argument("--json-name", default="tree_verify_cost.json")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    model = random_model(a.shape, a.type, a.context + 1024)
    settings = [("table", None)]
    if a.ab:
        base = configs.get_config(torch.device("cuda"))
        alts = []
        for one in a.ab.split("|"):  # several changes: each alternates with the table
            one = one.strip()
            if one.startswith("{"):  # a JSON object of fields (skinny_sweep.py's BEST line)
                change = json.loads(one)
            else:
                change = dict(kv.split("=", 1) for kv in one.split(";"))
                change = {f: json.loads(v) for f, v in change.items()}
            alts.append((one, replace(base, **{f: type(getattr(base, f))(v)
                                               for f, v in change.items()})))
        settings = [("table", base), *alts] * a.ab_rounds
    rows = []
    for batch in batches:
        for label, cfg in settings:
            with configs.use_config(cfg) if cfg is not None else contextlib.nullcontext():
                found = measure(model, a, batch)
            for r in found:
                r["config"] = label
                print(r, flush=True)
            rows += found
    write_json(os.path.join(a.out, a.json_name),
               {"env": env_info(), "shape": a.shape, "type": a.type, "context": a.context,
                "ab": a.ab, "rows": rows})


if __name__ == "__main__":
    main()
