"""Long-prompt prefill attention on the GPU: the varlen paged prefill kernel's time and
TFLOP/s for the configs around the arch's table entry, at long-context shapes (8K-token
chunks, fresh and on top of 24K cached tokens; Qwen2.5-Coder 1.5B and 0.5B head layouts).

    python bench/prefill_long.py
"""
from __future__ import annotations

import itertools
import json
import os
import sys
from dataclasses import replace

import torch

from luceio.kernels import configs
from luceio.kernels.attention_triton import paged_attention
from luceio.kernels.tune import _batch, _bench

SHAPES = [([8192], [0]), ([8192], [24576])]
HEADS = [(12, 2, 128), (14, 2, 64)]


def flops(q_lens, ctx, h, d) -> float:
    return sum(4 * h * d * (q * c + q * (q + 1) / 2) for q, c in zip(q_lens, ctx))


def main() -> None:
    base = configs.get_config(torch.device("cuda"))
    rows = []
    for (q_lens, ctx), (h, kv, d) in itertools.product(SHAPES, HEADS):
        args = _batch(q_lens, ctx, h, kv, d, torch.bfloat16)
        for m, n, w, s in itertools.product([64, 128], [64, 128], [4, 8], [2, 3]):
            cfg = replace(base, prefill_block_m=m, prefill_block_n=n, prefill_num_warps=w,
                          prefill_num_stages=s)
            with configs.use_config(cfg):
                try:
                    ms = _bench(lambda: paged_attention(*args))
                except Exception as e:  # noqa: BLE001 - too big a tile for this card
                    print("skip", m, n, w, s, type(e).__name__, flush=True)
                    continue
            row = dict(q=q_lens[0], ctx=ctx[0], heads=h, head_dim=d, block_m=m, block_n=n,
                       warps=w, stages=s, ms=round(ms, 3),
                       tflops=round(flops(q_lens, ctx, h, d) / ms / 1e9, 1),
                       table_entry=(m, n, w, s) == (base.prefill_block_m, base.prefill_block_n,
                                                    base.prefill_num_warps,
                                                    base.prefill_num_stages))
            rows.append(row)
        best = max((r for r in rows if r["q"] == q_lens[0] and r["ctx"] == ctx[0] and
                    r["head_dim"] == d), key=lambda r: r["tflops"])
        entry = [r for r in rows if r["q"] == q_lens[0] and r["ctx"] == ctx[0] and
                 r["head_dim"] == d and r["table_entry"]]
        print("best", best, "\n  table entry", entry, flush=True)
    out = sys.argv[1] if len(sys.argv) > 1 else "bench/results/h200/prefill_long.json"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
