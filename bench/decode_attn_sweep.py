"""Launch configs of the split decode attention (`kernels/attention_triton.py`) on the GPU, per
attention shape: one decode token a request over a paged KV cache, the launch sized for a
longer context than it holds (as a CUDA graph captured for `max_model_len` is), timed as 64
calls captured in one CUDA graph (no host launch cost), each call on its own cache so the keys
come from HBM, replayed 5 times.

    python bench/decode_attn_sweep.py [--out bench/results/h200/decode_attn_sweep.json]
                                      [--contexts 512,8192] [--batch 1]

Fields swept: `decode_num_warps` x `decode_block_n` (the table's `decode_num_stages`), each
against the table's row; per shape the fastest and the table's time are reported. Shapes:
Qwen2.5-0.5B (14 / 2 heads of 64), Qwen2.5-1.5B (12 / 2 of 128), Llama-3.1-8B (32 / 8 of 128),
Qwen3.5's full-attention layers (16 / 2 and 16 / 4 of 256), Gemma 3 12B (16 / 8 of 256).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402
from moe_decode_sweep import time_call  # noqa: E402

from luceio.kernels import configs, triton_ops  # noqa: E402

SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "qwen2.5-1.5b": (12, 2, 128), "llama-3.1-8b": (32, 8, 128),
          "qwen3.5-35b-a3b": (16, 2, 256), "qwen3.5-9b": (16, 4, 256), "gemma-3-12b": (16, 8, 256)}
FIELDS = [dict(decode_num_warps=w, decode_block_n=n) for w in (1, 2, 4, 8) for n in (16, 32, 64)]


def setup(heads, kv_heads, head_dim, ctx, batch, copies=8, page=16):
    """`copies` independent caches (calls cycle over them: more bytes than L2 holds)."""
    dev = torch.device("cuda")
    pages = -(-ctx // page)
    out = []
    for _ in range(copies):
        kc = torch.randn(batch * pages, page, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
        q = torch.randn(batch, heads, head_dim, device=dev, dtype=torch.bfloat16)
        out.append((q, kc, vc, bt))
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    return out, lens, qsl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200",
                                                  "decode_attn_sweep.json"))
    ap.add_argument("--contexts", default="512,8192")
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    dev = torch.device("cuda")
    base = configs.get_config(dev)
    res = {"env": env_info(), "batch": a.batch, "table": {f: getattr(base, f) for f in FIELDS[0]},
           "shapes": []}
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        for ctx in map(int, a.contexts.split(",")):
            caches, lens, qsl = setup(heads, kv_heads, head_dim, ctx, a.batch)
            bound = 2 * ctx  # the launch sized for twice the context, as a graph's would be

            def call(i, caches=caches, lens=lens, qsl=qsl, bound=bound, head_dim=head_dim):
                q, kc, vc, bt = caches[i % len(caches)]
                triton_ops.paged_attention(q, kc, vc, bt, lens, qsl, 1, bound, head_dim ** -0.5)
            row = {"shape": name, "context": ctx, "heads": heads, "kv_heads": kv_heads,
                   "head_dim": head_dim, "table_us": round(time_call(call), 2), "configs": []}
            for f in FIELDS:
                with configs.use_config(replace(base, **f)):
                    row["configs"].append({**f, "us": round(time_call(call), 2)})
            best = min(row["configs"], key=lambda r: r["us"])
            row["best"] = best
            print(name, ctx, "table", row["table_us"], "best", best, flush=True)
            res["shapes"].append(row)
            write_json(a.out, res)
            del caches
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
