"""Triton attention over the paged KV cache: split-KV decode and varlen prefill (the cache
writes are `kv_write_triton.py`'s).

Same semantics as the references in `attention.py` (read its docstring for the cache layout).

* decode (max_query_len == 1): grid (num_seqs, num_kv_heads, num_splits), num_splits sized
  from `max_seq_len` (`decode_splits`). A program holds the whole GQA group of query heads of
  one KV head (padded to >= 16 rows for tl.dot), walks its split of the sequence's real length
  (cut evenly, at least `decode_min_tokens_per_split` keys, whole BLOCK_N tiles: a CUDA graph
  captured for the model's whole context still spreads a short context over its splits, and
  the splits past its end return at once) with an online softmax and writes its normalised
  partial output and log-sum-exp; `_decode_reduce_kernel`, grid (num_seqs, num_heads), merges
  the splits in use. With one split the
  first kernel writes the output directly. (Merging the splits in the decode launch, by the
  last split to finish, was slower on the H200: step_profile_session10_fused_merge.json.)
* prefill (max_query_len > 1): grid (cdiv(max_query_len * group, BLOCK_M), num_seqs,
  num_kv_heads). The BLOCK_M rows of a program are (query token, head of the group) pairs, so
  each key/value tile read through the block table serves the whole group. Keys every row may
  see run unmasked; the diagonal band (a tree's span) runs with the causal (and tree) mask.
  A launch of at most `prefill_split_max_programs` programs (a verify step's few query tokens,
  a draft tree: one or two programs per KV head) also splits the keys (`prefill_splits`): each
  program walks one run of the key tiles and writes its rows' normalised partial output and
  log-sum-exp, and `_prefill_merge_kernel`, grid (num_tokens, num_heads), merges them.
* a sliding window (`window` > 0, see `attention.py`): decode walks only the last `window` keys;
  prefill skips the keys below every row's window and masks the band at its lower edge (in a
  draft-tree step, by the tokens' `positions`: every visited key masked).

Under TRITON_INTERPRET=1 the dot operands are cast to fp32 (the interpreter's bf16 dot is
wrong); on GPUs fp16/bf16 dots run natively with fp32 accumulation, fp32 ones as IEEE.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_decode_triton import _decode_kernel, _decode_reduce_kernel
from .attention_tile_triton import _LOG2E, _attend_tile, _interpreting
from .configs import decode_splits, decode_warps, fit_shared, get_config, num_sms, \
    prefill_splits
from .pdl import pdl_enter, pdl_kwargs
from .quant_x import xq_args, xq_flags


@triton.jit(do_not_specialize=["span", "s_bt", "num_splits", "num_tokens"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, tm_ptr,
                    pos_ptr, scale_log2, window, span,
                    s_qt, s_qh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch, s_bt, s_ot, s_oh,
                    po_ptr, pl_ptr, num_splits, num_tokens,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_F32: tl.constexpr, DOT_IEEE: tl.constexpr, TREE: tl.constexpr,
                    WINDOW: tl.constexpr, SPLIT: tl.constexpr = False,
                    PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    pdl_enter(PDL, PDL_EARLY)
    pid_m = tl.program_id(0)
    split = 0
    if SPLIT:  # programs (row block, key split): split s walks the s-th run of the key tiles
        split = pid_m % num_splits
        pid_m = pid_m // num_splits
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    row0 = pid_m * BLOCK_M
    if row0 >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len                          # cached tokens before this step's queries
    tctx = seq_len - tl.maximum(q_len, span)       # the key of a tree word's bit 0

    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < q_len * GROUP
    tok = rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    qmask = rmask[:, None] & dmask[None, :]
    tok_off = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + tok_off[:, None] * s_qt + heads[:, None] * s_qh + offs_d[None, :],
                mask=qmask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    row_pos = ctx + tok                            # cache index of each row's query

    first_tok = row0 // GROUP
    last_tok = tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1)
    full_end = (ctx + first_tok + 1) // BLOCK_N * BLOCK_N   # keys below: visible to every row
    if TREE:  # the tree's tokens are masked per row: only the context is visible to all
        full_end = tl.minimum(full_end, tctx // BLOCK_N * BLOCK_N)
        words = tl.load(tm_ptr + q_start + tok, mask=rmask, other=-1)
    else:
        words = tok
    hi = ctx + last_tok + 1                                 # keys at or past: visible to none
    lo = 0                                                  # keys below: visible to none
    edge = 0                                                # keys from here to full_end: all
    q_pos = row_pos
    if WINDOW:
        if TREE:  # a row sits at ctx + its depth (>= ctx); every key from lo on is masked
            q_pos = tl.load(pos_ptr + q_start + tok, mask=rmask, other=0)
            lo = tl.maximum(ctx - window + 1, 0) // BLOCK_N * BLOCK_N
            edge = hi
        else:
            lo = tl.maximum(ctx + first_tok - window + 1, 0) // BLOCK_N * BLOCK_N
            edge = tl.cdiv(tl.maximum(ctx + last_tok - window + 1, 0), BLOCK_N) * BLOCK_N
            edge = tl.maximum(tl.minimum(edge, full_end), lo)
    kc = kc_ptr + kvh * s_kch
    vc = vc_ptr + kvh * s_vch
    bt = bt_ptr + b.to(tl.int64) * s_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pos = pos_ptr + q_start
    s_lo = lo
    s_hi = hi
    if SPLIT:  # this split's whole tiles of [lo, hi); each phase below keeps to them
        per = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
        s_lo = lo + split * per
        s_hi = tl.minimum(s_lo + per, hi)
    for n0 in range(s_lo, tl.minimum(edge, s_hi), BLOCK_N):  # the lower edge of the windows
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, kc, vc, bt, n0, hi, row_pos, scale_log2,
                                     s_kcb, s_kcs, s_vcb, s_vcs, offs_d, dmask, BLOCK_N, PAGE_SIZE,
                                     True, True, DOT_F32, DOT_IEEE, TREE, words, tctx,
                                     WINDOW, window, q_pos, pos, q_len)
    for n0 in range(tl.maximum(edge, s_lo), tl.minimum(full_end, s_hi), BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, kc, vc, bt, n0, hi, row_pos, scale_log2,
                                     s_kcb, s_kcs, s_vcb, s_vcs, offs_d, dmask, BLOCK_N, PAGE_SIZE,
                                     False, False, DOT_F32, DOT_IEEE)
    for n0 in range(tl.maximum(tl.maximum(full_end, edge), s_lo), s_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, kc, vc, bt, n0, hi, row_pos, scale_log2,
                                     s_kcb, s_kcs, s_vcb, s_vcs, offs_d, dmask, BLOCK_N, PAGE_SIZE,
                                     True, True, DOT_F32, DOT_IEEE, TREE, words, tctx,
                                     WINDOW, window, q_pos, pos, q_len)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if SPLIT:  # partial [split, token, head]: its normalised output and log2-sum-exp
        part = (split * num_tokens + tok_off) * (tl.num_programs(2) * GROUP) + heads
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(pl_ptr + part, lse, mask=rmask)
        tl.store(po_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=qmask)
    else:
        tl.store(out_ptr + tok_off[:, None] * s_ot + heads[:, None] * s_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit(do_not_specialize=["num_splits", "num_tokens"])
def _prefill_merge_kernel(po_ptr, pl_ptr, out_ptr, num_splits, num_tokens, s_ot, s_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                          PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False):
    """Merges the key splits of one (query token, head) of a split `_prefill_kernel`."""
    pdl_enter(PDL, PDL_EARLY)
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    part = (offs_s.to(tl.int64) * num_tokens + t) * tl.num_programs(1) + h
    lse = tl.load(pl_ptr + part, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(po_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    den = tl.sum(w, 0)
    den = tl.where(den == 0.0, 1.0, den)
    res = tl.sum(o * w[:, None], 0) / den
    tl.store(out_ptr + t.to(tl.int64) * s_ot + h * s_oh + offs_d,
             res.to(out_ptr.dtype.element_ty), mask=dmask)


# ---------------------------------------------------------------------------------------------
# launchers

def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, tree_mask: torch.Tensor | None = None, window: int = 0,
                    positions: torch.Tensor | None = None, xqs: dict | None = None,
                    tree_span: int = 0) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] → out: [num_tokens, num_heads, head_dim].
    `tree_mask`: int64 [num_tokens], per query token the bits of its request's query tokens it
    sees (draft-tree verification; `tree_span`: see `attention.paged_attention_ref`). `window`
    and `positions` (int64 [num_tokens], read only with a tree_mask): the sliding window. `xqs` (from the o
    projection's `int8_input`; one decode token, head_dim a multiple of 32): also filled with
    the output quantized for that GEMV, by the kernel that writes the output."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    xqs = xqs or {}
    if xqs and (max_query_len != 1 or num_tokens != 1 or head_dim % 32 or
                head_dim != triton.next_power_of_2(head_dim)):
        raise ValueError(f"attention writes a quantized GEMV input for one decode token of a "
                         f"power-of-two head_dim >= 32, got {num_tokens} tokens, "
                         f"max_query_len {max_query_len}, head_dim {head_dim}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    if window and tree_mask is not None and (tree_span or positions is None) and max_query_len > 1:
        raise ValueError("a sliding window over a draft tree needs the tokens' positions, no span")
    window = int(window or 0)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache need a contiguous last dim")
    cfg = get_config(q.device)
    interp = _interpreting()
    dot_f32 = interp and q.dtype != torch.float32
    dot_ieee = interp or q.dtype == torch.float32
    elt = 4 if (dot_f32 or q.dtype == torch.float32) else 2
    block_d = max(16, triton.next_power_of_2(head_dim))
    scale_log2 = float(scale) * _LOG2E
    strides = (q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
               block_tables.stride(0))

    if max_query_len == 1:
        block_h = max(16, triton.next_power_of_2(group))
        block_n, stages = fit_shared(block_h, cfg.decode_block_n, cfg.decode_num_stages,
                                      block_d, elt, cfg.max_shared_kb)
        seen = min(max_seq_len, window) if window else max_seq_len  # keys a query can see
        splits, _ = decode_splits(cfg, num_seqs, num_kv_heads, seen, num_sms(q.device), block_n)
        direct = splits == 1
        if direct:
            po = pl = out  # unused
        else:
            po = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32,
                             device=q.device)
            pl = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
        _decode_kernel[(num_seqs, num_kv_heads, splits)](
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, po, pl,
            scale_log2, cfg.decode_min_tokens_per_split, splits, window, *strides, out.stride(0),
            out.stride(1),
            *xq_args(xqs if direct else {}, out),
            GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_H=block_h,
            BLOCK_D=block_d, BLOCK_N=block_n, DIRECT_OUT=direct, DOT_F32=dot_f32,
            DOT_IEEE=dot_ieee, num_warps=decode_warps(cfg, head_dim), num_stages=stages,
            **xq_flags(xqs if direct else {}),
            **pdl_kwargs(q.device, cfg, num_seqs * num_kv_heads * splits))
        if not direct:
            _decode_reduce_kernel[(num_seqs, num_heads)](
                po, pl, query_start_loc, seq_lens, out, splits, cfg.decode_min_tokens_per_split,
                window, out.stride(0), out.stride(1),
                *xq_args(xqs, out),
                HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(splits)),
                BLOCK_D=block_d, BLOCK_N=block_n, num_warps=cfg.reduce_num_warps, **xq_flags(xqs),
                **pdl_kwargs(q.device, cfg, num_seqs * num_heads))
        return out

    block_m = cfg.prefill_block_m
    block_n, stages = fit_shared(block_m, cfg.prefill_block_n, cfg.prefill_num_stages,
                                  block_d, elt, cfg.max_shared_kb)
    grid = (triton.cdiv(max_query_len * group, block_m), num_seqs, num_kv_heads)
    tree = tree_mask is not None
    splits = prefill_splits(cfg, grid[0] * num_seqs * num_kv_heads, max_seq_len,
                            num_sms(q.device), block_n)
    po = pl = out  # unused without splits
    if splits > 1:
        po = torch.empty((splits, num_tokens, num_heads, head_dim), dtype=torch.float32,
                         device=q.device)
        pl = torch.empty((splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
        grid = (grid[0] * splits, num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        tree_mask if tree else seq_lens, positions if tree and window else seq_lens,
        scale_log2, window, int(tree_span), *strides, out.stride(0), out.stride(1),
        po, pl, splits, num_tokens,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_D=block_d,
        BLOCK_N=block_n, DOT_F32=dot_f32, DOT_IEEE=dot_ieee, TREE=tree, WINDOW=window > 0,
        SPLIT=splits > 1, num_warps=cfg.prefill_num_warps, num_stages=stages,
        **pdl_kwargs(q.device, cfg, grid[0] * grid[1] * grid[2]))
    if splits > 1:
        _prefill_merge_kernel[(num_tokens, num_heads)](
            po, pl, out, splits, num_tokens, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
            num_warps=cfg.reduce_num_warps, **pdl_kwargs(q.device, cfg, num_tokens * num_heads))
    return out


__all__ = ["paged_attention", "decode_splits"]
