"""Gemma 4 text models (transformers `gemma4_text`, `Gemma4ForCausalLM`).

Rules (transformers' `modeling_gemma4.py` is the truth; fp32 on the CPU matches it to rounding).
What is Gemma 3's (`gemma.py`) stays there: the embedding scale, the four norms around attention
and MLP, the gelu-tanh gated MLP, per-head q/k norms, sliding windows by `layer_types` (the last
layer is always global), final logit soft-capping. Where Gemma 4 differs:
- RMSNorm scales by w, not 1 + w. Values are RMS-normed per head too, with no weight.
- Attention scores are not scaled (scale 1: the q/k norms set their size).
- Global layers take RoPE "proportional": only the first `partial_rotary_factor` of each head's
  frequency pairs rotate, the rest have frequency 0; local layers plain RoPE at their own base.
- `attention_k_eq_v`: global layers have no v_proj; the values are the key projection (before
  the key norm and RoPE) through the value norm.
- `num_kv_shared_layers`: the last layers have no k/v projections; each reads the KV cache of the
  last earlier layer of its type (same window, same shape), and writes none. Their own cache
  blocks stay allocated and unused. `use_double_wide_mlp` doubles those layers' MLP.
- Per-layer inputs (`hidden_size_per_layer_input` > 0): a second embedding table gives every
  token a [num_layers, per_layer] vector, averaged (times 2 ** -0.5) with a normed projection of
  the scaled token embedding; after its MLP, layer i adds
  norm(proj(gelu(gate(x)) * per_layer_input[i])).
- Every layer ends by multiplying its output by a loaded scalar (`layer_scalar`).
- Global layers may have another head size (`global_head_dim`, 512 by default, as released)
  and, with keys as values, another KV head count (`num_global_key_value_heads`); the engine
  then keeps one KV cache tensor per layer in that layer's shape (`kv_layer_shapes`), all
  indexed by the same block ids.
- Mixture-of-experts layers (`enable_moe_block`: every layer) add a routed block beside the
  dense MLP: `gemma4_moe.py`.
Refused (ValueError): rope types other than default, linear and proportional, and what Gemma 3
refuses (`Gemma3Config.from_hf`). The engine features Gemma 3 refuses
(`gemma.check_engine_support`) are refused here too, with per-layer KV shapes swap preemption
(its host copies assume one shape), and with mixture-of-experts layers `--quantization
int8|int4` and expert offload (`--expert-memory`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .gemma import Gemma3Config, Gemma3ForCausalLM, GemmaDecoderLayer, GemmaMLP, GemmaRMSNorm
from .gemma4_moe import Gemma4MoeBlock, block_name, moe_fields
from .linear import Linear
from .llama import AttnMetadata

ARCHITECTURES = ("Gemma4ForCausalLM",)
_GLOBAL_ROPES = ("default", "linear", "proportional")


@dataclass(frozen=True)
class Gemma4Config(Gemma3Config):
    rope_partial_factor: float  # global layers: the share of frequency pairs that rotate
    rope_factor: float  # global layers: the frequencies are divided by it
    layer_kv_source: tuple[int, ...]  # per layer: the layer whose KV cache it reads
    layer_k_eq_v: tuple[bool, ...]  # per layer: values are the key projection
    layer_intermediate: tuple[int, ...]  # per layer: its MLP width
    per_layer_input_size: int  # 0: no per-layer inputs
    per_layer_vocab_size: int
    layer_head_dim: tuple[int, ...] = ()  # per layer: head size (global layers' may differ)
    layer_kv_heads: tuple[int, ...] = ()  # per layer: KV heads
    num_experts: int = 0  # > 0: every layer has a mixture-of-experts block (`gemma4_moe.py`)
    top_k_experts: int = 0
    moe_intermediate_size: int = 0

    @property
    def kv_layer_shapes(self) -> tuple[tuple[int, int], ...] | None:
        """Per layer (KV heads, head size) when they differ between layers, else None."""
        shapes = tuple(zip(self.layer_kv_heads, self.layer_head_dim))
        return shapes if len(set(shapes)) > 1 else None

    @property
    def global_head_dim(self) -> int:
        """The head size of the global layers (the RoPE of `global_rope`)."""
        return next((d for d, w in zip(self.layer_head_dim, self.layer_windows) if not w),
                    self.head_dim)

    @classmethod
    def from_hf(cls, c: dict, family: str = "Gemma 4") -> "Gemma4Config":
        num_layers = c["num_hidden_layers"]
        types = list(c.get("layer_types") or [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)])
        types[-1] = "full_attention"  # as transformers forces
        head_dim, num_kv_heads, per_layer = _attention_shape(c, types)
        rope = c.get("rope_parameters") or {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1_000_000.0}}
        full = rope.get("full_attention") or {}
        rope_type = full.get("rope_type", "default")
        if rope_type not in _GLOBAL_ROPES or (rope_type != "proportional" and
                                              full.get("partial_rotary_factor", 1.0) != 1.0):
            raise ValueError(f"Gemma 4 global layers with rope {full} are not supported "
                             f"({', '.join(_GLOBAL_ROPES)}; partial only when proportional)")
        bidirectional = c.get("use_bidirectional_attention")
        base = Gemma3Config.from_hf(
            {**c, "layer_types": types, "rope_parameters": rope, "head_dim": head_dim,
             "num_key_value_heads": num_kv_heads, "query_pre_attn_scalar": 1.0,
             "sliding_window": c.get("sliding_window", 512),
             # "vision": vision tokens see each other, which text alone never meets
             "use_bidirectional_attention": None if bidirectional == "vision" else bidirectional,
             "tie_word_embeddings": c.get("tie_word_embeddings", True)}, family)
        sources = _kv_sources(types, c.get("num_kv_shared_layers") or 0)
        wide = 2 if c.get("use_double_wide_mlp") else 1
        return cls(**{f.name: getattr(base, f.name) for f in fields(Gemma3Config)} | dict(
            rope_scaling=None,  # the global RoPE is `global_rope`'s, from the fields below
            rope_partial_factor=full.get("partial_rotary_factor", 1.0),
            rope_factor=full.get("factor", 1.0) if rope_type != "default" else 1.0,
            layer_kv_source=sources,
            layer_k_eq_v=tuple(bool(c.get("attention_k_eq_v")) and t == "full_attention"
                               for t in types),
            layer_intermediate=tuple(c["intermediate_size"] * (wide if s != i else 1)
                                     for i, s in enumerate(sources)),
            per_layer_input_size=c.get("hidden_size_per_layer_input", 256) or 0,
            per_layer_vocab_size=c.get("vocab_size_per_layer_input", 262_144),
            layer_head_dim=tuple(d for _, d in per_layer),
            layer_kv_heads=tuple(h for h, _ in per_layer), **moe_fields(c)))


def _attention_shape(c: dict, types: list[str]) -> tuple[int, int, list[tuple[int, int]]]:
    """(head_dim, num_kv_heads) of the local layers, and (num_kv_heads, head_dim) of every
    layer: the global layers' from `per_layer_config` as transformers saves it, or from the
    released configs' `global_head_dim` / `num_global_key_value_heads` (transformers'
    defaults: 512, and the local count unless keys are values)."""
    shape = {"head_dim": c.get("head_dim", 256),
             "num_key_value_heads": c.get("num_key_value_heads", 4)}
    if "per_layer_config" in c:
        overrides = {int(i): o for i, o in (c["per_layer_config"] or {}).items()}
    else:
        override = {"head_dim": c.get("global_head_dim", 512)}
        if c.get("attention_k_eq_v") and c.get("num_global_key_value_heads") is not None:
            override["num_key_value_heads"] = c["num_global_key_value_heads"]
        overrides = {i: override for i, t in enumerate(types) if t == "full_attention"}
    per_layer = []
    for i in range(len(types)):
        s = {**shape, **overrides.get(i, {})}
        per_layer.append((s["num_key_value_heads"], s["head_dim"]))
    return shape["head_dim"], shape["num_key_value_heads"], per_layer


def _kv_sources(types: list[str], num_shared: int) -> tuple[int, ...]:
    """Per layer, the layer whose KV it attends to: itself, or for the last `num_shared` layers
    the last earlier unshared layer of its type (transformers' `kv_sharing_modes`)."""
    first_shared = len(types) - num_shared
    producers = {t: i for i, t in enumerate(types[:first_shared])}
    if num_shared and set(producers) != set(types):
        raise ValueError(f"Gemma 4 with num_kv_shared_layers={num_shared}: the shared layers' "
                         f"types {sorted(set(types))} are not all among the unshared layers'")
    return tuple(i if i < first_shared else producers[t] for i, t in enumerate(types))


def global_rope(cfg: Gemma4Config) -> torch.Tensor:
    """[max_positions, head_dim] fp32 cos | sin of the global layers' RoPE, computed as
    transformers' "proportional" RoPE (default and linear are its special cases)."""
    head_dim = cfg.global_head_dim
    rotated = int(cfg.rope_partial_factor * head_dim // 2)
    inv_freq = 1.0 / (cfg.rope_theta ** (
        torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = torch.cat([inv_freq, torch.zeros(head_dim // 2 - rotated)]) / cfg.rope_factor
    freqs = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: Gemma4Config, layer: int):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads, self.head_dim = cfg.layer_kv_heads[layer], cfg.layer_head_dim[layer]
        self.window = cfg.layer_windows[layer]
        self.kv_source = cfg.layer_kv_source[layer]
        self.shares_kv = self.kv_source != layer
        self.k_eq_v = cfg.layer_k_eq_v[layer]
        self.q_size = cfg.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        sizes = [self.q_size] if self.shares_kv else \
            [self.q_size, kv_size] if self.k_eq_v else [self.q_size, kv_size, kv_size]
        self.qkv_proj = Linear(cfg.hidden_size, sizes)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=False)
        if not self.shares_kv:
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=False)
            self.v_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, scaled=False)

    def forward(self, positions, x, kv_cache, meta: AttnMetadata, cos_sin):
        """`kv_cache`: the cache of layer `kv_source` (this layer's own unless it shares)."""
        n = x.shape[0]
        k_cache, v_cache = kv_cache
        parts = self.qkv_proj(x).split(self.qkv_proj.out_sizes, dim=-1)
        q = self.q_norm(parts[0].reshape(n, self.num_heads, self.head_dim))
        if self.shares_kv:
            # the rotary kernel turns q and k together: a throwaway copy of a head stands in
            q = q.contiguous()
            kernels.rotary(positions, q, q[:, :1].clone(), cos_sin)
        else:
            k = parts[1].reshape(n, self.num_kv_heads, self.head_dim)
            v = self.v_norm(k if self.k_eq_v else parts[2].reshape(n, self.num_kv_heads,
                                                                    self.head_dim))
            qkv = torch.cat([q.reshape(n, -1), self.k_norm(k).reshape(n, -1),
                             v.reshape(n, -1)], dim=-1)
            q = kernels.qkv_rope_cache(qkv, positions, cos_sin, k_cache, v_cache,
                                       meta.slot_mapping, self.num_heads, self.num_kv_heads)
        o = kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, meta.max_query_len, meta.max_seq_len,
                                    1.0, tree_mask=meta.tree_mask, window=self.window,
                                    positions=positions)
        return self.o_proj(o.reshape(n, self.q_size))


class Gemma4DecoderLayer(GemmaDecoderLayer):
    """Gemma 3's layer on Gemma 4's attention and norms, the MLP's output joined by the
    mixture-of-experts block's (when the model has them) before the post-feedforward norm,
    then the per-layer input (when the model has them) and the layer's scalar."""

    def __init__(self, cfg: Gemma4Config, layer: int):
        super().__init__(cfg, Gemma4Attention(cfg, layer),
                         GemmaMLP(cfg, cfg.layer_intermediate[layer]), unit_offset=False)
        self.moe = Gemma4MoeBlock(cfg) if cfg.num_experts else None
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        if cfg.per_layer_input_size:
            self.per_layer_input_gate = Linear(cfg.hidden_size, cfg.per_layer_input_size)
            self.per_layer_projection = Linear(cfg.per_layer_input_size, cfg.hidden_size)
            self.post_per_layer_input_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                          unit_offset=False)

    def forward(self, positions, x, kv_cache, meta, cos_sin, per_layer_input=None):
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, cos_sin)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is not None:
            h = self.moe(x, h)
        x = x + self.post_feedforward_layernorm(h)
        if per_layer_input is not None:
            h = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        return x * self.layer_scalar


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 3's model (loading, embedding scale, local RoPE, logits) on Gemma 4's layers, the
    global layers' RoPE from `global_rope` (set by `build_model`), the per-layer inputs, and
    the mixture-of-experts blocks' weights under the checkpoint's names."""

    family = "Gemma 4"
    norm_unit_offset = False

    def __init__(self, cfg: Gemma4Config):
        super().__init__(cfg)
        size = cfg.per_layer_input_size
        if size:
            self.embed_tokens_per_layer = nn.Embedding(cfg.per_layer_vocab_size,
                                                       cfg.num_layers * size)
            self.per_layer_model_projection = Linear(cfg.hidden_size, cfg.num_layers * size)
            self.per_layer_projection_norm = GemmaRMSNorm(size, cfg.rms_norm_eps,
                                                          unit_offset=False)
        self.requires_grad_(False)

    def _make_layers(self, cfg: Gemma4Config) -> nn.ModuleList:
        return nn.ModuleList(Gemma4DecoderLayer(cfg, i) for i in range(cfg.num_layers))

    def _route_weights(self, weights, dtype: torch.dtype, device: torch.device):
        """The checkpoint's MoE weights renamed into the layers' `moe` blocks (`block_name`)."""
        return ((block_name(name), tensor)
                for name, tensor in super()._route_weights(weights, dtype, device))

    def load_weights(self, weights, dtype: torch.dtype | None = None,
                     device: torch.device | str = "cpu", quantize: str | None = None,
                     **kwargs) -> None:
        """`Gemma3ForCausalLM.load_weights`; refuses `quantize` (int8|int4) for a model with
        mixture-of-experts blocks, whose experts and router load dense only."""
        if quantize and self.cfg.num_experts:
            raise ValueError(f"--quantization {quantize}: Gemma 4 mixture-of-experts models "
                             "load dense for now")
        super().load_weights(weights, dtype, device, quantize, **kwargs)

    def forward(self, input_ids, positions, kv_caches, meta: AttnMetadata,
                layer_range: tuple[int, int] | None = None, hidden=None, probe=None):
        """[num_tokens, hidden] after the final norm. All layers in one call: no stages."""
        self._check_whole_forward(layer_range, probe)
        x = self._embed(input_ids)
        per_layer = self._per_layer_inputs(input_ids, x) if self.cfg.per_layer_input_size \
            else None
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, kv_caches[layer.self_attn.kv_source], meta,
                      self.cos_sin_local if layer.window else self.cos_sin,
                      per_layer[:, i] if per_layer is not None else None)
        return self.norm(x)

    def _per_layer_inputs(self, input_ids, x) -> torch.Tensor:
        """[num_tokens, num_layers, per_layer]: the per-layer table's rows (scaled by
        sqrt(per_layer) in the model dtype) and the normed projection of the scaled token
        embedding `x`, averaged times 2 ** -0.5 as transformers does."""
        cfg, n = self.cfg, x.shape[0]
        shape = (n, cfg.num_layers, cfg.per_layer_input_size)
        rows = F.embedding(input_ids, self.embed_tokens_per_layer.weight)
        rows = rows * torch.tensor(cfg.per_layer_input_size ** 0.5).to(rows.dtype)
        projected = self.per_layer_model_projection(x) * cfg.hidden_size ** -0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + rows.reshape(shape)) * 2.0 ** -0.5
