"""Would small-model decode GEMVs get faster with their weights staged into L2 ahead of use?

    python bench/l2_prefetch.py [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--repeats 20]

A batch-1 decode step of a 0.5B model keeps HBM busy for a fraction of its time: its one-row
GEMVs are latency-bound (a few µs each at ~1-2.5 TB/s). This measures, per projection of the
shape, the table's dense GEMV with its weight cold (copies spanning 256 MiB) and L2-warm (the
same weight every call), then a chain of every layer's four GEMVs (qkv, o, gate/up, down with
SiLU) in one CUDA graph:
  - `plain`: the chain alone (PDL where the table turns it on);
  - `events`: with an event recorded before each GEMV and waited on by a side stream that
    launches nothing (what the fork/join edges alone cost);
  - `prefetch-dD-<kind>`: before GEMV j the side stream prefetches GEMV j+D's weight into L2
    (`prefetch.global.L2` per 128-byte line, or one `cp.async.bulk.prefetch.L2` per chunk),
    so the HBM reads run beside the latency-bound chain.
Writes bench/results/h200/l2_prefetch.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info  # noqa: E402
from dense_gemv_sweep import MODELS  # noqa: E402
from qgemm import time_per_call, weight_copies  # noqa: E402

from luceio.kernels.dense_gemv import dense_gemv  # noqa: E402

LAYERS = {"qwen2.5-0.5b": 24, "qwen2.5-1.5b": 28, "llama-3.1-8b": 32}


@triton.jit
def _prefetch_lines_kernel(ptr, n_lines, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n_lines, step):
        idx = start + offs
        p = ptr + tl.where(idx < n_lines, idx, 0).to(tl.int64) * 128
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_bulk_kernel(ptr, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # CHUNK must be 16384: the asm string is a literal
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n_chunks, step):
        idx = start + offs
        p = ptr + tl.where(idx < n_chunks, idx, 0).to(tl.int64) * CHUNK
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], 16384; mov.u32 $0, 0;",
            "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w: torch.Tensor, kind: str, programs: int) -> None:
    base = w.view(torch.uint8).reshape(-1)
    nbytes = base.numel()
    if kind == "lines":
        _prefetch_lines_kernel[(programs,)](base, nbytes // 128, BLOCK=128, num_warps=4)
    else:
        chunk = 16384
        _prefetch_bulk_kernel[(programs,)](base, nbytes // chunk, CHUNK=chunk, BLOCK=32,
                                           num_warps=1)


def layer_weights(shape: str, dev):
    out = []
    for _ in range(LAYERS[shape]):
        for name, (n, k, bias, glu) in MODELS[shape].items():
            w = (torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16)
            b = (torch.randn(n, device=dev) * 0.1).to(torch.bfloat16) if bias else None
            out.append((name, w, b, glu))
    return out


def chain_time(weights, xs, repeats, mode: str, dist: int = 1, kind: str = "lines",
               programs: int = 8) -> float:
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    n = len(weights)

    def run():
        if mode != "plain":
            side.wait_stream(torch.cuda.current_stream())
        cur = torch.cuda.current_stream()
        if mode == "prefetch":
            with torch.cuda.stream(side):
                for j in range(min(dist, n)):
                    prefetch(weights[j][1], kind, programs)
        for j, (name, w, b, glu) in enumerate(weights):
            if mode != "plain":
                ev = torch.cuda.Event()
                ev.record(cur)
                side.wait_event(ev)
                if mode == "prefetch" and j + dist < n:
                    with torch.cuda.stream(side):
                        prefetch(weights[j + dist][1], kind, programs)
            dense_gemv(xs[name], w, b, glu=glu)
        if mode != "plain":
            cur.wait_stream(side)
    del main
    return time_per_call([run], repeats) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200",
                                                  "l2_prefetch.json"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for shape in a.shapes.split(","):
        xs = {name: torch.randn(1, 2 * k if glu else k, device=dev).to(torch.bfloat16)
              for name, (n, k, bias, glu) in MODELS[shape].items()}
        for name, (n, k, bias, glu) in MODELS[shape].items():
            w = (torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16)
            b = (torch.randn(n, device=dev) * 0.1).to(torch.bfloat16) if bias else None
            copies = weight_copies(w, w.numel() * 2)
            cold = time_per_call([lambda c=c: dense_gemv(xs[name], c, b, glu=glu)
                                  for c in copies], a.repeats)
            warm = time_per_call([lambda: dense_gemv(xs[name], w, b, glu=glu)], a.repeats)
            row = dict(shape=shape, matrix=name, mb=round(w.numel() * 2 / 2**20, 2),
                       cold_us=round(cold * 1e6, 2), warm_us=round(warm * 1e6, 2))
            print(json.dumps(row), flush=True)
            rows.append(row)
            del copies
        weights = layer_weights(shape, dev)
        variants = [("plain", {}), ("events", {})]
        for kind in ("lines", "bulk"):
            for dist in (1, 2, 3):
                for programs in ((8, 32) if kind == "lines" else (8,)):
                    variants.append((f"prefetch-d{dist}-{kind}-p{programs}",
                                     dict(dist=dist, kind=kind, programs=programs)))
        for label, kw in variants:
            mode = label.split("-")[0]
            try:
                t = chain_time(weights, xs, a.repeats, mode, **kw)
                row = dict(shape=shape, chain=label, us_per_gemv=round(t * 1e6, 3),
                           us_per_layer=round(t * 4e6, 2))
            except Exception as e:  # noqa: BLE001 - report and go on
                row = dict(shape=shape, chain=label, error=f"{type(e).__name__}: {e}"[:300])
            print(json.dumps(row), flush=True)
            rows.append(row)
        del weights
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"env": env_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
