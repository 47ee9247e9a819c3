"""Gemma 4 mixture-of-experts layers (`enable_moe_block`, the released 26B-A4B's shape).

Rules (transformers' `modeling_gemma4.py` is the truth: `Gemma4TextExperts`, `Gemma4TextRouter`
and the `enable_moe_block` branch of `Gemma4TextDecoderLayer.forward`; fp32 on the CPU matches
it to rounding):
- With `enable_moe_block` every layer keeps its dense gated MLP and adds a routed block beside
  it, both fed by the residual stream x after attention. The layer's feed-forward output is
  post_feedforward_layernorm(post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(x)))
  + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(x), router(x)))),
  added to x. All four norms scale by w (`Gemma4RMSNorm`).
- The router reads x itself, not a normed copy: RMS-normed with no weight (cast back to the
  model dtype), times its `scale` [hidden] and then hidden_size ** -0.5 (in the model dtype),
  through `proj` [num_experts, hidden] to logits; softmax in fp32, the top `top_k_experts`
  probabilities (best first) divided by their sum, times `per_expert_scale[expert]`: the
  weights stay fp32.
- Expert e holds `gate_up_proj[e]` ([gate | up] rows, [2 * moe_intermediate_size, hidden]) and
  `down_proj[e]` ([hidden, moe_intermediate_size]); a token's output is the sum over its
  experts of down_e(gelu_tanh(gate_e x) * up_e x) * weight, each product taken in fp32 (the
  weights' dtype) and rounded to the model dtype, the sum in the model dtype in ascending
  expert order (transformers' eager loop and `index_add_`).
- The experts' activation is the config's `hidden_activation`, which the config reader admits
  as gelu_pytorch_tanh only (`Gemma3Config.from_hf`), never SiLU: `kernels.fused_moe` and the
  few-token Triton path are SiLU kernels, so these experts run the torch code below on every
  device. `experts_grouped` groups the (token, expert) pairs by expert like
  `kernels.moe.fused_moe_ref` and reads the group sizes on the host, so these models run
  without CUDA graphs (`host_routing`, read by `moe.routes_on_host`): graphs would need every
  expert run over every token, 16x the expert reads of a 128-expert top-8 model.
- Weights load under the checkpoint's names: `layers.{i}.router.{proj.weight,scale,
  per_expert_scale}`, `layers.{i}.experts.{gate_up_proj,down_proj}` (stacked as stored) and
  the three extra norms; `block_name` maps them into the layer's `moe` block.
- Not supported (refused): `--quantization int8|int4` (`Gemma4ForCausalLM.load_weights`) and
  expert offload (`--expert-memory`, `models.check_engine_support`).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.moe import group_by_expert
from .gemma import GemmaRMSNorm
from .linear import Linear

# the checkpoint's names of a layer's MoE weights, which live in the layer's `moe` block here
_MOE_WEIGHT = re.compile(r"((?:model\.)?layers\.\d+\.)"
                         r"((?:router|experts|pre_feedforward_layernorm_2"
                         r"|post_feedforward_layernorm_[12])\..+)")


def moe_fields(c: dict) -> dict:
    """The `Gemma4Config` fields of an HF config dict: `num_experts` (0: no MoE block),
    `top_k_experts`, `moe_intermediate_size`; ValueError for an MoE config without them."""
    if not c.get("enable_moe_block"):
        return dict(num_experts=0, top_k_experts=0, moe_intermediate_size=0)
    fields = {k: c.get(k) for k in ("num_experts", "top_k_experts", "moe_intermediate_size")}
    if not all(isinstance(v, int) and v > 0 for v in fields.values()) or \
            fields["top_k_experts"] > fields["num_experts"]:
        raise ValueError(f"Gemma 4 with enable_moe_block needs num_experts, top_k_experts <= "
                         f"num_experts and moe_intermediate_size; the config has {fields}")
    return fields


def block_name(name: str) -> str:
    """A checkpoint tensor name with a layer's MoE weights moved into its `moe` block
    (`layers.3.router.scale` -> `layers.3.moe.router.scale`); other names unchanged."""
    match = _MOE_WEIGHT.fullmatch(name)
    return f"{match[1]}moe.{match[2]}" if match else name


class Gemma4Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k = top_k
        self.norm = GemmaRMSNorm(hidden_size, eps, scaled=False)
        self.proj = Linear(hidden_size, num_experts)
        self.scale = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)
        self.root_size = hidden_size ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [num_tokens, hidden] (the residual stream) -> (weights [num_tokens, top_k] fp32,
        expert_ids [num_tokens, top_k] int64), best expert first."""
        logits = self.proj(self.norm(x) * self.scale * self.root_size)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[expert_ids], expert_ids


def _expert(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert's GELU-tanh gated MLP on rows x [n, hidden], in their dtype."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.gelu(gate, approximate="tanh") * up, w_down)


def experts_grouped(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, hidden]; w_gate_up [num_experts, 2 * inter, hidden]; w_down
    [num_experts, hidden, inter]; weights (fp32), expert_ids [num_tokens, top_k] (the router's).
    The pairs grouped by expert (`kernels.moe.group_by_expert`, whose group sizes are read on
    the host); each expert's weighted rows are added to their tokens in one `index_add_` of
    distinct tokens, expert after expert: the same order on every device, run to run."""
    top_k = expert_ids.shape[1]
    order, counts = group_by_expert(expert_ids, w_gate_up.shape[0])
    pair_weights = weights.flatten()[order, None]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            group = slice(start, start + count)
            tokens = order[group] // top_k
            rows = _expert(x[tokens], w_gate_up[expert], w_down[expert])
            out.index_add_(0, tokens, (rows * pair_weights[group]).to(x.dtype))
            start += count
    return out


class Gemma4MoeBlock(nn.Module):
    """A layer's router, stacked experts and the three norms around them (module docstring);
    the layer's dense MLP and its `post_feedforward_layernorm` stay the layer's."""

    host_routing = True  # the experts' group sizes are read on the host: no CUDA graphs

    def __init__(self, cfg):
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        e, inter = cfg.num_experts, cfg.moe_intermediate_size
        self.router = Gemma4Router(dim, e, cfg.top_k_experts, eps)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, dim),
                                                 requires_grad=False)
        self.experts.down_proj = nn.Parameter(torch.empty(e, dim, inter), requires_grad=False)
        self.pre_feedforward_layernorm_2 = GemmaRMSNorm(dim, eps, unit_offset=False)
        self.post_feedforward_layernorm_1 = GemmaRMSNorm(dim, eps, unit_offset=False)
        self.post_feedforward_layernorm_2 = GemmaRMSNorm(dim, eps, unit_offset=False)

    def forward(self, x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden]: the residual stream after attention; `dense`: the layer's
        MLP output. Returns what the layer's `post_feedforward_layernorm` norms."""
        weights, expert_ids = self.router(x)
        routed = experts_grouped(self.pre_feedforward_layernorm_2(x), self.experts.gate_up_proj,
                                 self.experts.down_proj, weights, expert_ids)
        return self.post_feedforward_layernorm_1(dense) + self.post_feedforward_layernorm_2(routed)
