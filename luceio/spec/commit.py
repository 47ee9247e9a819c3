"""What a verify step leaves behind once its tokens are known: only accepted tokens' state
stays. A draft tree's accepted KV moves to the cache indices of its depths (`spec.tree`); a
hybrid model keeps the DeltaNet states after the accepted drafts (`models.hybrid_verify`)."""
from __future__ import annotations

import torch

from ..models.hybrid_verify import commit as commit_states


def commit_verified(runner, inp, tokens: dict[str, list[int]],
                    paths: dict[str, list[int]]) -> None:
    """`runner`: the target's `ModelRunner`; `inp`: the step's `StepInputs`; `tokens`: each
    verified request's emitted tokens; `paths`: the accepted rows of requests that verified
    trees. Queued on the device before anything reads the cache or the state again."""
    if inp.kept is not None:
        commit_states(runner.model, inp.kept, {r: len(t) - 1 for r, t in tokens.items()})
    if paths:
        commit_tree_kv(runner, inp, paths)


def commit_tree_kv(runner, inp, paths: dict[str, list[int]]) -> None:
    """Tree speculation: moves the KV of each request's accepted tree rows to the cache indices
    of their depths (row r at depth d: root index + r -> root index + d), so the request's cache
    holds its accepted tokens in order, as plain decoding would have written them."""
    h, src, dst = inp.host, [], []
    for rid, path in paths.items():
        root = int(h.logits_indices[inp.row_slices[rid].start])  # flat index of its row 0
        for depth, row in enumerate(path, 1):
            if row != depth:
                src.append(h.slot_mapping[root + row])
                dst.append(h.slot_mapping[root + depth])
    if not src:
        return
    if runner.stages is not None:  # the other stages move their layers' KV before the next step
        runner.stages.queue_moves(src, dst)
    src, dst = torch.tensor(src, device=runner.device), torch.tensor(dst, device=runner.device)
    if runner.kv_pool is not None:
        pool = runner.kv_pool
        flat = pool.view(*pool.shape[:2], -1, *pool.shape[4:])
        flat[:, :, dst] = flat[:, :, src]
        return
    move_kv(runner.kv_caches, src, dst)


def move_kv(kv_caches, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Per-layer caches [2, num_blocks, block_size, ...] (None: a layer held elsewhere): the
    entries at flat slots `src` copied to `dst`, all read before any is written."""
    for kv in kv_caches:
        if kv is not None:
            flat = kv.view(2, -1, *kv.shape[3:])
            flat[:, dst] = flat[:, src]
