"""One step's inputs as the runner builds them (`ModelRunner.prepare`) and the engine and the
speculative decoders read them."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class HostBatch:
    """One step's flat varlen batch, on the host (numpy). Device copies are made by `execute`
    on the worker thread: one packed int64 and one packed int32 transfer."""
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    logits_indices: np.ndarray  # [num_rows] int64
    # tree speculation: per token, the bits of its request's step tokens it attends to
    # (`spec.tree`; -1 for every token of a request without a tree); None: no tree this step
    tree_mask: np.ndarray | None = None
    # hybrid models: each sequence's state slot, the slots to zero first (None: no state)
    state_slots: np.ndarray | None = None
    fresh_slots: np.ndarray | None = None

    @functools.cached_property
    def q_lens(self) -> np.ndarray:  # read several times a step (query_start_loc is not rebound)
        return np.diff(self.query_start_loc)


def in_inference_mode(fn):
    """`torch.inference_mode` around `fn`, entered only where the thread is not in it already:
    entering costs several microseconds a call, and `AsyncEngine`'s engine thread runs its whole
    loop in it."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return run


@dataclass
class DeviceTokenIds:
    """Input ids that exist only on the device (overlapped scheduling): flat token `dst[i]` of
    the step takes `token_ids[src[i]]`, sampled by the step before it and not yet on the host."""
    token_ids: torch.Tensor  # [rows] int64, the previous step's sampled ids
    src: np.ndarray  # [n] int64
    dst: np.ndarray  # [n] int64


@dataclass
class StepInputs:
    host: HostBatch
    row_slices: dict[str, slice]  # request id -> its rows among the logits (sample/verify)
    prompt_row_slices: dict[str, tuple[slice, int]]  # request id -> (rows, first prompt index)
    # overlapped scheduling: request id -> flat index of its token still on the device (its
    # host input id is a placeholder 0), and where the device takes those ids from
    device_ids: dict[str, int] = field(default_factory=dict)
    ids_from: DeviceTokenIds | None = None
    # residency `keys` policy: request id -> token row whose queries score its blocks, and
    # (a copy of its block table, number of full blocks before the step's tail)
    score_rows: dict[str, int] = field(default_factory=dict)
    score_tables: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    kv_scores: dict | None = None  # filled by `execute`
    # whether the step computes tokens already known (a prompt, or a recompute) rather than
    # only the last sampled token and its drafts: on the CPU 16-bit weights then take the
    # block kernel at any M, so such a token's KV and logits do not depend on how its prefill
    # was chunked; quantized weights choose by M -- see kernels/quant_cpu.py `prefill_rows`
    prefill: bool = False
    kept: object = None  # hybrid models' verifying sequences (`models.hybrid_verify`)
