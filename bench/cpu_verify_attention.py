"""The attention of a CPU verify step at long contexts: until session 42 a request's k + 1
verify rows reached the CPU decode path's attention as k + 1 one-token requests over the same
context, so the step read the context k + 1 times; `rows_attention_cpu` reads each key once for
all of them. This prints one step's
attention (every layer, each layer's KV cache its own, so the cache comes from memory as in
the engine) for 1 row (a decode step) and for chains of 4 and 8 drafts (5 and 9 rows), at the
Qwen2.5-Coder-0.5B shape (14 query / 2 KV heads of 64, 24 layers; `--shape 1.5b`: 12 / 2 of
128, 28 layers), an fp32 cache or with `--kv-dtype bfloat16` a bf16 one, with the
decode path's kernel (`rows_attention_cpu`: a request's rows read each key once) and, in the
same run, the one before it (`decode_cpu.decode_attention_split`, or its one-thread kernel
where the split is not taken, a row at a time), medians of `--repeats` steps.

    python bench/cpu_verify_attention.py [--contexts 512,2048,8192] [--threads 2]
        [--kv-dtype bfloat16] [--shape 1.5b] [--spans 256,1024]
Writes bench/results/cpu/cpu_verify_attention.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import cpu_median_ms, env_info, write_json  # noqa: E402

from luceio.kernels import decode_cpu, rows_attention_cpu  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "results", "cpu", "cpu_verify_attention.json")
HEADS, KV_HEADS, DIM, LAYERS, BLOCK = 14, 2, 64, 24, 16
SHAPES = {"0.5b": (14, 2, 64, 24), "1.5b": (12, 2, 128, 28)}  # heads, KV heads, dim, layers


def step_ms(ctx: int, rows: int, repeats: int, kernel: str = "rows",
            kv_dtype: str = "float32", span: int | None = None) -> tuple[float, int]:
    """(median ms of one step's attention over every layer, splits) for `rows` verify rows of
    one request whose last row sees `ctx` keys; `kernel` "rows": `rows_attention_cpu` (the
    decode path's), "per-row": each row as a one-token request (`decode_cpu`, before);
    `span`: the rows kernel's keys a work item (`KEY_SPAN` where None)."""
    from luceio.kernels.rotary import build_cos_sin_cache
    rng = np.random.default_rng(0)
    blocks = ctx // BLOCK + 1
    caches = [rng.standard_normal((2, blocks, BLOCK, KV_HEADS, DIM), dtype=np.float32)
              for _ in range(LAYERS)]
    if kv_dtype == "bfloat16":  # --kv-cache-dtype bfloat16: the caches' bf16 bits
        caches = [decode_cpu.as_numpy(torch.from_numpy(c).to(torch.bfloat16)) for c in caches]
    qkv = rng.standard_normal((rows, (HEADS + 2 * KV_HEADS) * DIM), dtype=np.float32)
    cos_sin = build_cos_sin_cache(DIM, ctx + 1, 10000.0).numpy()
    pos = np.arange(ctx - rows, ctx, dtype=np.int64)
    tables = np.repeat(np.arange(blocks, dtype=np.int32)[None], rows, 0)
    lens = (pos + 1).astype(np.int32)
    none = np.zeros(0, np.float32)
    out = np.empty((rows, HEADS * DIM), np.float32)
    splits = decode_cpu.attention_splits(lens, 0)
    if kernel == "rows":
        plan = rows_attention_cpu.RowsAttention(np.array([0, rows]), lens, np.full(rows, -1),
                                                tables, HEADS, KV_HEADS, DIM, span)

        def step():
            for kv in caches:
                plan(qkv, cos_sin, pos, kv, pos, none, none, 1e-6, out, DIM ** -0.5)
        return cpu_median_ms(step, repeats), plan.work_items

    def step():
        for kv in caches:
            args = (qkv, cos_sin, pos, kv, pos, tables, lens, HEADS, none, none, 1e-6, out,
                    DIM ** -0.5, 0)
            if splits:
                decode_cpu.decode_attention_split(*args, splits)
            else:
                decode_cpu.decode_attention(*args)
    return cpu_median_ms(step, repeats), splits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--rows", default="1,5,9")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--kv-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the caches' dtype (--kv-cache-dtype)")
    ap.add_argument("--shape", default="0.5b", choices=list(SHAPES),
                    help="Qwen2.5-Coder-0.5B's or -1.5B's attention shape")
    ap.add_argument("--spans", default="",
                    help="also the rows kernel with these keys a work item (KEY_SPAN's A/B)")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    spans = [int(s) for s in a.spans.split(",") if s]
    global HEADS, KV_HEADS, DIM, LAYERS
    HEADS, KV_HEADS, DIM, LAYERS = SHAPES[a.shape]
    import numba
    torch.set_num_threads(a.threads)
    numba.set_num_threads(a.threads)
    rows_out = []
    for ctx in [int(c) for c in a.contexts.split(",")]:
        base = None
        for rows in [int(r) for r in a.rows.split(",")]:
            # the two kernels one after the other on the same shape
            before, splits = step_ms(ctx, rows, a.repeats, "per-row", a.kv_dtype)
            ms, items = step_ms(ctx, rows, a.repeats, "rows", a.kv_dtype)
            base = base or ms
            row = {"context": ctx, "rows": rows, "threads": a.threads, "kv_dtype": a.kv_dtype,
                   "attention_ms": round(ms, 3),
                   "vs_one_row": round(ms / base, 2), "work_items": items,
                   "per_row_kernel_ms": round(before, 3), "per_row_splits": splits,
                   "speedup": round(before / ms, 2), "key_span": rows_attention_cpu.KEY_SPAN}
            for span in spans:
                row[f"span_{span}_ms"] = round(step_ms(ctx, rows, a.repeats, "rows",
                                                       a.kv_dtype, span)[0], 3)
            print(row, flush=True)
            rows_out.append(row)
    write_json(a.out, {"env": env_info(), "shape": {"heads": HEADS, "kv_heads": KV_HEADS,
                                                    "head_dim": DIM, "layers": LAYERS},
                       "rows": rows_out})


if __name__ == "__main__":
    main()
