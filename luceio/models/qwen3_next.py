"""Qwen3-Next (transformers `qwen3_next`, `Qwen3NextForCausalLM`): the hybrid layers of Qwen3.5
(`qwen3_5.py`: Gated DeltaNet + gated full attention, (1 + w) norms, partial RoPE) with
Qwen3-MoE's sparse-layer rules (`decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`) and
Qwen3.5-MoE's shared expert (`qwen3_5_moe.SharedExpertMoeBlock`); dense layers keep a gated
MLP of `intermediate_size`.

The checkpoint stores the DeltaNet's input projections interleaved by key head:
`in_proj_qkvz` rows are, per key head, [q | k | its value heads' v | their z], and `in_proj_ba`
rows, per key head, [its value heads' b | their a]. The loader regroups them into Qwen3.5's
layout (q of all heads, k, v, then z, b, a), in HF's grouped value-head order, so the layers
are Qwen3.5's unchanged. Engine features: as Qwen3.5's (`qwen3_5.check_engine_support`).
"""
from __future__ import annotations

import torch

from .moe import MoeConfig
from .qwen3_5 import Qwen35Config, Qwen3_5ForCausalLM
from .qwen3_5_moe import Qwen3_5MoeForCausalLM, SharedExpertMoeBlock

ARCHITECTURES = ("Qwen3NextForCausalLM",)


def moe_config(c: dict) -> tuple[MoeConfig, int]:
    """(the routed experts' config, the shared expert's width)."""
    return MoeConfig.from_hf(c), c["shared_expert_intermediate_size"]


def regroup(name: str, w: torch.Tensor, cfg: Qwen35Config):
    """Qwen3-Next's interleaved `in_proj_qkvz` / `in_proj_ba` weight -> Qwen3.5's
    (`in_proj_qkv`, `in_proj_z`) / (`in_proj_b`, `in_proj_a`) pairs, as (name, tensor)."""
    k_heads, kd, vd = cfg.linear_num_k_heads, cfg.linear_k_dim, cfg.linear_v_dim
    per_k = cfg.linear_num_v_heads // k_heads
    prefix = name.removesuffix("in_proj_qkvz.weight").removesuffix("in_proj_ba.weight")
    if name.endswith("in_proj_qkvz.weight"):
        g = w.reshape(k_heads, 2 * kd + 2 * per_k * vd, -1)
        q, k, v, z = g.split([kd, kd, per_k * vd, per_k * vd], dim=1)
        flat = [t.reshape(-1, w.shape[-1]) for t in (q, k, v, z)]
        yield prefix + "in_proj_qkv.weight", torch.cat(flat[:3])
        yield prefix + "in_proj_z.weight", flat[3]
    else:
        b, a = w.reshape(k_heads, 2 * per_k, -1).split([per_k, per_k], dim=1)
        yield prefix + "in_proj_b.weight", b.reshape(-1, w.shape[-1])
        yield prefix + "in_proj_a.weight", a.reshape(-1, w.shape[-1])


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    family = "Qwen3-Next"

    def __init__(self, cfg: Qwen35Config, moe: MoeConfig, shared_inter: int):
        Qwen3_5ForCausalLM.__init__(self, cfg)  # dense MLPs everywhere first
        self.moe_cfg = moe
        for i in moe.sparse_layers:
            self.layers[i].mlp = SharedExpertMoeBlock(cfg.hidden_size, moe, shared_inter)

    def load_weights(self, weights, dtype: torch.dtype | None = None,
                     device: torch.device | str = "cpu", quantize: str | None = None,
                     **kwargs) -> None:
        """Qwen3.5-MoE's loading, the interleaved projections regrouped first."""
        super().load_weights(self._regrouped(weights), dtype, device, quantize, **kwargs)

    def _regrouped(self, weights):
        for name, tensor in weights:
            if name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")):
                yield from regroup(name, tensor, self.cfg)
            else:
                yield name, tensor
