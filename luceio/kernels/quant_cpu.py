"""Quantized matmuls on the CPU: each GGUF type in its own bits (qdot_cpu.py), or, without
numba, through torch's int4 packed kernel.

`prepare_cpu_weight(w)` turns a `QuantWeight` into its CPU form once at load;
`cpu_quant_linear(x, w, bias)` multiplies. Types in `QDOT_QTYPES` become `qdot_cpu.CpuQuant`:
the repacked arrays themselves (the GGUF's bytes), multiplied by numba kernels that unpack 32
codes at a time against int16-quantized activations (~2e-5 relative error per dot product,
qdot_cpu.py); from `QDOT_DENSE_MIN_ROWS` rows on (prompt chunks, large batches) a tile of rows
is dequantized to bf16 and multiplied by oneDNN's bf16 GEMM (fp32 on CPUs without bf16
instructions, `dense_dtype`). The int4pack path (`CpuPacked`, bf16 activations
and scales) is what runs without numba; through it the 5-, 6- and 8-bit types cost two 4-bit
planes each (below): twice the bytes and the time.

The mapping. The kernel dequantizes a code q (0..15) as (q - 8) * scale + zero, one (scale, zero)
per 32 codes along K. 4-bit types are one plane of codes; 5-, 6- and 8-bit ones two planes, the
low nibble and the high bits, laid side by side chunk by chunk along K' = 2 K, the activations
repeated the same way and multiplied by the plane's factor (a power of two: exact in bf16):

  qtype  planes  codes (plane 0; plane 1)        scale     zero (plane 0; plane 1)   factors
  q4_0   1       q                               d         0                         1
  q4_1   1       q                               d         m + 8 d                   1
  q4_k   1       q                               d sc      8 d sc - dmin mn          1
  q5_0   2       q & 15; (q >> 4) + 8            d         -8 d; 0                   1, 16
  q5_1   2       q & 15; (q >> 4) + 8            d         m + 8 d; 0                1, 16
  q5_k   2       q & 15; (q >> 4) + 8            d sc      8 d sc - dmin mn; 0       1, 16
  q8_0   2       q & 15; (q >> 4) + 8 (q signed) d         8 d; 0                    1, 16
  q6_k   2       q & 15; 2 (q >> 4) + 5          d sc      0                         1, 8

(q6_k's scales cover 16 elements: its chunk is 16, so one 32-code group holds both planes of
a chunk.) In exact arithmetic the planes sum to `quant.dequantize` exactly; the only losses are
the bf16 roundings of scale and zero, of x and of the output (each at most 2^-9 relative).
Measured over every tensor of the two GGUFs below (bench/cpu_qlinear.py `quality`), relative
RMS error against the exact fp32 dequantization: this mapping 1.6e-3 (q5_0, q6_k, q8_0) to
2.1e-3 (q4_k), as dense bf16 does (1.3e-3 to 1.7e-3); requantizing per row to int8, what
`_weight_int8pack_mm` can hold, 0.85e-2 to 1.7e-2; requantizing to int4 per 32 (one plane for
all), 4.1e-3 (q4_1, already int4 per 32), 4.3e-2 (q4_k), 8.0e-2 to 8.5e-2 (q5_0, q6_k, q8_0).
End to end (tests/test_quant_quality.py, Qwen2.5-Coder-0.5B in an fp32 engine, prefill on the
dense path): 99.33% teacher-forced top-1 agreement with the dequantized model over 2,099 tokens.
Storage: 5 bits per weight and plane, against GGUF's 4.5 to 8.5: Qwen2.5-Coder-0.5B Q4_K_M (most
of it q5_0, its LM head q8_0) packs its linear layers into 558 MiB (GGUF 374 MiB, bf16 942 MiB).

Why this kernel. bench/cpu_qlinear.py on a Xeon with AVX-512 BF16/AMX, 2 vCPUs shared with other
jobs, torch 2.13, weights out of cache, ratios within one interleaved run, 1 thread unless said:
- M = 1, every linear shape of Qwen2.5-Coder-0.5B and SmolLM2-135M: int4pack (group 32, bf16 x)
  is 3.1-4.1x faster per call than F.linear fp32, 2.6-4.4x than bf16, 3.8-4.4x than fp16,
  1.6-2.4x than `_weight_int8pack_mm` (bf16 x), and 0.9-1.7x as fast as fbgemm's dynamic int8
  linear (which also quantizes the activations, per tensor). Groups of 64 or 128: within 10% of
  32. With fp16 or fp32 x, int4pack runs ATen's scalar code (30-50x slower), int8pack too (5-12x).
- M = 4: int4pack costs 1.7-1.9x its M = 1 time (it dequantizes once per 4-row block), still
  1.4-2.5x faster than F.linear bf16 and 3.1-4.6x than fp32.
- M = 128: oneDNN bf16 is 5-8.5x faster than int4pack, hence the dense path. Its per-call
  dequantization (numba, one core, 0.7-0.9 ns per weight) costs more than the GEMM: at [4864,
  1024] the dense path is 2.5-3.6x slower than F.linear on a resident bf16 weight, 1.25-1.8x
  faster than fp32, 2.7-4.6x faster than int4pack; it overtakes int4pack near M = 36 (one plane)
  and M = 20 (two planes): `DENSE_MIN_ROWS`. A resident bf16 copy for prefill would cost 2 bytes
  per weight (Qwen: 942 MiB more, past the 1 GiB process budget by itself).
- Two planes cost twice one: at [4864, 1024], M = 1, one plane is 2.6-3.3x faster than F.linear
  bf16 (2.6-3.0x than fp32), two planes 1.3-1.65x (1.45-1.65x); at M = 4, 1.7-1.8x and 0.86-0.91x
  (3.1-3.6x and 1.75-2.0x).
- A decode step's linear layers (every quantized tensor of the real GGUF in its own type, LM
  head included; M = 1): Qwen2.5-Coder-0.5B Q4_K_M 81 ms, against 139 ms dense bf16 and 135 ms
  fp32 (1.7x); 2 threads 49 ms against 95 / 81 ms (1.9x / 1.6x). Requantizing every weight to
  one int4 plane instead would take 42 ms (24 ms on 2 threads) at the errors above (8% on q5_0
  and q8_0). SmolLM2-135M Q4_1 (its tied LM head q8_0): 18 ms against 62 / 49 ms (3.4x / 2.6x);
  2 threads 9.9 ms against 29 / 24 ms. At M = 4 Qwen's linears take as long as dense bf16's
  (137 against 134 ms; fp32 273 ms). Two-thread runs are at the mercy of the other jobs here (a
  busy sibling core stalls OpenMP's barriers): rerun before trusting one.

Rules: int4pack rows are padded to a multiple of 16 (the packer's requirement) and sliced off
the output; K must be a multiple of 32 (256 for k-quants, as GGUF has it). The int4pack dense
path reads torch's internal int4pack layout (int4pack_cpu.py); without numba, or on a layout it
does not know, every M runs on int4pack (correct, slower prefill). Both dense paths dequantize
into one reused 16 MiB buffer, and qdot_cpu.py reuses its activation buffers: one caller at a
time (the model runner).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import int4pack_cpu, qdot_cpu
from .int4pack_cpu import GROUP
from .qdot_cpu import CpuQuant
from .quant import QuantWeight, unpacked_codes

QDOT_QTYPES = frozenset(qdot_cpu.KINDS)
"""The qtypes multiplied by qdot_cpu.py (when numba is there); int4pack takes the rest. All of
them: torch's int4 kernel is faster per call on the 4-bit types alone (Qwen2.5-0.5B's q4_k
1.7x, SmolLM2's q4_1 1.4x), but its OpenMP threads and numba's are two pools that spin against
each other on two cores: with Qwen's q4_k on int4pack a decode step took 41.9 ms, with every
type here 31.2 ms (one run, per-call profile of the decode step)."""
QDOT_DENSE_MIN_ROWS = {"int8": 64, "int16": 32}
"""By a `CpuQuant` weight's activations: the smallest M that it multiplies as dequantized bf16
tiles (oneDNN); fewer rows (decode and verify steps of a few requests, a prompt's short tail
after a prefix-cache hit or its last chunk) take `qdot_cpu.matvec`. A decode step's matrices
(LM head aside), 2 threads, Zen 5, ms per step,
matvec / dense (`python bench/cpu_dense_rows.py`,
`bench/results/cpu/cpu_dense_rows_session31.json`), Qwen2.5-Coder-1.5B / 0.5B Q4_K_M /
SmolLM2 Q4_1: int8 at 8 rows 78 / 318, 30 / 94, 11 / 36; at 32 rows 297 / 428, 108 / 121,
36 / 45; at 48 rows 443 / 558, 166 / 137, 53 / 50. int16 at 20 rows 321 / 384, 100 / 111,
32 / 41; at 24 rows 390 / 405, 125 / 112, 38 / 41. (Before session 31's multi-row kernels the
crossover was 8 rows: at [4864, 896] q5_0 matvec took 0.21 / 0.60 / 1.23 / 2.59 ms at M = 1 /
4 / 8 / 16, the dense path 1.03-1.10 ms.) Session 32's int8 kernels take 3 or more rows in one call
(`qdot8_kernels_cpu.py`): on its box (an AMD EPYC as before, its dense path slower) at 32 / 48 / 64
rows 266 / 430 / 558 against 502 / 1031 / 933, 112 / 139 / 183 against 175 / 209 / 218, 36 / 55 / 69
against 70 / 85 / 92 (`cpu_dense_rows_session32.json`), so int8 moved from 32 to 64; int16
at 32 / 48 rows 603 / 887 against 788 / 1005, 168 / 240 against 173 / 189, 56 / 85 against 68 /
84 (`cpu_dense_rows_int16_session32.json`), so int16 moved from 20 to 32."""


def dense_min_rows(w: CpuQuant) -> int:
    """`QDOT_DENSE_MIN_ROWS` of this weight's activations."""
    return QDOT_DENSE_MIN_ROWS[w.activations]


ROW_ALIGN = 16
"""`_convert_weight_to_int4pack_for_cpu` takes N a multiple of 16: rows are padded with zeros."""
PACK_ROWS = 8192
"""Rows packed per call at load (a multiple of 64, the kernel's row block): bounds the int32
codes the packer takes to PACK_ROWS * K' * 4 bytes."""
DENSE_MIN_ROWS = {1: 40, 2: 20}
"""Planes -> the smallest M that takes the dense path (dequantize to bf16, then oneDNN)."""
DENSE_TILE_BYTES = 16 << 20
"""The dense path dequantizes at most this many bytes of weight at a time."""
DENSE_DTYPE: torch.dtype | None = None
"""The dtype of `CpuQuant` weights' dense path; None: `dense_dtype`'s choice for this CPU."""
_NATIVE_BF16 = ("avx512bf16", "amx-bf16", "bf16")  # LLVM's names: x86 AVX-512 BF16, AMX; Arm


def dense_dtype() -> torch.dtype:
    """The dtype the dense path of `CpuQuant` weights multiplies in: bf16 where the CPU has bf16
    instructions (AVX-512 BF16, AMX, Arm's BF16), else fp32. Without them oneDNN's bf16 GEMM
    is emulated: on a 2-core AVX2-only EPYC, [512, 1536] x [1536, 8960] took 1,260 ms in bf16
    against 224 ms in fp32 (11.2 against 62.8 GFLOP/s, 2 threads, session 51), and a 512-token
    prompt of Qwen2.5-Coder-1.5B Q4_K_M prefilled at 0.19x llama.cpp's rate."""
    if DENSE_DTYPE is not None:
        return DENSE_DTYPE
    try:
        from .qdot_ir_cpu import _CPU
    except ImportError:  # no numba / llvmlite: no dense path to choose for
        return torch.bfloat16
    return torch.bfloat16 if any(f in _CPU for f in _NATIVE_BF16) else torch.float32


@dataclass
class CpuPacked:
    """One [N, K] weight in the packed kernel's layout: `planes` 4-bit planes along K.

    Row n of the weight is, for every chunk of `chunk` elements along K, the sum over planes p of
    `factors[p] * ((code - 8) * scale + zero)`; the kernel gets that as one matmul with K' =
    planes * K, the activations expanded to [M, K'] (chunk by chunk, plane p's copy times
    factors[p]) and one (scale, zero) per 32 codes of K'."""
    qtype: str
    shape: tuple[int, int]  # (N, K)
    packed: torch.Tensor  # uint8 [N padded to 16, planes * K / 2], torch's int4pack layout
    scales_zeros: torch.Tensor  # bf16 [planes * K / 32, N padded to 16, 2]
    chunk: int  # 32, or 16 for q6_k (its scales cover 16 elements)
    factors: tuple[int, ...]  # one per plane; powers of two, so exact in bf16
    out_dtype: torch.dtype

    @property
    def planes(self) -> int:
        return len(self.factors)

    @property
    def nbytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size()
                + self.scales_zeros.numel() * self.scales_zeros.element_size())


# ---- load: QuantWeight -> planes -> packed --------------------------------------------------

def prepare_cpu_weight(w: QuantWeight, act_dtype: torch.dtype = torch.bfloat16):
    """`w` (on the CPU) in its form for `cpu_quant_linear`, once at load: a `CpuQuant` for the
    types of `QDOT_QTYPES`, else a `CpuPacked`. `act_dtype`: the dtype of the outputs."""
    if w.qtype in QDOT_QTYPES and qdot_cpu.available():
        return qdot_cpu.prepare(w, act_dtype)
    return pack_int4(w, act_dtype)


def pack_int4(w: QuantWeight, act_dtype: torch.dtype = torch.bfloat16) -> CpuPacked:
    """Packs `w` for torch's int4 kernel. It computes with bf16 activations and bf16 scales;
    `act_dtype` is the dtype of the outputs it hands back."""
    n, k = w.shape
    chunk, factors = _PLANE_LAYOUT[w.qtype]
    n_pad = -(-n // ROW_ALIGN) * ROW_ALIGN
    packed, scales, zeros = [], [], []
    for start in range(0, n, PACK_ROWS):
        stop = min(n, start + PACK_ROWS)
        rows = QuantWeight(w.qtype, (stop - start, k),
                           **{name: t[start:stop] for name, t in w.tensors().items()})
        codes, scale, zero = _planes(rows)
        pad = n_pad - n if stop == n else 0
        codes = torch.nn.functional.pad(codes.to(torch.int32), (0, 0, 0, pad), value=8)
        packed.append(torch._convert_weight_to_int4pack_for_cpu(codes, 1))
        scales.append(scale)
        zeros.append(zero)
    scale = torch.nn.functional.pad(torch.cat(scales), (0, 0, 0, n_pad - n))
    zero = torch.nn.functional.pad(torch.cat(zeros), (0, 0, 0, n_pad - n))
    scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).to(torch.bfloat16).contiguous()
    if int4pack_cpu.available():
        int4pack_cpu.warm_up(chunk, factors)
    return CpuPacked(w.qtype, (n, k), torch.cat(packed), scales_zeros, chunk, factors, act_dtype)


_PLANE_LAYOUT = {"q4_0": (32, (1,)), "q4_1": (32, (1,)), "q4_k": (32, (1,)),
                 "q5_0": (32, (1, 16)), "q5_1": (32, (1, 16)), "q5_k": (32, (1, 16)),
                 "q8_0": (32, (1, 16)), "q6_k": (16, (1, 8))}
"""qtype -> (chunk, activation factor per plane), as in `CpuPacked`."""


def _planes(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K'] (0..15, K' = planes * K in the chunk-interleaved order), and fp32
    scale, zero [N, K' / 32]: the table in the module docstring."""
    n, k = w.shape
    q = unpacked_codes(w)  # [N, K/32, 32]
    d = w.d.float()
    if w.qtype == "q6_k":  # value = s * (lo - 8) + 8 s * (2 hi - 3) = s * (q - 32)
        q = q.view(n, k // 16, 16)
        codes = torch.stack([q & 15, 2 * (q >> 4) + 5], dim=2)
        scale = d.repeat_interleave(16, dim=1) * w.sc.float()  # [N, K/16]: one K'-group each
        return codes.view(n, 2 * k), scale, torch.zeros_like(scale)
    if w.qtype in ("q4_k", "q5_k"):
        scale = d.repeat_interleave(8, dim=1) * w.sc.float()  # [N, K/32]
        offset = -w.m.float().repeat_interleave(8, dim=1) * w.mn.float()
    else:
        scale = d
        offset = w.m.float() if w.m is not None else torch.zeros_like(d)
    if w.qtype in ("q4_0", "q4_1", "q4_k"):  # (q - 8) s + (8 s + offset) = s q + offset
        zero = 8 * scale + offset if w.qtype != "q4_0" else offset
        return q.view(n, k), scale, zero
    # two planes: the low nibble, and the high bits (times 16 through the activations);
    # q5_0's offset -16 d and q8_0's sign live in the low plane's zero and the high codes
    if w.qtype == "q5_0":
        zero = -8 * scale
    elif w.qtype == "q8_0":  # q = lo + 16 * (q >> 4), q >> 4 in -8..7
        zero = 8 * scale
    else:
        zero = 8 * scale + offset
    codes = torch.stack([q & 15, (q >> 4) + 8], dim=2).to(torch.uint8)  # [N, K/32, 2, 32]
    scale2 = scale.repeat_interleave(2, dim=1)
    zero2 = torch.stack([zero, torch.zeros_like(zero)], dim=2).view(n, -1)
    return codes.view(n, 2 * k), scale2, zero2


# ---- the matmul -----------------------------------------------------------------------------

def cpu_quant_linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in `w.out_dtype`: the type's own kernel (`CpuQuant`) or the packed
    kernel for small M (decode, verify), a dense bf16 matmul on a per-call dequantized copy for
    large M (prefill)."""
    if isinstance(w, CpuQuant):
        y = qdot_linear(x, w)
        return y if bias is None else y + bias
    m, k = x.shape
    n = w.shape[0]
    x = x.to(torch.bfloat16).contiguous()
    y = _dense_linear(x, w) if takes_dense_path(m, w) else packed_mm(x, w)
    y = y[:, :n].to(w.out_dtype)
    return y if bias is None else y + bias


_PREFILL = [False]


@contextlib.contextmanager
def prefill_rows():
    """Within it (a step that computes prompt tokens, kept by the model runner) 16-bit weights
    take half_cpu.py's block kernel at every M, so a prompt row of a bf16 / fp16 model gets the
    same bits whatever chunk it came in (that kernel costs what the row kernel does).

    Quantized weights choose by M alone, as in any step (`takes_dense_path`). Until session 44
    every prompt row went to the dense path here, for the same reason; but the dense path
    dequantizes every weight whatever M is, so the short tail a prefix-cache hit leaves paid a
    whole model's dequantization: Qwen2.5-Coder-1.5B Q4_K_M, all its matrices, 9 rows 298 ms
    dense against 67 ms on the matvec kernels (1 row: 27 ms); the first token after 512 cached
    prompt tokens took 226 ms for a 1-token tail and 270 ms for 9 tokens, now 28.5 and 86 ms
    (2 threads, `bench/cpu_prefill_tail.py`). A cached prompt's tail now agrees
    with a cold prefill of it to the rounding of the activations (int8 / int16 against bf16),
    as two chunkings of a long prompt always did, not bit for bit. One caller at a time (the
    model runner)."""
    _PREFILL[0] = True
    try:
        yield
    finally:
        _PREFILL[0] = False


def in_prefill() -> bool:
    return _PREFILL[0]


def takes_dense_path(m: int, w) -> bool:
    """Whether M rows of x multiply `w` as dequantized bf16 tiles: from `dense_min_rows(w)`
    rows on (`DENSE_MIN_ROWS` by planes on int4pack weights)."""
    if isinstance(w, CpuQuant):
        return m >= dense_min_rows(w)
    return m >= DENSE_MIN_ROWS[w.planes] and int4pack_cpu.available()


def qdot_linear(x: torch.Tensor, w: CpuQuant, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in `w.out_dtype` (or into `out`, fp32 [M, N], possibly a column slice
    of a wider buffer). Few rows: `qdot_cpu.matvec` on fp32 activations; from
    `dense_min_rows(w)` on, tiles of W times x in `dense_dtype()` (bf16, or fp32 on CPUs
    without bf16 instructions)."""
    m, n = x.shape[0], w.shape[0]
    if takes_dense_path(m, w):
        y = _qdot_dense(x.to(dense_dtype()).contiguous(), w)
        return y.to(w.out_dtype) if out is None else out.copy_(y)
    y = out if out is not None else torch.empty(m, n)
    qdot_cpu.matvec(x.float().contiguous().numpy(), w, y.numpy())
    return y if out is not None else y.to(w.out_dtype)


def _qdot_dense(x: torch.Tensor, w: CpuQuant) -> torch.Tensor:
    """x (bf16 or fp32) @ W^T in x's dtype, W dequantized a tile of rows at a time."""
    n, k = w.shape
    dtype = x.dtype
    rows = max(1, DENSE_TILE_BYTES // (dtype.itemsize * k))
    y = torch.empty(x.shape[0], n, dtype=dtype)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        tile = int4pack_cpu.scratch((stop - start) * k, dtype).view(stop - start, k)
        qdot_cpu.dequantize_rows(w, start, (tile.view(torch.uint16) if dtype == torch.bfloat16
                                            else tile).numpy())
        y[:, start:stop] = x @ tile.t()
    return y


def packed_mm(x: torch.Tensor, w: CpuPacked) -> torch.Tensor:
    """bf16 x [M, K] -> bf16 [M, N padded to ROW_ALIGN] on the packed kernel."""
    return torch._weight_int4pack_mm_for_cpu(_expand(x, w), w.packed, GROUP, w.scales_zeros)


def _expand(x: torch.Tensor, w: CpuPacked) -> torch.Tensor:
    """[M, K] -> [M, K']: each chunk repeated once per plane, times the plane's factor."""
    if w.planes == 1:
        return x.contiguous()
    m, k = x.shape
    f = x.new_tensor(w.factors).view(1, 1, -1, 1)
    return (x.view(m, k // w.chunk, 1, w.chunk) * f).view(m, w.planes * k)


def _dense_linear(x: torch.Tensor, w: CpuPacked) -> torch.Tensor:
    layout = int4pack_cpu.layout()
    k = w.shape[1]
    scale, zero = int4pack_cpu.fold_scales(w.scales_zeros, w.chunk, w.factors)
    args = (w.packed.view(-1).numpy(), scale.numpy(), zero.numpy(), w.chunk, w.factors, layout)
    tile = max(layout[0], DENSE_TILE_BYTES // (2 * k) // layout[0] * layout[0])
    outs = []
    for start, stop in int4pack_cpu.tiles(w.packed.shape[0], layout, tile):
        wt = int4pack_cpu.scratch(k * (stop - start)).view(k, stop - start)  # W^T of these rows
        int4pack_cpu.dequantize_t(*args, start, stop, wt)
        outs.append(x @ wt)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
