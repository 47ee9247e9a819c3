"""Gemma 3 text models (transformers `gemma3_text`, `Gemma3ForCausalLM`).

Rules (transformers' `modeling_gemma3.py` is the truth; fp32 on the CPU matches it to rounding):
- RMSNorm scales by (1 + weight), in fp32, then casts: `(norm(x.float()) * (1 + w.float()))
  .to(x.dtype)`. Checkpoints (and the loader's HF names) carry w; the +1 is applied here.
- The token embedding is multiplied by sqrt(hidden_size) rounded to the model dtype.
- Each layer: input norm -> attention -> post-attention norm -> + residual; pre-feedforward
  norm -> gated MLP (gelu tanh) -> post-feedforward norm -> + residual. q and k are RMS-normed
  per head before RoPE; attention scales scores by query_pre_attn_scalar ** -0.5.
- `layer_types` (or the older `sliding_window_pattern`: every n-th layer global) makes a layer
  local (sliding window of `sliding_window` keys, RoPE base `rope_local_base_freq`, no
  scaling) or global (full causal attention, `rope_theta` with the config's rope scaling). The
  window masks keys; every layer keeps all of its KV, so the context is not cut at the window.
- `final_logit_softcapping`: logits = cap * tanh(logits / cap). `attn_logit_softcapping` is
  refused: transformers' Gemma 3 accepts the field but never applies it (nor does llama.cpp),
  so a config that sets it has no one meaning. So are bidirectional attention, attention
  biases and activations other than gelu_pytorch_tanh.
- No per-layer probe (speculative prefill, KV residency scoring) and no pipeline stages: the
  engine refuses those features for this family (`check_engine_support`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..kernels.rotary import build_cos_sin_cache
from .linear import Linear
from .llama import AttnMetadata, LlamaConfig, LlamaForCausalLM

ARCHITECTURES = ("Gemma3ForCausalLM",)


@dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    query_pre_attn_scalar: float
    layer_windows: tuple[int, ...]  # per layer: its sliding window, 0 for a global layer
    rope_local_theta: float
    final_logit_softcapping: float | None

    @classmethod
    def from_hf(cls, c: dict, family: str = "Gemma 3") -> "Gemma3Config":
        """`family` names the model in the refusals (Gemma 4 reads its shared fields here)."""
        for field in ("attn_logit_softcapping", "use_bidirectional_attention", "attention_bias"):
            if c.get(field):
                raise ValueError(f"{family} with {field}={c[field]!r} is not supported")
        act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"{family} with hidden_activation {act!r} is not supported "
                             "(gelu_pytorch_tanh only)")
        num_layers = c["num_hidden_layers"]
        types = c.get("layer_types") or [
            "full_attention" if (i + 1) % c.get("sliding_window_pattern", 6) == 0
            else "sliding_attention" for i in range(num_layers)]
        if len(types) != num_layers or set(types) - {"full_attention", "sliding_attention"}:
            raise ValueError(f"{family} layer_types {types} is not one full_attention or "
                             "sliding_attention per layer")
        window = c.get("sliding_window") or 0
        if window <= 0 and "sliding_attention" in types:
            raise ValueError(f"{family} has sliding_attention layers but no sliding_window")
        rope = c.get("rope_parameters") or {}
        full = dict(rope.get("full_attention") or c.get("rope_scaling") or {})
        local = dict(rope.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{family} local layers with rope {local} are not supported")
        theta = full.pop("rope_theta", None) or c.get("rope_theta") or 1_000_000.0
        scaling = full if full.get("rope_type", full.get("type", "default")) != "default" \
            else None
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_layers=num_layers, num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=c.get("max_position_embeddings", 131072),
            tie_word_embeddings=c.get("tie_word_embeddings", True), qk_norm=True,
            sliding_window=None,  # no window over the whole model: see layer_windows
            query_pre_attn_scalar=c.get("query_pre_attn_scalar", head_dim),
            layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
            rope_local_theta=local.get("rope_theta") or c.get("rope_local_base_freq", 10000.0),
            final_logit_softcapping=c.get("final_logit_softcapping"))


class GemmaRMSNorm(nn.Module):
    """Gemma 3 scales by 1 + w (`unit_offset`), Gemma 4 by w; `scaled=False`: no weight at all
    (Gemma 4's value norm)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = True, scaled: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False) if scaled else None
        self.offset = 1.0 if unit_offset else 0.0
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`kernels.gemma_rms_norm`: the normed x, or (normed x + residual, x + residual)."""
        return kernels.gemma_rms_norm(x, self.weight, self.eps, self.offset, residual)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: Gemma3Config, window: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size])
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.window = window

    def forward(self, positions, x, kv_cache, meta: AttnMetadata, cos_sin):
        n = x.shape[0]
        k_cache, v_cache = kv_cache
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Gemma's (1 + w) per-head norms here; RoPE and the cache writes in one launch
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim)).reshape(n, -1)
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)).reshape(n, -1)
        q = kernels.qkv_rope_cache(torch.cat([q, k, v], dim=-1), positions, cos_sin, k_cache,
                                   v_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads)
        o = kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, meta.max_query_len, meta.max_seq_len,
                                    self.scale, tree_mask=meta.tree_mask, window=self.window,
                                    positions=positions)
        return self.o_proj(o.reshape(n, self.q_size))


class GemmaMLP(nn.Module):
    def __init__(self, cfg: Gemma3Config, intermediate_size: int | None = None):
        super().__init__()
        self.inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [self.inter] * 2)
        self.down_proj = Linear(self.inter, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, self_attn: nn.Module, mlp: nn.Module,
                 unit_offset: bool = True):
        super().__init__()
        self.window = self_attn.window
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps, unit_offset)
        self.self_attn = self_attn
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps, unit_offset)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps, unit_offset)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps, unit_offset)

    def forward(self, positions, x, kv_cache, meta, cos_sin):
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, cos_sin)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Loading, tied embeddings and weight accounting are `LlamaForCausalLM`'s (same HF names);
    the layers, norms, embedding scale, RoPE per layer type and logits are Gemma's."""

    family = "Gemma 3"
    norm_unit_offset = True  # RMSNorm scales by 1 + w
    tree_span = False  # its attention takes no `AttnMetadata.tree_span`

    def __init__(self, cfg: Gemma3Config):
        super().__init__(cfg, bias=False)
        self.layers = self._make_layers(cfg)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_unit_offset)
        self.register_buffer("cos_sin_local", self._local_rope(), persistent=False)
        self.requires_grad_(False)

    def _local_rope(self) -> torch.Tensor:
        cfg = self.cfg
        return build_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings,
                                   cfg.rope_local_theta)

    def _make_layers(self, cfg: Gemma3Config) -> nn.ModuleList:
        return nn.ModuleList(GemmaDecoderLayer(cfg, GemmaAttention(cfg, w), GemmaMLP(cfg))
                             for w in cfg.layer_windows)

    def forward(self, input_ids, positions, kv_caches, meta: AttnMetadata,
                layer_range: tuple[int, int] | None = None, hidden=None, probe=None):
        """[num_tokens, hidden] after the final norm. All layers in one call: no stages."""
        self._check_whole_forward(layer_range, probe)
        x = self._embed(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, kv_caches[i], meta,
                      self.cos_sin_local if layer.window else self.cos_sin)
        return self.norm(x)

    def _check_whole_forward(self, layer_range, probe) -> None:
        if probe is not None:
            raise ValueError(f"{self.family} runs no per-layer probe (speculative prefill, KV "
                             "residency scoring)")
        if layer_range not in (None, (0, len(self.layers))):
            raise ValueError(f"{self.family} does not run as pipeline stages")

    def _embed(self, input_ids) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the model dtype first, as transformers does
        return x * torch.tensor(self.cfg.hidden_size ** 0.5).to(x.dtype).item()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_weights(self, weights, dtype: torch.dtype | None = None,
                     device: torch.device | str = "cpu", quantize: str | None = None,
                     **kwargs) -> None:
        """`LlamaForCausalLM.load_weights`; the local layers' RoPE cache is then built on
        `device` (fp32, like the global one)."""
        super().load_weights(weights, dtype, device, quantize, **kwargs)
        self.cos_sin_local = self._local_rope().to(device)


def check_engine_support(args, family: str = "Gemma 3") -> None:
    """Raises ValueError for an engine feature this family cannot run exactly: bounded KV
    residency and speculative prefill read per-layer queries and drop positions from the
    cache (a window counted in cache slots would be wrong), and stages cut the forward."""
    refused = {"--kv-resident-tokens (bounded KV residency)": args.kv_resident_tokens,
               "--spec-prefill-keep (speculative prefill)": args.spec_prefill_keep is not None,
               "--devices (pipeline stages)": args.devices}
    for what, on in refused.items():
        if on:
            raise ValueError(f"{what} is not supported for {family} models")
