"""The Gated DeltaNet's prefill on the GPU: the chunked Triton kernel
(`kernels/delta_rule_prefill_triton.py`) against the torch reference it replaced there
(`delta_rule.gated_delta_rule_chunked`, chunks of 64 per sequence), one layer's delta rule at
Qwen3.5's shape (16 key / 32 value heads of 128), random bf16 inputs, fp32 state.

    python bench/gdn_prefill.py [--tokens 512,4096] [--seqs 1,8]
                                [--out bench/results/h200/gdn_prefill.json]

Each row: `--seqs` sequences of tokens / seqs tokens in one varlen batch, the median of 20
timed calls (after 3 warm-up calls) of each, and the largest output difference between them.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import cuda_median_ms, env_info, write_json  # noqa: E402

from luceio.kernels.delta_rule import gated_delta_rule_chunked  # noqa: E402
from luceio.kernels.delta_rule_prefill_triton import gdn_prefill  # noqa: E402


def median_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    return cuda_median_ms(fn, reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200",
                                                  "gdn_prefill.json"))
    a = ap.parse_args()
    res = {"env": env_info(), "shape": "16 k heads, 32 v heads, 128 x 128", "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens in map(int, a.tokens.split(",")):
        for seqs in map(int, a.seqs.split(",")):
            n = tokens - tokens % seqs
            q, k = (torch.randn(n, 16, 128, device="cuda", generator=g).bfloat16()
                    for _ in "qk")
            v = torch.randn(n, 32, 128, device="cuda", generator=g).bfloat16()
            gate = -torch.rand(n, 32, device="cuda", generator=g) * 0.3
            beta = torch.rand(n, 32, device="cuda", generator=g).bfloat16()
            cu = torch.arange(0, n + 1, n // seqs, device="cuda", dtype=torch.int32)
            slots = torch.arange(seqs, device="cuda")
            state = torch.randn(seqs, 32, 128, 128, device="cuda", generator=g) * 0.1
            ref_state, tri_state = state.clone(), state.clone()
            ref = gated_delta_rule_chunked(q, k, v, gate, beta, ref_state, cu, slots)
            tri = gdn_prefill(q, k, v, gate, beta, tri_state, cu, slots)
            row = {"tokens": n, "seqs": seqs,
                   "torch_ms": round(median_ms(lambda: gated_delta_rule_chunked(
                       q, k, v, gate, beta, state.clone(), cu, slots)), 3),
                   "triton_ms": round(median_ms(lambda: gdn_prefill(
                       q, k, v, gate, beta, state.clone(), cu, slots)), 3),
                   "max_out_diff": (ref.float() - tri.float()).abs().max().item(),
                   "max_state_diff": (ref_state - tri_state).abs().max().item()}
            row["speedup"] = round(row["torch_ms"] / row["triton_ms"], 2)
            print(row, flush=True)
            res["rows"].append(row)
            write_json(a.out, res)


if __name__ == "__main__":
    main()
