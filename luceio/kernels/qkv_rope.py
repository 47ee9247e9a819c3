"""The attention's input stage in one call: split a fused QKV projection's output into heads,
apply the per-head q/k RMSNorm (Qwen3), rotate q and k (RoPE, rotate-half), write k and v to
the paged KV cache, and hand back q as a contiguous [tokens, heads, head_dim] tensor.

`qkv_rope_cache_ref` is the sequence the model ran before this existed (split views, two
`.contiguous()` copies, `rms_norm`, `rotary`, `write_kv`): the CPU path and the reference.
On GPUs `qkv_rope_triton.qkv_rope_cache` does it in one launch (one program per token) where
the sequence took four to six, which for a small model's decode step is most of the cost:
each of those launches moves a few KB.
"""
from __future__ import annotations

import torch


def qkv_rope_cache_ref(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                       q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                       eps: float = 1e-6) -> torch.Tensor:
    """qkv [num_tokens, (num_heads + 2 num_kv_heads) head_dim] (last dim contiguous) ->
    q [num_tokens, num_heads, head_dim] rotated; k (rotated) and v written at `slot_mapping`
    (-1: not written). `q_norm` / `k_norm`: per-head RMSNorm weights [head_dim], or None."""
    from . import rms_norm, rotary, write_kv
    n = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(n, num_heads, head_dim)
    k = k.reshape(n, num_kv_heads, head_dim)
    v = v.reshape(n, num_kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm(q.reshape(-1, head_dim), q_norm, eps).view_as(q)
        k = rms_norm(k.reshape(-1, head_dim), k_norm, eps).view_as(k)
    q, k = q.contiguous(), k.contiguous()
    rotary(positions, q, k, cos_sin)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q
