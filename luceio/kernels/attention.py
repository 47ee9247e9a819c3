"""Attention over the paged KV cache: cache writes by slot mapping and varlen attention.

Cache layout, per layer: k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
A token at position p of a request lives in slot `block_table[p // block_size] * block_size +
p % block_size`.

A step is one flat varlen batch: request b owns query tokens
`query_start_loc[b] : query_start_loc[b + 1]`, which are the last `q_len` of its `seq_lens[b]`
cached tokens (decode: q_len 1; chunked prefill and speculative verification: q_len > 1).
Query j of request b sits at cache index `seq_lens[b] - q_len + j` and attends causally to
cache indices `0 ..= that index`.

Sliding-window attention (`window` > 0; Gemma's local layers): a key at position p is visible to
a query at position t only if t - p < window, transformers' convention (`sliding_window_overlay`:
kv_idx > q_idx - sliding_window). All KV stays cached; the window only masks. A token's position
is its cache index, except in a draft-tree step: there the step's tokens sit at root + depth,
so the window reads `positions` (the step's tokens' positions) for the queries and for the keys
among the step's tokens (the context before them is at its cache index).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens], -1 = skip."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """[num_seqs, max_seq_len, num_kv_heads, head_dim] view of each request's cached tokens."""
    block_size = cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    idx = block_tables[:, :num_blocks].reshape(-1).long()
    kv = cache.index_select(0, idx)  # [B * nblk, bs, Hkv, D]; index_select is far faster than []
    return kv.view(block_tables.shape[0], -1, *cache.shape[2:])[:, :max_seq_len]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                        scale: float, tree_mask: torch.Tensor | None = None, window: int = 0,
                        positions: torch.Tensor | None = None, tree_span: int = 0) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] → out: [num_tokens, num_heads, head_dim].

    One batched SDPA call: queries are scattered into [num_seqs, max_query_len] and keys
    gathered into [num_seqs, max_seq_len]; the mask keeps each query's causal prefix.
    `tree_mask` (int64 [num_tokens], or None): draft-tree verification (`spec.tree`). Bit j of
    a query token's word says whether it sees its request's j-th query token (j < 64; the
    cached context before them is always seen, and the causal rule still holds, so -1 is plain
    causal attention and a request without a tree passes -1). `tree_span` (0: the query
    tokens): the bits cover a request's last max(tree_span, its query tokens) keys instead, so
    a step that feeds only some of a tree's nodes masks the ones cached before it
    (`spec.tree_graph`); not with a window.
    `window` (0: none) and `positions` (int64 [num_tokens], read only with a tree_mask): the
    sliding window of the module docstring.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    device = q.device
    if max_query_len == 1 and num_tokens == num_seqs:  # a one-row tree is its root: causal
        return _decode_ref(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale,
                           window)
    if window and tree_mask is not None and positions is None:
        raise ValueError("a sliding window over a draft tree needs the tokens' positions")
    if window and tree_span:
        raise ValueError("a tree span does not combine with a sliding window")
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [B]
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens,
                                           output_size=num_tokens)
    idx_in_seq = torch.arange(num_tokens, device=device) - query_start_loc[seq_of_token]

    q_pad = q.new_zeros(num_seqs, max_query_len, num_heads, head_dim)
    q_pad[seq_of_token, idx_in_seq] = q
    k = gather_kv(k_cache, block_tables, max_seq_len)
    v = gather_kv(v_cache, block_tables, max_seq_len)

    # cache index of each padded query; padded rows get a harmless in-range value
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_query_len, device=device)[None, :]
    mask = torch.arange(max_seq_len, device=device)[None, None, :] <= q_pos[:, :, None]
    mask &= torch.arange(max_seq_len, device=device)[None, None, :] < seq_lens[:, None, None]
    if tree_mask is not None:
        words = torch.full((num_seqs, max_query_len), -1, dtype=torch.int64, device=device)
        words[seq_of_token, idx_in_seq] = tree_mask.to(device=device, dtype=torch.int64)
        first = seq_lens - q_lens.clamp(min=tree_span)  # the key of bit 0
        rel = torch.arange(max_seq_len, device=device)[None, :] - first[:, None]
        bit = (words[:, :, None] >> rel.clamp(0, 63)[:, None, :]) & 1
        mask &= ((rel < 0) | (rel >= 64))[:, None, :] | (bit != 0)
    if window:
        key_pos = torch.arange(max_seq_len, device=device).expand(num_seqs, -1)
        if tree_mask is not None:  # the step's tokens at their own positions (root + depth)
            key_pos = key_pos.clone()
            key_pos[seq_of_token, (seq_lens - q_lens)[seq_of_token] + idx_in_seq] = positions
            q_pos = q_pos.clone()
            q_pos[seq_of_token, idx_in_seq] = positions
        mask &= (q_pos[:, :, None] - key_pos[:, None, :]) < window
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
        attn_mask=mask[:, None], scale=scale,
        enable_gqa=num_kv_heads != num_heads)  # [B, H, Lq, D]
    return out.transpose(1, 2)[seq_of_token, idx_in_seq]


def _decode_ref(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len: int, scale: float,
                window: int = 0):
    """One query per request: two batched matmuls per KV head group, no padding of queries.
    (CPU SDPA kernels spend far longer on their setup than on a single query's work.)"""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = gather_kv(k_cache, block_tables, max_seq_len).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    v = gather_kv(v_cache, block_tables, max_seq_len).transpose(1, 2)  # [B, Hkv, L, D]
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.to(q.dtype)).float() * scale  # [B, Hkv, G, L]
    key = torch.arange(max_seq_len, device=q.device)[None, :]
    beyond = key >= seq_lens[:, None]
    if window:
        beyond |= key <= (seq_lens - 1 - window)[:, None]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    return torch.matmul(probs, v.to(q.dtype)).view(num_seqs, num_heads, head_dim)
