"""Triton implementations behind `luceio.kernels` (see `__init__.py` for the dispatch).

Same signatures and return conventions as the torch references: `rms_norm` returns `out` or
`(out, residual)`, `rotary` and `write_kv` work in place and return None, `paged_attention`
picks the split-KV decode kernel when `max_query_len == 1` and the varlen prefill kernel
otherwise. Launch configs come from `configs.get_config(device)`.
"""
from __future__ import annotations

from .attention_triton import paged_attention
from .kv_write_triton import write_kv
from .elementwise_triton import gemma_rms_norm, rms_norm, rotary, silu_and_mul
from .moe_triton import fused_moe
from .qkv_rope_triton import qkv_rope_cache

__all__ = ["rms_norm", "gemma_rms_norm", "silu_and_mul", "rotary", "write_kv", "paged_attention",
           "qkv_rope_cache", "fused_moe"]
