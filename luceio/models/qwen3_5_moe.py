"""Qwen3.5 mixture-of-experts text models (transformers `qwen3_5_moe_text`,
`Qwen3_5MoeForCausalLM`, and the released multimodal `Qwen3_5MoeForConditionalGeneration`
served text only): Qwen3.5's hybrid layers (`qwen3_5.py`) with every MLP a sparse block.

Rules (transformers' `modeling_qwen3_5_moe.py`):
- The router takes the top `num_experts_per_tok` of an fp32 softmax over `num_experts` and
  always renormalises them (`moe.route_topk_ref` with renormalize); the experts are SiLU-gated
  MLPs of width `moe_intermediate_size`, run by `kernels.fused_moe` as Qwen3-MoE's are
  (`moe.SparseMoeBlock`, the same per-expert checkpoint names, stacked at load).
- Beside the routed experts every token also goes through a shared expert (a gated MLP of width
  `shared_expert_intermediate_size`) scaled by sigmoid(`shared_expert_gate`(x)), a per-token
  scalar; the two are summed.
- Expert weights load dense in the model dtype (`--quantization int8|int4` is refused); expert
  offload (`--expert-memory`, `expert_offload.py`) keeps the routed experts in host memory as
  for Qwen3-MoE, the shared expert always on the device.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from .linear import Linear
from .llama import MLP
from .moe import ExpertLoading, MoeConfig, SparseMoeBlock
from .qwen3_5 import Qwen35Config, Qwen3_5ForCausalLM

ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")


def moe_config(c: dict) -> tuple[MoeConfig, int]:
    """(the routed experts' config, the shared expert's width) of an HF config (its
    `text_config` for the multimodal wrapper). Every layer is sparse."""
    c = c.get("text_config", c)
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Qwen3.5-MoE with hidden_act {c['hidden_act']!r} is not supported")
    return (MoeConfig(num_experts=c["num_experts"], top_k=c["num_experts_per_tok"],
                      moe_intermediate_size=c["moe_intermediate_size"], norm_topk_prob=True,
                      sparse_layers=tuple(range(c["num_hidden_layers"]))),
            c["shared_expert_intermediate_size"])


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus a gated shared expert (see the module docstring)."""

    def __init__(self, hidden_size: int, moe: MoeConfig, shared_inter: int):
        super().__init__(hidden_size, moe)
        self.shared_expert = MLP(SimpleNamespace(hidden_size=hidden_size,
                                                 intermediate_size=shared_inter))
        self.shared_expert_gate = Linear(hidden_size, 1)

    def forward(self, x: torch.Tensor, xqs: dict | None = None) -> torch.Tensor:
        return super().forward(x, shared=(self.shared_expert(x), self.shared_expert_gate(x)))


class Qwen3_5MoeForCausalLM(ExpertLoading, Qwen3_5ForCausalLM):
    family = "Qwen3.5-MoE"

    def __init__(self, cfg: Qwen35Config, moe: MoeConfig, shared_inter: int):
        super().__init__(cfg)
        self.moe_cfg = moe
        for i in moe.sparse_layers:
            self.layers[i].mlp = SharedExpertMoeBlock(cfg.hidden_size, moe, shared_inter)
