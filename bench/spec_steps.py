"""Per-step view of a speculative engine on the GPU: each decode step's wall time, whether it
drafted, its rows, and whether it replayed a CUDA graph, for the forced-acceptance setup of
gpu_bench.py (1.5B shape, oracle drafts accepted at `--rate`), bf16 or quantized weights.

    python bench/spec_steps.py [--type bf16|Q4_K_M] [--batch 4] [--rate 0.9] [--new 128]

Prints median step times of plain and drafting steps (graphed or eager) against the plain
engine's, and the cost model's view. Writes OUT/spec_steps_<type>_b<batch>.json.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, random_model, write_json  # noqa: E402
from gpu_bench import OracleProposer, make_engine  # noqa: E402

from luceio import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="bf16")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0.9)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    a = ap.parse_args()
    if a.type == "bf16":
        model = random_model("qwen2.5-coder-1.5b", max_positions=2048)
        model.lm_head.weight.mul_(30.0)
    else:
        from decode_gguf import random_model as random_quant_model
        model = random_quant_model("qwen2.5-1.5b", a.type, 2048)
        model.norm.weight.mul_(30.0)
    prompts = [torch.randint(0, 151936, (512,)).tolist() for _ in range(a.batch)]
    params = SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)

    def run(eng):
        for p in prompts:
            eng.add_request(None, p, params)
        outs, steps = {}, []
        graphs = eng.runner.graphs
        fits = graphs.fits
        seen = {}

        def spy(h):
            ok = fits(h)
            seen["graphed"], seen["rows"] = ok, int(h.q_lens.sum())
            return ok
        graphs.fits = spy
        while eng.has_unfinished_requests():
            seen.clear()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for o in eng.step():
                if o.finished:
                    outs[tuple(o.prompt_token_ids[:16])] = o.prompt_token_ids + o.outputs[0].token_ids
            torch.cuda.synchronize()
            decode = all(r.num_output_tokens > 0 for r in eng.scheduler.running)
            steps.append(dict(ms=(time.perf_counter() - t) * 1e3, decode=decode, **seen))
        graphs.fits = fits
        return outs, steps

    plain = make_engine(model, 1024, kv_gib=4, max_num_seqs=16)
    refs, plain_steps = run(plain)
    del plain
    eng = make_engine(model, 1024, kv_gib=4, max_num_seqs=16, speculative_method="ngram",
                      num_speculative_tokens=4)
    eng.spec.proposer = OracleProposer(refs, a.rate, 151936)
    outs, steps = run(eng)
    by = collections.defaultdict(list)
    for s in steps[2:]:
        by[(s.get("rows", 0) > a.batch, s.get("graphed"))].append(s["ms"])
    summary = {f"rows>{a.batch}={k[0]} graphed={k[1]}": dict(n=len(v), median_ms=statistics.median(v))
               for k, v in by.items()}
    plain_ms = statistics.median(s["ms"] for s in plain_steps[2:])
    print(f"plain engine: {len(plain_steps)} steps, median {plain_ms:.3f} ms")
    for k, v in summary.items():
        print(f"spec engine {k}: {v['n']} steps, median {v['median_ms']:.3f} ms")
    print("identical", outs == refs, "sync steps", dict(eng.counters["sync_steps"]),
          "cost model", {str(k): round(v * 1e3, 3) for k, v in eng.spec._cost.items()},
          "acceptance", round(eng.spec.acceptance_rate(), 3))
    write_json(os.path.join(a.out, f"spec_steps_{a.type}_b{a.batch}.json"),
               dict(env=env_info(), args=vars(a), plain_median_ms=plain_ms, summary=summary,
                    steps=steps, cost_ms={str(k): v * 1e3 for k, v in eng.spec._cost.items()}))


if __name__ == "__main__":
    main()
