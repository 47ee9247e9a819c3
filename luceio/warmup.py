"""Eager warm-up: compiles the Triton kernel variants of the eager steps before the first request.

CUDA graph capture compiles the decode and verify kernels, but prefill and mixed steps run
eagerly, and each new specialisation of a kernel is compiled on first use: 1.5-2.1 s for the
varlen attention kernel on an H100 (bench/triton_compiles.py, bench/results/h100/
triton_compiles_session33.log). The first 64-stream run of a fresh engine stalled ~1.4 s on
those compiles. The kernels' per-step integers (token counts, key splits, block-table width)
are marked `do_not_specialize` and every staged input starts 16-byte aligned (`Staging`), so
what remains are the constexpr variants a step's shape picks: key splits or none, the merge
kernel's width, and programmatic dependent launch's early signal for small grids or not.

`warm_eager` runs the model eagerly over a few step shapes that pick those variants: one to
many requests, short and long contexts, a few tokens or a chunk each. No step writes the KV
cache (every slot is -1) and the outputs are dropped; attention reads block 0, whatever it
holds. Later processes load the compiled kernels from Triton's disk cache. It runs where CUDA
graphs are captured (the Triton path); `LUCEIO_EAGER_WARMUP=0` skips it (the test suite does:
each tiny model's new shapes would compile every variant).
"""
from __future__ import annotations

import logging
import os
import time

import torch

from .models.llama import AttnMetadata

logger = logging.getLogger(__name__)


def wanted() -> bool:
    """Whether engines warm up (`LUCEIO_EAGER_WARMUP`, default on)."""
    return os.environ.get("LUCEIO_EAGER_WARMUP", "1").lower() not in ("0", "false", "no", "")


def eager_shapes(max_num_seqs: int, max_model_len: int, token_budget: int
                 ) -> list[tuple[int, int, int]]:
    """(requests, tokens each, context each) of the warm-up steps, within the engine's limits
    (`token_budget`: tokens a step may compute)."""
    long_ctx = min(2048, max_model_len)
    shapes = []
    for n in sorted({1, min(8, max_num_seqs), min(64, max_num_seqs)}):
        for q, ctx in ((16, 16), (16, long_ctx), (3, long_ctx)):
            shapes.append((n, min(q, ctx), ctx))
    # a few query tokens over a long context split the keys; the merge kernel's width is the
    # split count's power of two, and the count grows with the context
    ctx = 128
    while ctx < min(max_model_len, 16384):
        shapes.append((1, 3, ctx))
        ctx *= 2
    shapes.append((1, 3, min(max_model_len, 16384)))
    # the step's whole budget: one prompt chunk, and many requests' chunks (the widest grids)
    chunk = min(token_budget, max_model_len)
    shapes.append((1, chunk, chunk))
    n = min(64, max_num_seqs)
    q = min(token_budget // n, max_model_len)
    if q >= 1:
        shapes.append((n, q, q))
    shapes = [(n, q, ctx) for n, q, ctx in shapes if n * q <= token_budget and q <= ctx]
    return list(dict.fromkeys(shapes))


def step_inputs(n: int, q: int, ctx: int, block_size: int, device: torch.device):
    """(input ids, positions, metadata) of a step of `n` requests of `q` new tokens after
    `ctx - q` cached ones each, writing no KV and reading block 0 for every table entry."""
    rows = n * q
    i32 = dict(dtype=torch.int32, device=device)
    ids = torch.zeros(rows, dtype=torch.long, device=device)
    pos = (torch.arange(q, device=device) + (ctx - q)).repeat(n)
    meta = AttnMetadata(torch.full((rows,), -1, dtype=torch.long, device=device),
                        torch.zeros(n, -(-ctx // block_size), **i32),
                        torch.full((n,), ctx, **i32), torch.arange(n + 1, **i32) * q, q, ctx)
    return ids, pos, meta


def warm_runner(runner, max_num_seqs: int, token_budget: int) -> float | None:
    """Warms up a runner that captured CUDA graphs (not a hybrid model's: prefill writes its
    state slots), unless `LUCEIO_EAGER_WARMUP=0`; returns the seconds it took, or None."""
    if runner.graphs is None or runner.stateful or not wanted():
        return None
    took = warm_eager(runner.model, runner.kv_caches, runner.device, max_num_seqs,
                      runner.max_model_len, runner.block_size, token_budget)
    if runner.expert_offload is not None:  # routed experts were counted as if served
        runner.expert_offload.tables.reset_counts()
    return took


@torch.inference_mode()
def warm_eager(model, kv_caches, device: torch.device, max_num_seqs: int, max_model_len: int,
               block_size: int, token_budget: int) -> float:
    """Runs the eager warm-up steps (`eager_shapes`); returns the seconds it took."""
    t0 = time.perf_counter()
    for n, q, ctx in eager_shapes(max_num_seqs, max_model_len, token_budget):
        ids, pos, meta = step_inputs(n, q, ctx, block_size, device)
        hidden = model(ids, pos, kv_caches, meta)
        model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    took = time.perf_counter() - t0
    logger.info("eager warm-up (Triton compiles of prefill and mixed steps): %.1f s", took)
    return took
