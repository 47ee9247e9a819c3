"""What a draft-model speculative step costs on the GPU, and the speedup it projects at the
acceptance measured on real weights. Target: random Q4_K_M weights at the Qwen2.5-1.5B shape;
draft: the 0.5B shape (both through the GGUF load path, bench/decode_gguf.py), batch 1, a
512-token prompt, CUDA graphs.

Per k (draft tokens): `propose_ms`, the draft model's k chain steps for one request
(`DraftModelProposer.propose`: launched back to back, the drafts read once; median,
synchronised around each call), against `k_x_one_step_ms`, k separate one-token proposals (a
host read after each, as drafting was before); `spec_step_ms`, a whole engine step that drafts
k tokens with the draft model and verifies them (the cost model pinned to chains of k); and
`plain_step_ms`, a plain decode step (overlapped, as plain decoding runs), both as wall time
over consecutive steps. Projection: tokens per verify at the acceptance measured on the real
Qwen2.5-Coder-1.5B / 0.5B pair (bench/results/cpu/spec_acceptance.json: draft, codegen,
greedy, fixed k = 4: 4.067 tokens per verify, 78.6% of drafts accepted; other k from that
acceptance as a per-draft probability) times `plain_step_ms` over `spec_step_ms`. Random
weights make the drafts wrong here: only the times are measured.

    python bench/draft_cost.py [--out bench/results/h200] [--repeats 20]
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

from luceio import SamplingParams  # noqa: E402
from luceio.spec import _draft_proposer  # noqa: E402
from luceio.spec.proposer import ProposalInput  # noqa: E402

ACCEPTANCE = 0.786  # drafts accepted, real 1.5B/0.5B pair, codegen, greedy, k = 4
TOKENS_PER_VERIFY_K4 = 4.067


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def tokens_per_verify(k: int) -> float:
    if k == 4:
        return TOKENS_PER_VERIFY_K4
    return (1 - ACCEPTANCE ** (k + 1)) / (1 - ACCEPTANCE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    eng = make_engine(random_model("qwen2.5-1.5b", "Q4_K_M", 2560), 2048, kv_gib=4,
                      max_num_seqs=8, speculative_method="ngram", num_speculative_tokens=8)
    spec = eng.spec
    spec.proposer = _draft_proposer(eng.args, eng.runner, 2048,
                                    random_model("qwen2.5-0.5b", "Q4_K_M", 2560), eng.sampler)
    # pinned: the cost model would stop drafting at the random drafts' zero acceptance
    pin = {"mode": None, "k": 0}
    spec.mode = lambda batch_size, step=None: pin["mode"]
    spec.k_for = lambda r, cap: pin["k"]
    vocab = eng.runner.cfg.vocab_size
    eng.add_request(None, torch.randint(0, vocab, (512,)).tolist(),
                    SamplingParams(temperature=0, max_tokens=1400, ignore_eos=True))
    while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        eng.step()
    req = eng.scheduler.running[0]

    def propose(k: int):
        return spec.proposer.propose([ProposalInput(list(req.all_token_ids), k, req, tree=False)])

    def step_ms(mode: str | None, k: int, steps: int) -> float:
        """Wall time per engine step over `steps` consecutive ones (plain steps overlap)."""
        pin["mode"], pin["k"] = mode, k
        eng.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        return 1000 * (time.perf_counter() - t) / steps

    propose(8)  # the draft's prompt prefilled, its graphs warm
    step_ms("chain", 8, 2)
    plain = step_ms(None, 0, 4 * a.repeats)
    rows = []
    for k in range(1, 9):
        p = timed(lambda: propose(k), a.repeats)
        one = timed(lambda: [propose(1) for _ in range(k)], a.repeats)
        s = step_ms("chain", k, a.repeats)
        tpv = tokens_per_verify(k)
        row = {"k": k, "propose_ms": round(p, 3), "k_x_one_step_ms": round(one, 3),
               "spec_step_ms": round(s, 3), "plain_step_ms": round(plain, 3),
               "tokens_per_verify": round(tpv, 3), "projected_speedup": round(tpv * plain / s, 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    best = max(rows, key=lambda r: r["projected_speedup"])
    results = {"env": env_info(), "target": "qwen2.5-1.5b shape, random Q4_K_M",
               "draft": "qwen2.5-0.5b shape, random Q4_K_M", "batch": 1, "prompt_tokens": 512,
               "acceptance": ACCEPTANCE, "tokens_per_verify_k4": TOKENS_PER_VERIFY_K4,
               "rows": rows, "best": best}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "draft_cost.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("best:", json.dumps(best))


if __name__ == "__main__":
    main()
