"""Per-architecture launch configs for the Triton kernels.

`get_config(device)` returns the `KernelConfig` for a tensor's device: a user-tuned entry in
`$LUCEIO_CACHE/kernel_configs/<arch>.json` (default cache folder `~/.cache/luceio`) wins over the
built-in table, which is keyed by arch string ("sm_90", "gfx1201", ...; "default" otherwise).
`python -m luceio.kernels.tune` writes that file. A user file may hold only some fields: the
others come from the table entry (or "default") for that arch.

None of the table entries is measured yet: each is a starting point chosen from the chip's
shared-memory size and SM count, and its `source` says so.
"""
from __future__ import annotations

import json
import os
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from . import config_sources

NOT_MEASURED = "starting point, not measured"


@dataclass(frozen=True)
class KernelConfig:
    # paged decode (one query token per request): split-KV ("flash-decoding") + a reduce kernel
    decode_block_n: int = 64             # keys per inner iteration
    decode_num_warps: int = 4
    decode_num_warps_wide: int = 0       # for head_dim >= 128 (0: decode_num_warps)
    decode_num_stages: int = 2
    decode_min_tokens_per_split: int = 512  # never give a split less context than this
    decode_max_splits: int = 32
    decode_waves: float = 2.0            # stop splitting once batch*kv_heads*splits >= waves*SMs
    reduce_num_warps: int = 4
    # varlen prefill over the paged cache: BLOCK_M rows of (query token, head of the GQA group)
    prefill_block_m: int = 64
    prefill_block_n: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2
    # split the keys of a prefill launch of at most this many programs (0: never), as decode
    # does, into runs of >= decode_min_tokens_per_split keys (attention_triton.prefill_splits)
    prefill_split_max_programs: int = 0
    # shared memory one program may use (KiB); the launchers shrink tiles to fit it
    max_shared_kb: int = 96
    # skinny quantized / dense GEMM (quant_triton.py): a program owns BLOCK_N output features of
    # every row of x. 2..16 rows: tl.dot on tiles of BLOCK_K weights; 1 row of a quantized weight:
    # the int8 dp4a GEMV (quant_gemv.py), 1 row of a dense weight: multiply + sum
    qgemm_block_n: int = 32
    qgemm_block_k: int = 256             # powers of two >= 32 (whole 32-groups)
    qgemm_num_warps: int = 4
    # the quantized GEMV is laid out for one warp per program (a thread per 32-group, rows in
    # registers): more warps split tiles between warps and cost layout conversions in the loop.
    # Defaults: sm_90's measured tile, a starting point for cards not measured yet
    gemv_block_n: int = 4
    gemv_block_k: int = 1024
    gemv_num_warps: int = 1
    gemv_prefetch: bool = True           # load the next tile's code words before computing this one
    gemv_early_load: bool = True         # ... the first tile's before the PDL wait (one row)
    gemv_tails: bool = True              # the SiLU after a gate/up GEMV and the residual add +
    # RMSNorm after an o / down GEMV done by its last programs, no launch (quant_gemv_tail.py),
    gemv_glu_tail_max_n: int = 12288     # ... the SiLU up to this gate/up output width (2 x I),
    gemv_norm_tail_max_n: int = 1024     # ... the norm up to this hidden size (measured on an
    # H100: a 0.5B step 1.27x faster with both; at 1.5B / 7B sizes they cost more than they save)
    # split K while the rows alone give fewer programs (one warp each) than this, into splits of
    # >= gemv_min_tiles_per_split tiles: a short, long-K matrix is too few warps for the loads
    gemv_split_min_programs: int = 256
    gemv_min_tiles_per_split: int = 2
    gemv_max_m: int = 8                  # quantized: up to this many rows of x the int8 GEMV runs,
    gemv_rows_per_launch: int = 8        # ... this many rows a launch (the weight read once each)
    gemv_rows_block_n: int = 0           # block_n of launches of several rows (each row adds
    # registers; K is split as for one row, so each row's sums stay those of one row); 0: gemv_block_n
    gemv_row_blocks: int = 1             # 2: rows in two blocks (5 = 4 + 1) instead of padded to 8
    gemv_rows_prefetch: bool = True      # gemv_prefetch for launches of several rows
    skinny_row_block_n: int = 64         # 1 row in quant_triton's skinny kernel (dense_matmul_skinny)
    skinny_row_block_k: int = 256
    skinny_row_num_warps: int = 4
    # the decode step's dense (bf16 / fp16) projections (dense_gemv.py): up to dense_gemv_max_m
    # rows of x (0: cuBLAS); a program owns block_n output features over a K-split, K split
    # while N alone gives fewer than dense_gemv_split_min_programs programs
    dense_gemv_max_m: int = 0
    dense_gemv_max_n: int = 0            # larger N (an LM head) -> cuBLAS; 0: no bound
    dense_gemv_block_n: int = 8
    dense_gemv_block_k: int = 512
    dense_gemv_num_warps: int = 4
    dense_gemv_split_min_programs: int = 264
    dense_gemv_min_tiles_per_split: int = 2
    # wide, short-K matrices (N >= dense_gemv_wide_min_n, K <= dense_gemv_wide_max_k: a small
    # model's gate/up) take their own tile: many programs, each over a short K (0: off)
    dense_gemv_wide_min_n: int = 0
    dense_gemv_wide_max_k: int = 2048
    dense_gemv_wide_block_n: int = 8
    dense_gemv_wide_block_k: int = 256
    dense_gemv_wide_num_warps: int = 2
    # deep, small matrices (K >= dense_gemv_deep_min_ratio * N, N * K <= dense_gemv_deep_max_elems:
    # a small model's down projection) take their own tile and split rule (0: off)
    dense_gemv_deep_min_ratio: int = 0
    dense_gemv_deep_max_elems: int = 0
    dense_gemv_deep_block_n: int = 8
    dense_gemv_deep_block_k: int = 512
    dense_gemv_deep_num_warps: int = 4
    dense_gemv_deep_split_min_programs: int = 528
    # the first weight tile is loaded before the PDL wait (weights are never written in a step)
    dense_gemv_prefetch: bool = True
    # an RMSNorm before a dense projection is done in the projection's GEMV (`rms_norm_linear`)
    # where its launch has at most dense_gemv_norm_max_programs programs (each takes the row's
    # sum of squares before its first product)
    dense_gemv_norm: bool = True
    dense_gemv_norm_max_programs: int = 512
    # ... and a layer's RoPE and KV-cache write in its QKV GEMV's epilogue (no q/k norm)
    dense_gemv_rope: bool = True
    # ... and the projection before a norm (o, down) adds the residual in its epilogue and
    # writes the norm's partial sums of squares (`linear_add`), so the norm is done in the
    # next projection's loads whatever its launch size, and has no launch of its own
    dense_gemv_sum_ahead: bool = True
    qgemm_num_stages: int = 2
    # the dot path with the weights as the product's A operand (acc^T = W x^T): on Hopper a
    # warpgroup MMA takes the dequantized tile from registers, x^T from shared memory
    qgemm_swap: bool = False
    # the dot path with q4_0, q4_k or q6_k weights and bf16 x: the tile
    # dequantized two weights a register by PTX (`quant_tile_triton._packed_weights`; NVIDIA,
    # sm_80+), in a K order that puts each thread's codes where its MMA fragment wants them
    qgemm_packed: bool = False
    qgemm_prefetch_scales: bool = False  # packed tiles: load the next K tile's scales a tile ahead
    qgemm_split_k_min_programs: int = 256  # split K while N alone gives fewer programs
    qgemm_max_split_k: int = 16
    qgemm_min_tiles_per_split: int = 2
    skinny_max_m: int = 16               # larger batches: dequantize + torch GEMM (at most 32)
    skinny_max_m_q6_k: int = 0           # ... for q6_k weights (0: skinny_max_m)
    dequant_block_n: int = 16
    dequant_block_k: int = 256
    dequant_num_warps: int = 4
    # mixture-of-experts grouped GEMMs (moe_triton.py): tiles of up to moe_block_m (token, expert)
    # pairs of one expert (shorter when the experts' groups are: 16 for decode) by moe_block_n
    # output columns. Only the default is set; no card has been measured yet
    moe_block_m: int = 64
    moe_block_n: int = 64
    moe_block_k: int = 64
    moe_num_warps: int = 4
    moe_num_stages: int = 2
    # MoE at decode sizes (moe_decode_triton.py): one-row GEMVs per (token, expert) pair; a
    # gate/up program owns block_n columns of inter (gate and up rows) of a pair, a down
    # program block_n columns of hidden of a pair
    moe_decode_gu_block_n: int = 32
    moe_decode_gu_block_k: int = 128
    moe_decode_gu_num_warps: int = 4
    moe_decode_down_block_n: int = 16
    moe_decode_down_block_k: int = 128
    moe_decode_down_num_warps: int = 4
    # programmatic dependent launch (kernels/pdl.py, sm_90+): a step's kernels launch while the
    # one before finishes; grids of at most pdl_early_max_programs programs let the next kernel
    # launch from their start
    pdl: bool = False
    pdl_early_max_programs: int = 1024
    # the Gated DeltaNet's chunked prefill (delta_rule_prefill_triton.py): chunks of gdn_block_t
    # tokens (a power of two >= 16), state tiles of gdn_block_v columns, the products' precision
    # for 16-bit inputs ("ieee" fp32 or "tf32" tensor cores; fp32 inputs always "ieee")
    gdn_block_t: int = 32
    gdn_block_v: int = 32
    gdn_num_warps: int = 4
    gdn_chunk_num_warps: int = 4
    gdn_num_stages: int = 1              # the state pass's loop (its loads are pipelined)
    # at least this many state-pass programs (sequences x v heads x column blocks; 0: never):
    # the wide tile instead (more columns a program, shorter chunks)
    gdn_wide_min_programs: int = 0
    gdn_wide_block_t: int = 32
    gdn_wide_block_v: int = 64
    gdn_dot_precision: str = "ieee"
    # the chunk's inverse from 16 x 16 blocks (32-token chunks only) instead of row by row over
    # the whole tile; tested under the interpreter, not yet measured on a GPU
    gdn_inverse_blocks: bool = False
    source: str = NOT_MEASURED


TABLE: dict[str, KernelConfig] = {
    # Ampere GA102 (RTX 3090): 82 SMs, 100 KiB shared memory per SM (99 KiB per block)
    "sm_86": KernelConfig(decode_block_n=64, decode_num_warps=4, decode_num_stages=2,
                          prefill_block_m=64, prefill_block_n=64, prefill_num_warps=4,
                          prefill_num_stages=2, max_shared_kb=96,
                          qgemm_split_k_min_programs=164, gdn_dot_precision="tf32"),
    # Ada AD102 (RTX 4090): 128 SMs, 100 KiB shared memory per SM
    "sm_89": KernelConfig(decode_block_n=64, decode_num_warps=4, decode_num_stages=3,
                          prefill_block_m=64, prefill_block_n=64, prefill_num_warps=4,
                          prefill_num_stages=2, max_shared_kb=96,
                          qgemm_num_stages=3, qgemm_split_k_min_programs=256,
                          gdn_dot_precision="tf32"),
    # Hopper (H100 / H200): 132 SMs, 228 KiB shared memory per SM, HBM3(e)
    "sm_90": KernelConfig(decode_block_n=64, decode_num_warps=2, decode_num_warps_wide=8,
                          decode_num_stages=2,
                          decode_min_tokens_per_split=64, decode_max_splits=64,
                          prefill_block_m=64, prefill_block_n=64, prefill_num_warps=4,
                          prefill_num_stages=3, max_shared_kb=220, prefill_split_max_programs=32,
                          qgemm_block_n=64, qgemm_block_k=128, qgemm_num_stages=3,
                          qgemm_swap=True, qgemm_split_k_min_programs=1056, qgemm_packed=True,
                          gemv_block_n=4, gemv_block_k=1024, gemv_num_warps=1, gemv_prefetch=True,
                          gemv_split_min_programs=4224, gemv_min_tiles_per_split=1,
                          pdl=True, dense_gemv_max_m=1, dense_gemv_max_n=65536,
                          dense_gemv_block_n=8,
                          dense_gemv_block_k=1024, dense_gemv_num_warps=4,
                          dense_gemv_split_min_programs=132, dense_gemv_wide_min_n=8192,
                          dense_gemv_wide_block_n=8, dense_gemv_wide_block_k=256,
                          dense_gemv_wide_num_warps=2, dense_gemv_deep_min_ratio=4,
                          dense_gemv_deep_max_elems=16 << 20,
                          skinny_max_m=32, skinny_max_m_q6_k=8, gemv_row_blocks=2,
                          gemv_rows_prefetch=False,
                          moe_decode_gu_block_n=4, moe_decode_gu_block_k=1024,
                          moe_decode_gu_num_warps=2, moe_decode_down_block_n=8,
                          moe_decode_down_block_k=256, moe_decode_down_num_warps=1,
                          gdn_block_t=32, gdn_block_v=32, gdn_dot_precision="tf32",
                          gdn_num_stages=2, gdn_wide_min_programs=528,
                          source=config_sources.SM_90),
    # RDNA4 (Radeon AI PRO R9700): 64 CUs, wave32 WMMA, 64 KiB LDS per workgroup.
    # RDNA runs wave32: num_warps=4 is 4 x 32 = 128 lanes here (256 on a wave64 CDNA part)
    "gfx1201": KernelConfig(decode_block_n=32, decode_num_warps=4, decode_num_stages=1,
                            prefill_block_m=64, prefill_block_n=32, prefill_num_warps=4,
                            prefill_num_stages=1, max_shared_kb=64,
                            qgemm_num_stages=1, qgemm_split_k_min_programs=128),
    # RDNA3.5 APU (Strix Halo): 40 CUs on LPDDR5X, 64 KiB LDS per workgroup
    "gfx1151": KernelConfig(decode_block_n=32, decode_num_warps=4, decode_num_stages=1,
                            decode_min_tokens_per_split=1024, decode_max_splits=16,
                            prefill_block_m=64, prefill_block_n=32, prefill_num_warps=4,
                            prefill_num_stages=1, max_shared_kb=64,
                            qgemm_block_n=16, qgemm_num_stages=1, qgemm_split_k_min_programs=80),
    "default": KernelConfig(),
}

_FIELDS = {f.name for f in fields(KernelConfig)}
_override: KernelConfig | None = None
_by_arch: dict[str, KernelConfig] = {}
_device_info: dict[int, tuple[str, int]] = {}


# launch geometry from a config -----------------------------------------------------------------

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fit_shared(block_m: int, block_n: int, stages: int, block_d: int, elt: int,
                budget_kb: int) -> tuple[int, int]:
    """Shrinks (block_n, stages) until the Q tile plus `stages` K/V tiles fit the budget."""
    def need(bn, st):
        return (block_m * block_d + max(st, 1) * 2 * bn * block_d) * elt
    while need(block_n, stages) > budget_kb * 1024 and block_n > 16:
        block_n //= 2
    while need(block_n, stages) > budget_kb * 1024 and stages > 1:
        stages -= 1
    return block_n, stages


def decode_warps(cfg, head_dim: int) -> int:
    """num_warps of a decode attention launch: `decode_num_warps_wide` for head_dim >= 128
    where the table sets it."""
    if head_dim >= 128 and cfg.decode_num_warps_wide:
        return cfg.decode_num_warps_wide
    return cfg.decode_num_warps


def decode_splits(cfg, num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int,
                  block_n: int) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for a decode launch; tokens_per_split is a multiple of
    block_n. `sms` 0 (CPU / interpreter) puts no occupancy cap on the split count."""
    max_seq_len = max(int(max_seq_len), 1)
    splits = min(cfg.decode_max_splits, _cdiv(max_seq_len, cfg.decode_min_tokens_per_split))
    if sms > 0:
        splits = min(splits, _cdiv(int(cfg.decode_waves * sms), num_seqs * num_kv_heads))
    splits = max(splits, 1)
    tokens = _cdiv(_cdiv(max_seq_len, splits), block_n) * block_n
    return _cdiv(max_seq_len, tokens), tokens


def prefill_splits(cfg, programs: int, max_seq_len: int, sms: int, block_n: int) -> int:
    """Key splits of a prefill launch of `programs` programs: 1 past
    `prefill_split_max_programs`, else `decode_splits`' count for that many programs."""
    if not 0 < programs <= cfg.prefill_split_max_programs:
        return 1
    return decode_splits(cfg, programs, 1, max_seq_len, sms, block_n)[0]


def skinny_split_k(cfg: KernelConfig, n_programs: int, k_tiles: int,
                   gemv: bool = False, dense: bool = False,
                   min_programs: int | None = None) -> tuple[int, int]:
    """(split_k, k tiles per split) for `n_programs` programs along N over `k_tiles` K tiles.
    Split only when N alone leaves fewer than `qgemm_split_k_min_programs` programs
    (`gemv_split_min_programs` for the one-row GEMV, `dense_gemv_split_min_programs` for the
    dense one), and never into splits of fewer than `qgemm_min_tiles_per_split`
    (`gemv_` / `dense_gemv_min_tiles_per_split`) tiles; no split is left empty.
    `min_programs` replaces the config's bound (the dense GEMV's deep tile)."""
    p = "gemv" if gemv else "dense_gemv" if dense else None
    if min_programs is None:
        min_programs = getattr(cfg, f"{p}_split_min_programs") if p else \
            cfg.qgemm_split_k_min_programs
    min_tiles = getattr(cfg, f"{p}_min_tiles_per_split") if p else cfg.qgemm_min_tiles_per_split
    split = 1
    if n_programs < min_programs:
        split = _cdiv(min_programs, n_programs)
        split = min(split, cfg.qgemm_max_split_k, k_tiles // max(1, min_tiles))
    split = max(split, 1)
    tiles = _cdiv(k_tiles, split)
    return _cdiv(k_tiles, tiles), tiles


def cache_dir() -> Path:
    return Path(os.environ.get("LUCEIO_CACHE") or Path.home() / ".cache" / "luceio")


def user_config_path(arch: str) -> Path:
    return cache_dir() / "kernel_configs" / f"{arch}.json"


def _props_arch(props) -> str:
    gcn = getattr(props, "gcnArchName", "") or ""
    if torch.version.hip is not None and gcn:
        return gcn.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def _info(device) -> tuple[str, int]:
    """(arch, number of SMs/CUs) of a GPU; ("cpu", 0) for anything else."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        return "cpu", 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _device_info:
        props = torch.cuda.get_device_properties(index)
        _device_info[index] = (_props_arch(props), props.multi_processor_count)
    return _device_info[index]


def device_arch(device=None) -> str:
    return _info(device)[0]


def num_sms(device=None) -> int:
    """SM (CU) count of a GPU, 0 for CPU tensors (the interpreter: no occupancy limit)."""
    return _info(device)[1]


def config_from_dict(data: dict, base: KernelConfig) -> KernelConfig:
    unknown = sorted(set(data) - _FIELDS - {"arch"})
    if unknown:
        warnings.warn(f"kernel config: ignoring unknown fields {unknown}")
    return replace(base, **{k: v for k, v in data.items() if k in _FIELDS})


def config_to_dict(cfg: KernelConfig, arch: str | None = None) -> dict:
    d = asdict(cfg)
    if arch is not None:
        d = {"arch": arch, **d}
    return d


def load_config(arch: str) -> KernelConfig:
    """Table entry for `arch` ("default" if unknown), overridden by the user's tuned file."""
    base = TABLE.get(arch, TABLE["default"])
    path = user_config_path(arch)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return config_from_dict(data, base)
        except (OSError, ValueError, TypeError) as e:
            warnings.warn(f"kernel config {path} unreadable ({e}); using the built-in entry")
    return base


def get_config(device=None) -> KernelConfig:
    if _override is not None:
        return _override
    arch = device_arch(device)
    if arch not in _by_arch:
        _by_arch[arch] = load_config(arch)
    return _by_arch[arch]


def clear_cache() -> None:
    _by_arch.clear()


@contextmanager
def use_config(cfg: KernelConfig):
    """Forces `cfg` for every launch inside the block (tests, the tuner)."""
    global _override
    prev, _override = _override, cfg
    try:
        yield cfg
    finally:
        _override = prev
