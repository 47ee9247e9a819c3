"""Qwen3.5 text models (transformers `qwen3_5_text`, `Qwen3_5ForCausalLM`): hybrid layers.

Rules (transformers' `modeling_qwen3_5.py` is the truth; fp32 on the CPU matches it to rounding):
- `layer_types`: each layer is `linear_attention` (a Gated DeltaNet, `kernels/delta_rule.py`) or
  `full_attention` (every fourth by default); both are followed by the same gated SiLU MLP, with
  pre-norms and residual adds as Llama's.
- RMSNorms (input, post-attention, final, q/k per head) scale by (1 + w) in fp32, then cast
  (Gemma's `GemmaRMSNorm`); the DeltaNet's output norm is a plain-w gated RMSNorm.
- Full attention: q_proj yields, per head, the query and then a gate of the same size; q and k
  are normed per head; RoPE rotates the first `partial_rotary_factor` of each head (text
  positions are one axis: the multimodal sections all see the same position); the attention
  output is multiplied by sigmoid(gate) before o_proj. Only these layers have KV: the engine's
  pool holds `num_kv_layers` layers.
- Gated DeltaNet: in_proj_qkv -> causal depthwise conv + SiLU -> q, k, v heads; in_proj_a / _b
  -> decay and write gates; the delta rule over a per-request state; gated RMSNorm with
  in_proj_z; out_proj. Its state lives in two pools beside the KV cache, one row ("slot") per
  running request: `state` [linear layers, slots, v heads, k dim, v dim] in fp32 and
  `conv_state` [linear layers, slots, conv dim, kernel - 1] in the model dtype. The runner
  assigns a request its slot and zeroes it before the request's first token (`reset_state`),
  which is also what a recompute after preemption needs.

Speculative decoding (chains, n-gram or a non-hybrid draft model) keeps every verified
position's state and commits the one after the last accepted token (`hybrid_verify.py`).
What the engine does not run for this family (refused at startup, `check_engine_support`):
draft trees (a state per branch), speculative prefill, swap preemption and bounded KV residency
(they move KV only, not the state), pipeline stages. Prefix caching is off for these models:
a cached prefix's KV would come without the state after it (state snapshots per block are not
built). On GPUs the DeltaNet's decode step is three Triton launches
(`kernels/delta_rule_triton.py`: conv + gates, the delta rule, the gated norm), its prefill's
delta rule two launches for the varlen batch (`kernels/delta_rule_prefill_triton.py`, chunked;
the causal conv stays the torch reference); a full-attention layer's norms, partial RoPE and KV
write are one launch (`kernels/gated_qkv_triton.py`), every (1 + w) norm one launch with the
residual add before it; decode steps replay CUDA graphs, prefill and verify steps run eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import kernels
from ..kernels import delta_rule
from . import hybrid_verify
from .gemma import GemmaRMSNorm
from .linear import Linear
from .llama import MLP, AttnMetadata, LlamaConfig, LlamaForCausalLM

# the released checkpoints are the multimodal wrapper: its text model is served, text only
ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
# weights the text model does not use: the vision tower, multi-token-prediction layers
_SKIPPED = ("model.visual.", "visual.", "mtp.", "model.mtp.")
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen35Config(LlamaConfig):
    layer_types: tuple[str, ...]
    rotary_dim: int
    linear_num_k_heads: int
    linear_num_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_kernel: int
    # v heads in llama.cpp's GGUF order (cycling over the k heads) instead of HF's grouped one
    linear_v_tiled: bool = False

    @property
    def num_kv_layers(self) -> int:
        return self.layer_types.count("full_attention")

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count("linear_attention")

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_k_heads * self.linear_k_dim + \
            self.linear_num_v_heads * self.linear_v_dim

    @classmethod
    def from_hf(cls, c: dict) -> "Qwen35Config":
        if "text_config" in c:  # Qwen3_5ForConditionalGeneration: the text model's config
            text = dict(c["text_config"])
            text["tie_word_embeddings"] = c.get("tie_word_embeddings",
                                                text.get("tie_word_embeddings", False))
            c = text
        for field in ("attention_bias",):
            if c.get(field):
                raise ValueError(f"Qwen3.5 with {field}={c[field]!r} is not supported")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen3.5 with hidden_act {c['hidden_act']!r} is not supported")
        num_layers = c["num_hidden_layers"]
        interval = c.get("full_attention_interval", 4)
        types = tuple(c.get("layer_types") or [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(num_layers)])
        if len(types) != num_layers or set(types) - set(LAYER_TYPES):
            raise ValueError(f"Qwen3.5 layer_types {list(types)} is not one of {LAYER_TYPES} "
                             "per layer")
        rope = dict(c.get("rope_parameters") or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"Qwen3.5 with rope {rope} is not supported (default RoPE only)")
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
        rotary_dim = int(head_dim * factor)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"Qwen3.5 rotary dims {rotary_dim} of head_dim {head_dim}: not an "
                             "even number within the head")
        k_heads, v_heads = c.get("linear_num_key_heads", 16), c.get("linear_num_value_heads", 32)
        if v_heads % k_heads:
            raise ValueError(f"Qwen3.5 linear attention with {v_heads} value heads over "
                             f"{k_heads} key heads: not a whole group per key head")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c.get("intermediate_size") or 0,  # 0: every MLP sparse (MoE)
            num_layers=num_layers, num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta") or c.get("rope_theta") or 10_000_000.0,
            rope_scaling=None, max_position_embeddings=c.get("max_position_embeddings", 32768),
            tie_word_embeddings=c.get("tie_word_embeddings", False), qk_norm=True,
            sliding_window=None, layer_types=types, rotary_dim=rotary_dim,
            linear_num_k_heads=k_heads, linear_num_v_heads=v_heads,
            linear_k_dim=c.get("linear_key_head_dim", 128),
            linear_v_dim=c.get("linear_value_head_dim", 128),
            conv_kernel=c.get("linear_conv_kernel_dim", 4),
            linear_v_tiled=c.get("linear_v_head_order", "grouped") == "tiled")


def partial_rope(x: torch.Tensor, cs: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x [n, heads, head_dim] with its first `rotary_dim` rotated by cs [n, rotary_dim] (cos |
    sin at each token's position), in fp32, the rest unchanged; x's dtype."""
    half = rotary_dim // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = x[..., :half].float(), x[..., half:rotary_dim].float()
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q_proj's rows are per head [query | gate]: 2 * q_size of them
        self.qkv_proj = Linear(cfg.hidden_size, [2 * self.q_size, self.kv_size, self.kv_size])
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary_dim = cfg.rotary_dim

    def forward(self, positions, x, kv_cache, meta: AttnMetadata, cos_sin):
        n, hd = x.shape[0], self.head_dim
        k_cache, v_cache = kv_cache
        qkv = self.qkv_proj(x)
        qg, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.reshape(n, self.num_heads, 2 * hd)
        if kernels.use_triton(x):  # norms, rotary and the KV write: one launch
            from ..kernels.gated_qkv_triton import gated_qkv_rope_cache
            q = gated_qkv_rope_cache(qkv, positions, cos_sin, k_cache, v_cache,
                                     meta.slot_mapping, self.num_heads, self.num_kv_heads,
                                     self.rotary_dim, self.q_norm.weight, self.k_norm.weight,
                                     self.q_norm.eps)
        else:
            cs = cos_sin.index_select(0, positions)
            q = partial_rope(self.q_norm(qg[..., :hd]), cs, self.rotary_dim).contiguous()
            k = partial_rope(self.k_norm(k.reshape(n, self.num_kv_heads, hd)), cs,
                             self.rotary_dim)
            kernels.write_kv(k.contiguous(), v.reshape(n, self.num_kv_heads, hd).contiguous(),
                             k_cache, v_cache, meta.slot_mapping)
        o = kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, meta.max_query_len, meta.max_seq_len,
                                    hd ** -0.5)
        gated = o.reshape(n, self.num_heads, hd) * torch.sigmoid(qg[..., hd:])
        return self.o_proj(gated.reshape(n, self.q_size))


class _Conv(nn.Module):
    """The depthwise causal conv's weight, [conv_dim, 1, kernel] as the checkpoint stores it."""

    def __init__(self, conv_dim: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(conv_dim, 1, kernel), requires_grad=False)


class _GatedNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.k_heads, self.v_heads = cfg.linear_num_k_heads, cfg.linear_num_v_heads
        self.k_dim, self.v_dim = cfg.linear_k_dim, cfg.linear_v_dim
        self.key_size = self.k_heads * self.k_dim
        self.value_size = self.v_heads * self.v_dim
        # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: one GEMM
        self.in_proj = Linear(cfg.hidden_size, [cfg.conv_dim, self.value_size, self.v_heads,
                                                self.v_heads])
        self.conv1d = _Conv(cfg.conv_dim, cfg.conv_kernel)
        self.A_log = nn.Parameter(torch.empty(self.v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads), requires_grad=False)
        self.norm = _GatedNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_size, cfg.hidden_size)
        self.sizes = [cfg.conv_dim, self.value_size, self.v_heads, self.v_heads]
        self.tiled = cfg.linear_v_tiled

    def forward(self, x, meta: AttnMetadata, state: torch.Tensor, conv_state: torch.Tensor):
        """x [num_tokens, hidden]; `state` / `conv_state`: this layer's pools, rows
        `meta.state_slots` read and updated (a speculative verify step's verifying rows:
        `hybrid_verify`)."""
        if meta.kept is not None:
            return hybrid_verify.forward_keeping(self, x, meta, state, conv_state)
        mixed, z, b, a = self.in_proj(x).split(self.sizes, dim=-1)
        if meta.max_query_len == 1:
            return self.output(self.recurrent_step(mixed, b, a, state, conv_state,
                                                   meta.state_slots), z)
        slots = meta.state_slots
        mixed = delta_rule.causal_conv1d_varlen(mixed, conv_state, self.conv1d.weight[:, 0],
                                                meta.query_start_loc, slots)
        q, k, v = self._heads(mixed)
        g, beta = delta_rule.gdn_gates(a, b, self.A_log, self.dt_bias)
        if kernels.use_triton(x):  # the whole varlen batch at once
            from ..kernels.delta_rule_prefill_triton import gdn_prefill
            o = gdn_prefill(q, k, v, g, beta, state, meta.query_start_loc, slots,
                            tiled=self.tiled)
        else:
            o = delta_rule.gated_delta_rule_chunked(q, k, v, g, beta, state,
                                                    meta.query_start_loc, slots, tiled=self.tiled)
        return self.output(o, z)

    def _heads(self, mixed):
        n = mixed.shape[0]
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        return (q.reshape(n, self.k_heads, self.k_dim), k.reshape(n, self.k_heads, self.k_dim),
                v.reshape(n, self.v_heads, self.v_dim))

    def recurrent_step(self, mixed, b, a, state, conv_state, slots):
        """One token per sequence (in_proj's conv part `mixed`, gates' b, a): the conv and the
        delta rule continuing rows `slots`, updated in place. Returns o [n, v heads, v dim].
        On GPUs two launches: conv + gates, then the delta rule."""
        weight = self.conv1d.weight[:, 0]
        if kernels.use_triton(mixed):
            from ..kernels.delta_rule_triton import conv_gates_decode, gdn_decode
            mixed, g, beta = conv_gates_decode(mixed, conv_state, weight, a, b, self.A_log,
                                               self.dt_bias, slots)
            return gdn_decode(*self._heads(mixed), g, beta, state, slots, tiled=self.tiled)
        mixed = delta_rule.causal_conv1d_update(mixed, conv_state, weight, slots)
        g, beta = delta_rule.gdn_gates(a, b, self.A_log, self.dt_bias)
        return delta_rule.gated_delta_rule_recurrent(*self._heads(mixed), g, beta, state, slots,
                                                     tiled=self.tiled)

    def output(self, o, z):
        """The gated RMSNorm (gate `z`) and out_proj of the delta rule's output o."""
        n = o.shape[0]
        z = z.reshape(n, self.v_heads, self.v_dim)
        if kernels.use_triton(o):
            from ..kernels.delta_rule_triton import gated_rms_norm
            o = gated_rms_norm(o, z, self.norm.weight, self.norm.eps)
        else:
            o = delta_rule.gated_rms_norm(o, z, self.norm.weight, self.norm.eps)
        return self.out_proj(o.reshape(n, self.value_size))


class Qwen35DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen35Config, layer_type: str):
        super().__init__()
        self.linear = layer_type == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Loading, tied embeddings and weight accounting are `LlamaForCausalLM`'s; the layers,
    norms, RoPE and the DeltaNet state pools are Qwen3.5's."""

    family = "Qwen3.5"
    has_state = True  # the runner assigns state slots (`allocate_state`, `reset_state`)
    tree_span = False  # its attention takes no `AttnMetadata.tree_span`
    STACKED = {**LlamaForCausalLM.STACKED, "in_proj_qkv": ("in_proj", 0),
               "in_proj_z": ("in_proj", 1), "in_proj_b": ("in_proj", 2),
               "in_proj_a": ("in_proj", 3)}

    def __init__(self, cfg: Qwen35Config):
        super().__init__(cfg, bias=False)
        self.layers = nn.ModuleList(Qwen35DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cos_sin = rope_cache(cfg)
        # per layer: its index among the KV layers or among the linear layers
        kinds = [t == "full_attention" for t in cfg.layer_types]
        self.pool_index = [sum(k == kinds[i] for k in kinds[:i]) for i in range(len(kinds))]
        self.state = self.conv_state = None
        self.requires_grad_(False)

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        cfg = self.cfg
        per_layer = cfg.linear_num_v_heads * cfg.linear_k_dim * cfg.linear_v_dim * 4 + \
            cfg.conv_dim * (cfg.conv_kernel - 1) * torch.tensor([], dtype=dtype).element_size()
        return cfg.num_linear_layers * per_layer

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        """Zeroed state pools for `num_slots` requests."""
        cfg = self.cfg
        n = cfg.num_linear_layers
        self.state = torch.zeros((n, num_slots, cfg.linear_num_v_heads, cfg.linear_k_dim,
                                  cfg.linear_v_dim), dtype=torch.float32, device=device)
        self.conv_state = torch.zeros((n, num_slots, cfg.conv_dim, cfg.conv_kernel - 1),
                                      dtype=dtype, device=device)

    def reset_state(self, slots: torch.Tensor) -> None:
        """Zeroes the state rows `slots` (a request's first token: "no past")."""
        self.state[:, slots] = 0
        self.conv_state[:, slots] = 0

    def forward(self, input_ids, positions, kv_caches, meta: AttnMetadata,
                layer_range: tuple[int, int] | None = None, hidden=None, probe=None):
        """[num_tokens, hidden] after the final norm. All layers in one call: no stages."""
        if probe is not None:
            raise ValueError("Qwen3.5 runs no per-layer probe (speculative prefill, KV "
                             "residency scoring)")
        if layer_range not in (None, (0, len(self.layers))):
            raise ValueError("Qwen3.5 does not run as pipeline stages")
        if meta.state_slots is None:
            raise ValueError("a Qwen3.5 forward needs the batch's state slots")
        h, x = self.embed_tokens(input_ids), None  # x: the residual stream
        for layer, j in zip(self.layers, self.pool_index):
            # each residual add rides in the norm after it (one launch on GPUs)
            h, x = layer.input_layernorm(h, x) if x is not None else \
                (layer.input_layernorm(h), h)
            if layer.linear:
                h = layer.linear_attn(h, meta, self.state[j], self.conv_state[j])
            else:
                h = layer.self_attn(positions, h, kv_caches[j], meta, self.cos_sin)
            h, x = layer.post_attention_layernorm(h, x)
            h = layer.mlp(h)
        return self.norm(h, x)[0]

    def load_weights(self, weights, dtype: torch.dtype | None = None,
                     device: torch.device | str = "cpu", quantize: str | None = None,
                     **kwargs) -> None:
        """`LlamaForCausalLM.load_weights` of the text model's weights (a multimodal
        checkpoint's `model.language_model.*`; its vision tower and MTP layers are skipped);
        the partial RoPE cache is then built on `device`."""
        super().load_weights(_text_weights(weights), dtype, device, quantize, **kwargs)
        self.cos_sin = rope_cache(self.cfg).to(device)


def _text_weights(weights):
    for name, tensor in weights:
        if name.startswith(_SKIPPED):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        yield name, tensor


def rope_cache(cfg: Qwen35Config) -> torch.Tensor:
    from ..kernels.rotary import build_cos_sin_cache
    return build_cos_sin_cache(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta)


def check_engine_support(args) -> None:
    """Raises ValueError for an engine feature the hybrid layers' state cannot follow."""
    refused = {"--spec-tree-budget (tree speculation)": args.speculative_method and
               args.spec_tree_budget,
               "--spec-prefill-keep (speculative prefill)": args.spec_prefill_keep is not None,
               "--preemption-mode swap": args.preemption_mode == "swap",
               "--kv-resident-tokens (bounded KV residency)": args.kv_resident_tokens,
               "--devices (pipeline stages)": args.devices}
    for what, on in refused.items():
        if on:
            raise ValueError(f"{what} is not supported for Qwen3.5 (hybrid linear-attention) "
                             "models: the DeltaNet state is not kept per tree branch, moved or "
                             "split")
