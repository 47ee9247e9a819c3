"""The one-row quantized GEMV (decode at batch 1): y = x @ W^T for x [1, K] and W in the
repacked layout of `quant.py`, on integer dot products.

Why integers: at one row a GEMV must turn every 4-6 bit code into a number and multiply it, and
done in fp32 that is ~10 instructions a weight, which caps a Triton kernel at ~15-20% of HBM
bandwidth on an H200 (measured, bench/gemv_sweep.py). Here x is first quantized per 32-group
to int8 (`_quantize_x_kernel`: scale = max |x| / 127, round half away from zero; llama.cpp's
q8_1 does the same), so four codes times four activations are one `dp4a` (an int8 4-way dot
product with an int32 accumulator): codes are unpacked four at a time with 32-bit masks
(`w & 0x0F0F0F0F` is four low nibbles), and the only float work is once per group. The result
equals the exact product of W with the dequantized int8 x (xq * scale) up to fp32 rounding;
x's quantization error is the price (relative ~1/254 of a group's largest |x|).

Layout facts used (see `quant.py`): in a 32-group, code byte j holds element j (low nibble) and
element j + 16 (high nibble), so word j's low nibbles are elements 4j..4j+3 and its high nibbles
16+4j..16+4j+3, which match word j of x's two int8 planes (elements 0-15 and 16-31). The q5
fifth bits of a group are one word (bit e = element e); q6_k's high bits of element e = 4j + i + 16h are bits 8j + 2i and
8j + 2i + 1 of the group's high word h. Both are moved next to their nibbles with one multiply
each (`_spread1`, `_spread2`). q6_k's sub-scales cover 16 elements: the low-nibble half (h = 0)
and the high half (h = 1) of a group.

`dp4a` is PTX inline assembly on NVIDIA GPUs (sm_61 and later); elsewhere (ROCm, the CPU
interpreter) `_dp4a` runs the same product with shifts and multiplies, exactly.

The grid is (cdiv(N, BLOCK_N), SPLIT_K); with SPLIT_K > 1 the programs write fp32 partials and
the last one of a row block to arrive sums them in split order (deterministic), in the same
launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_x_kernel(x_ptr, xq_ptr, xs_ptr, xsum_ptr, KG, BLOCK_G: tl.constexpr):
    """x [K] -> xq int8 [2, K/32, 16] (plane 0: elements 0-15 of each group, plane 1: 16-31),
    scale fp32 [K/32], and int32 sums of xq [2, K/32] (per plane). Planes keep the GEMV's x
    loads contiguous across a warp: a thread reads its group's 16 bytes of each plane."""
    grp = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)[:, None]          # [BG, 1]
    gmask = grp < KG
    col = tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + grp * 32 + col, mask=gmask, other=0.0).to(tl.float32)  # [BG, 32]
    amax = tl.max(tl.abs(x), 1)                                                 # [BG]
    scale = amax / 127.0
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    t = x * inv[:, None]
    q = tl.where(t >= 0, t + 0.5, t - 0.5).to(tl.int32)
    q = tl.minimum(tl.maximum(q, -127), 127)
    plane = col // 16
    tl.store(xq_ptr + plane * (KG * 16) + grp * 16 + (col % 16), q.to(tl.int8), mask=gmask)
    tl.store(xs_ptr + grp, scale[:, None], mask=gmask)
    halves = tl.reshape(q, [BLOCK_G, 2, 16])
    sums = tl.sum(halves, 2)                                                    # [BG, 2]
    tl.store(xsum_ptr + tl.arange(0, 2)[None, :] * KG + grp, sums, mask=gmask)


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """Per int32 lane: c + the sum over its 4 bytes of signed a_byte * signed b_byte."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        acc = c + ((a << 24) >> 24) * ((b << 24) >> 24)
        acc += ((a << 16) >> 24) * ((b << 16) >> 24)
        acc += ((a << 8) >> 24) * ((b << 8) >> 24)
        return acc + (a >> 24) * (b >> 24)


@triton.jit
def _spread1(t):
    """4 bits (t < 16) -> bit i moved to bit 8i + 4: a fifth bit for each code byte."""
    return (t * 0x02040810) & 0x10101010


@triton.jit
def _spread2(b):
    """4 two-bit fields of a byte (b < 256) -> field i moved to bits 8i + 4, 8i + 5."""
    even = ((b & 0x33) * 0x00010010) & 0x00300030
    odd = ((b & 0xCC) * 0x00400400) & 0x30003000
    return even | odd


@triton.jit
def _gemv_kernel(xq_ptr, xs_ptr, xsum_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr,
                 bias_ptr, out_ptr, part_ptr, cnt_ptr, N, KG, groups_per_split, s_qs, s_qh, s_d,
                 s_sc, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
                 PREFETCH: tl.constexpr, ASM: tl.constexpr, SPLIT: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    W: tl.constexpr = 8 if QTYPE == "q8_0" else 4          # code words per 32-group
    K_QUANT: tl.constexpr = QTYPE == "q4_k" or QTYPE == "q5_k" or QTYPE == "q6_k"
    FIVE: tl.constexpr = QTYPE == "q5_0" or QTYPE == "q5_1" or QTYPE == "q5_k"
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rows < N
    row3 = rows.to(tl.int64)[:, None, None]                              # [BN, 1, 1]
    row2 = rows.to(tl.int64)[:, None]                                    # [BN, 1]
    jj = tl.arange(0, 4)[None, None, :]                                  # [1, 1, 4]
    g_start = split * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, KG)

    acc = tl.zeros([BLOCK_N, G], tl.float32)
    # q8_0 keeps a group's 8 words as two 16-byte halves, like x's two planes
    code_ptr = qs_ptr + row3 * s_qs + jj
    if PREFETCH:  # the next tile's code words load while this tile computes
        grp3 = g_start + tl.arange(0, G)[None, :, None]
        pmask = nmask[:, None, None] & (grp3 < g_end)
        nxt = tl.load(code_ptr + grp3 * W, mask=pmask, other=0)
        if W == 8:
            nxt_hi = tl.load(code_ptr + grp3 * W + 4, mask=pmask, other=0)
    for g0 in range(g_start, g_end, G):
        grp3 = g0 + tl.arange(0, G)[None, :, None]                       # [1, G, 1]
        grp = g0 + tl.arange(0, G)[None, :]                              # [1, G]
        gmask3 = nmask[:, None, None] & (grp3 < g_end)
        gmask = nmask[:, None] & (grp < g_end)
        if PREFETCH:
            words = nxt
            nmask3 = nmask[:, None, None] & (grp3 + G < g_end)
            nxt = tl.load(code_ptr + (grp3 + G) * W, mask=nmask3, other=0)
            if W == 8:
                words_hi = nxt_hi
                nxt_hi = tl.load(code_ptr + (grp3 + G) * W + 4, mask=nmask3, other=0)
        else:
            words = tl.load(code_ptr + grp3 * W, mask=gmask3, other=0)
            if W == 8:
                words_hi = tl.load(code_ptr + grp3 * W + 4, mask=gmask3, other=0)
        xmask = grp3 < g_end
        gm = grp < g_end
        xs = tl.load(xs_ptr + grp, mask=gm, other=0.0)                   # [1, G]
        sum_lo = tl.load(xsum_ptr + grp, mask=gm, other=0)               # int32 [1, G]
        sum_hi = tl.load(xsum_ptr + KG + grp, mask=gm, other=0)
        x_lo = tl.broadcast_to(tl.load(xq_ptr + grp3 * 4 + jj, mask=xmask, other=0),
                               words.shape)
        x_hi = tl.broadcast_to(tl.load(xq_ptr + KG * 4 + grp3 * 4 + jj, mask=xmask, other=0),
                               words.shape)
        zero = tl.zeros_like(words)
        if QTYPE == "q8_0":
            s_lo = tl.sum(_dp4a(words_hi, x_hi, _dp4a(words, x_lo, zero, ASM), ASM), 2)
        else:
            lo = words & 0x0F0F0F0F
            hi = (words >> 4) & 0x0F0F0F0F
            if FIVE:
                hw = tl.load(qh_ptr + row3 * s_qh + grp3, mask=gmask3, other=0)
                lo |= _spread1((hw >> (4 * jj)) & 15)
                hi |= _spread1((hw >> (16 + 4 * jj)) & 15)
            if QTYPE == "q6_k":
                h0 = tl.load(qh_ptr + row3 * s_qh + 2 * grp3, mask=gmask3, other=0)
                h1 = tl.load(qh_ptr + row3 * s_qh + 2 * grp3 + 1, mask=gmask3, other=0)
                lo |= _spread2((h0 >> (8 * jj)) & 255)
                hi |= _spread2((h1 >> (8 * jj)) & 255)
                s_lo = tl.sum(_dp4a(lo, x_lo, zero, ASM), 2)             # [BN, G] int32
                s_hi = tl.sum(_dp4a(hi, x_hi, zero, ASM), 2)
            else:
                s_lo = tl.sum(_dp4a(hi, x_hi, _dp4a(lo, x_lo, zero, ASM), ASM), 2)
        if K_QUANT:
            d = tl.load(d_ptr + row2 * s_d + grp // 8, mask=gmask, other=0.0).to(tl.float32)
        else:
            d = tl.load(d_ptr + row2 * s_d + grp, mask=gmask, other=0.0).to(tl.float32)
        x_sum = sum_lo + sum_hi
        if QTYPE == "q4_0":
            acc += (d * xs) * (s_lo - 8 * x_sum).to(tl.float32)
        elif QTYPE == "q5_0":
            acc += (d * xs) * (s_lo - 16 * x_sum).to(tl.float32)
        elif QTYPE == "q8_0":
            acc += (d * xs) * s_lo.to(tl.float32)
        elif QTYPE == "q4_1" or QTYPE == "q5_1":
            mm = tl.load(m_ptr + row2 * s_d + grp, mask=gmask, other=0.0).to(tl.float32)
            acc += xs * (d * s_lo.to(tl.float32) + mm * x_sum.to(tl.float32))
        elif QTYPE == "q6_k":
            # a group's two int8 sub-scales are adjacent: one 16-bit load (little-endian)
            pair = tl.load(sc_ptr.to(tl.pointer_type(tl.int16)) + row2 * (s_sc // 2) + grp,
                           mask=gmask, other=0).to(tl.int32)
            sc_lo = ((pair << 24) >> 24).to(tl.float32)
            sc_hi = (pair >> 8).to(tl.float32)
            acc += (d * xs) * (sc_lo * (s_lo - 32 * sum_lo).to(tl.float32)
                               + sc_hi * (s_hi - 32 * sum_hi).to(tl.float32))
        else:  # q4_k, q5_k: (d * sc) * q - dmin * mn
            sc = tl.load(sc_ptr + row2 * s_sc + grp, mask=gmask, other=0).to(tl.float32)
            mn = tl.load(mn_ptr + row2 * s_sc + grp, mask=gmask, other=0).to(tl.float32)
            dmin = tl.load(m_ptr + row2 * s_d + grp // 8, mask=gmask, other=0.0).to(tl.float32)
            acc += xs * ((d * sc) * s_lo.to(tl.float32) - (dmin * mn) * x_sum.to(tl.float32))

    y = tl.sum(acc, 1)                                                   # [BN]
    if SPLIT:
        # Each split writes its partial; the last split of this row block to finish (an
        # acq_rel counter) sums all partials in split order, so the result does not depend on
        # which program finished last, and resets the counter for the next launch.
        nsplit = tl.num_programs(1)
        tl.store(part_ptr + split.to(tl.int64) * N + rows, y, mask=nmask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == nsplit - 1:
            y = tl.zeros([BLOCK_N], tl.float32)
            for s in range(0, nsplit):
                y += tl.load(part_ptr + s * N + rows, mask=nmask, other=0.0,
                             cache_modifier=".cg")
            if HAS_BIAS:
                y += tl.load(bias_ptr + rows, mask=nmask, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=nmask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=nmask)


_COUNTERS: dict = {}


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the in-kernel split-K reduction, one per row block;
    each launch leaves them zero again. One buffer per device: luceio runs its forward passes
    on one stream per device, so two GEMVs never use the counters at the same time."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [K] (K % 32 == 0) -> (xq int8 [2, K/32, 16] in two planes, scale fp32 [K/32], xq
    sums int32 [2, K/32]); see `_quantize_x_kernel`."""
    k = x.numel()
    kg = k // 32
    xq = torch.empty((2, kg, 16), dtype=torch.int8, device=x.device)
    xs = torch.empty(kg, dtype=torch.float32, device=x.device)
    xsum = torch.empty((2, kg), dtype=torch.int32, device=x.device)
    block_g = 16
    _quantize_x_kernel[(triton.cdiv(kg, block_g),)](x, xq, xs, xsum, kg, BLOCK_G=block_g,
                                                   num_warps=4)
    return xq, xs, xsum


def gemv(x2, weights: tuple, strides: tuple, qtype: str, n: int, k: int, bias, out2, cfg,
         split_k, use_asm: bool) -> None:
    """out2 [1, N] = x2 [1, K] @ W^T (+ bias), x quantized to int8 per group on the way.
    `weights` / `strides` as `quant_triton._weight_args` gives them, with qs as int32 words;
    `split_k(cfg, n_programs, k_tiles)` -> (splits, tiles per split). Two launches: x's
    quantization and the GEMV (split-K partials are summed by the GEMV's last split)."""
    if qtype == "q6_k" and weights[4].data_ptr() % 2:  # sub-scales are read in pairs
        weights = (*weights[:4], weights[4].clone(), weights[5])
    xq, xs, xsum = quantize_x(x2.reshape(-1))
    g = max(1, cfg.gemv_block_k // 32)
    kg = k // 32
    n_programs = triton.cdiv(n, cfg.gemv_block_n)
    split, tiles = split_k(cfg, n_programs, triton.cdiv(kg, g))
    part = torch.empty((split, n), dtype=torch.float32, device=x2.device) if split > 1 else out2
    counters = _split_counters(x2.device, n_programs) if split > 1 else xsum
    has_bias = bias is not None
    bias_arg = bias if has_bias else out2
    _gemv_kernel[(n_programs, split)](
        xq.view(torch.int32), xs, xsum, *weights, bias_arg, out2, part, counters, n, kg,
        tiles * g, *strides, QTYPE=qtype, BLOCK_N=cfg.gemv_block_n, G=g,
        PREFETCH=cfg.gemv_prefetch, ASM=use_asm, SPLIT=split > 1, HAS_BIAS=has_bias,
        num_warps=cfg.gemv_num_warps)


def quantize_x_ref(x: torch.Tensor) -> torch.Tensor:
    """The dequantized int8 x the GEMV multiplies (xq * scale), in fp32: its reference input."""
    g = x.float().reshape(-1, 32)
    amax = g.abs().amax(1, keepdim=True)
    t = g * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.where(t >= 0, t + 0.5, t - 0.5).trunc().clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(x.shape)
