"""The Llama family: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

One flat varlen batch per step: `input_ids` and `positions` are [num_tokens]; attention reads
K/V from the paged cache through `AttnMetadata`. Q/K/V and gate/up projections are fused into
one GEMM each at load. `forward` can run a contiguous range of layers, so a model can later be
cut into pipeline stages."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import kernels
from ..kernels.rotary import build_cos_sin_cache
from .linear import Embedding, Linear


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3
    sliding_window: int | None

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep KV in the paged cache (all of them here; hybrid models fewer)."""
        return self.num_layers

    @property
    def kv_layer_shapes(self) -> tuple[tuple[int, int], ...] | None:
        """Per KV layer (KV heads, head size) where layers differ (Gemma 4), else None: one
        shape, `num_kv_heads` x `head_dim`, for every layer."""
        return None

    @classmethod
    def from_hf(cls, c: dict) -> "LlamaConfig":
        rope = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                            else None)
        arch = (c.get("architectures") or [""])[0]
        window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"],
            num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            qk_norm=arch.startswith("Qwen3") or c.get("model_type") == "qwen3",
            sliding_window=window)


@dataclass
class AttnMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, cached tokens after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    tree_mask: torch.Tensor | None = None  # int64 [num_tokens]: draft-tree verification
    state_slots: torch.Tensor | None = None  # int64 [num_seqs]: hybrid models' state rows
    kept: object = None  # hybrid models' verify step: `hybrid_verify.KeptStates`
    tree_span: int = 0  # keys the tree words cover, when more than the step's tokens


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x, residual=None, xqs: dict | None = None):
        """`xqs` (from the next layer's `Linear.int8_input`): also filled with the output's
        int8 forms, in the same launch."""
        if xqs:
            return kernels.rms_norm(x, self.weight, self.eps, residual, xqs=xqs)
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, bias: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        # the decode attention kernel can hand o_proj its input quantized: whole 32-groups a head
        self.attn_quantizes_o_input = (cfg.head_dim % 32 == 0 and
                                       not cfg.head_dim & (cfg.head_dim - 1))

    def forward(self, positions, x, kv_cache, meta: AttnMetadata, cos_sin, probe=None,
                xqs: dict | None = None, qkv: torch.Tensor | None = None,
                q: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                tail=None):
        """`qkv`: x's projection, made already (`kernels.rms_norm_linear`); `q`: made already
        with k and v in the cache (`kernels.rms_norm_qkv_rope_cache`). x is then None.
        `residual`: returns (output, residual) from `Linear.add_forward` (the residual add
        done in the o projection where it can be). `tail`: the norm after the o projection
        (`kernels.norm_tail`), done by its quantized GEMV where it can."""
        k_cache, v_cache = kv_cache
        if q is None:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) \
                if self.q_norm is not None else ()
            qkv = self.qkv_proj(x, xqs) if qkv is None else qkv
            # split into heads, q/k norm, RoPE, k and v into the cache: one launch on GPUs
            q = kernels.qkv_rope_cache(qkv, positions, cos_sin, k_cache,
                                       v_cache, meta.slot_mapping, self.num_heads,
                                       self.num_kv_heads, *norms)
        n = q.shape[0]
        if probe is not None:  # speculative prefill reads the attention of the last window
            probe(q, k_cache, meta, self.scale)
        o_xqs = self.o_proj.int8_input(n, q.device) \
            if self.attn_quantizes_o_input and meta.max_query_len == 1 and n == 1 else {}
        o = kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, meta.max_query_len, meta.max_seq_len,
                                    self.scale, tree_mask=meta.tree_mask,
                                    **({"xqs": o_xqs} if o_xqs else {}),
                                    **({"tree_span": meta.tree_span} if meta.tree_span else {}))
        if residual is not None and not o_xqs:
            return self.o_proj.add_forward(o.reshape(n, self.q_size), residual)
        o = self.o_proj(o.reshape(n, self.q_size), o_xqs, tail)
        return o if residual is None else (o, residual)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def int8_input(self, rows: int, device: torch.device) -> dict:
        """Buffers for the int8 forms of this MLP's input (`Linear.int8_input`), for the norm
        before it to fill."""
        return self.gate_up_proj.int8_input(rows, device)

    def forward(self, x, xqs: dict | None = None, gate_up: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, tail=None):
        """`gate_up`: x's projection, already made (the norm fused into it); x is then None.
        `residual`: returns (output, residual) from `Linear.add_forward`. `tail`: the next
        layer's input norm (`kernels.norm_tail`), done by the quantized down GEMV where it can.
        On quantized weights the SiLU is done by the gate/up GEMV where it can
        (`kernels.glu_tail`), else by a launch of its own that also quantizes for the down GEMV."""
        down_xqs = None
        if gate_up is None:
            down_xqs = self.down_proj.int8_input(x.shape[0], x.device)
            glu = kernels.glu_tail(x, self.down_proj.in_features, down_xqs)
            gate_up = self.gate_up_proj(x, xqs, glu)
            if glu is not None and glu.done:
                y = self.down_proj(glu.out, down_xqs, tail)
                return y if residual is None else (y, residual)
        if down_xqs is None:
            down_xqs = self.down_proj.int8_input(gate_up.shape[0], gate_up.device)
        if down_xqs:  # the activation also written in int8 for the down GEMV
            y = self.down_proj(kernels.silu_and_mul(gate_up, xqs=down_xqs), down_xqs, tail)
            return y if residual is None else (y, residual)
        if residual is not None:
            return self.down_proj.add_forward(gate_up, residual, glu=True)
        return self.down_proj.silu_and_mul_forward(gate_up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, bias: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, positions, x, residual, kv_cache, meta, cos_sin, probe=None,
                next_layer: "DecoderLayer | None" = None):
        # at a few rows on quantized weights the norms also write their output in int8 for the
        # GEMV after them (Linear.int8_input; {} otherwise), sparing it a launch; on dense
        # weights each norm is done in the loads of the projection after it, and RoPE and
        # the KV write in the QKV projection's epilogue (kernels.rms_norm_linear,
        # rms_norm_qkv_rope_cache: separate launches where the dense GEMV does not run), and
        # the residual add and the norm's sums of squares in the epilogue of the projection
        # before each norm (o, down), whose output is then a kernels.Summed (residual None)
        # On quantized weights the o and down GEMVs also add the residual and do the norm after
        # them where they can (kernels.norm_tail; the down GEMV for `next_layer`'s input norm):
        # the layer then gets and hands on a kernels.Normed
        rows = (x.h if isinstance(x, kernels.Summed) else
                x.out if isinstance(x, kernels.Normed) else x).shape[0]
        attn, mlp = self.self_attn, self.mlp
        mlp_xqs = None  # the MLP's int8 input buffers, once asked for
        if not attn.qkv_proj.quantized and attn.q_norm is None:  # + RoPE, KV write
            q, residual = kernels.rms_norm_qkv_rope_cache(
                x, self.input_layernorm.weight, self.input_layernorm.eps, residual,
                attn.qkv_proj.weight, attn.qkv_proj.bias, positions, cos_sin, kv_cache[0],
                kv_cache[1], meta.slot_mapping, attn.num_heads, attn.num_kv_heads)
            x, residual = attn(positions, None, kv_cache, meta, cos_sin, probe, q=q,
                               residual=residual)
        elif not attn.qkv_proj.quantized:
            qkv, residual = kernels.rms_norm_linear(
                x, self.input_layernorm.weight, self.input_layernorm.eps, residual,
                attn.qkv_proj.weight, attn.qkv_proj.bias)
            x, residual = attn(positions, None, kv_cache, meta, cos_sin, probe, qkv=qkv,
                               residual=residual)
        else:
            if isinstance(x, kernels.Normed):  # the previous layer's down GEMV did the norm
                x, residual, xqs = x
            else:
                if isinstance(x, kernels.Summed):  # the sum made already: a norm, no residual
                    x, residual = x.h, None
                xqs = attn.qkv_proj.int8_input(rows, x.device)
                if residual is None:
                    residual = x
                    x = self.input_layernorm(x, xqs=xqs)
                else:
                    x, residual = self.input_layernorm(x, residual, xqs=xqs)
            post = self.post_attention_layernorm
            mlp_xqs = mlp.int8_input(rows, x.device)
            tail = kernels.norm_tail(residual, post.weight, post.eps, mlp_xqs)
            x = attn(positions, x, kv_cache, meta, cos_sin, probe, xqs, tail=tail)
            if tail is not None and tail.done:
                x = kernels.Normed(tail.out, tail.res_out, mlp_xqs)
        if isinstance(mlp, MLP) and not mlp.gate_up_proj.quantized:
            gate_up, residual = kernels.rms_norm_linear(
                x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps,
                residual, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
            return mlp(None, gate_up=gate_up, residual=residual)
        if isinstance(x, kernels.Normed):
            x, residual, xqs = x
        else:
            if isinstance(x, kernels.Summed):
                x, residual = x.h, None
            xqs = mlp.int8_input(rows, x.device) if mlp_xqs is None else mlp_xqs
            if residual is None:
                residual, x = x, self.post_attention_layernorm(x, xqs=xqs)
            else:
                x, residual = self.post_attention_layernorm(x, residual, xqs=xqs)
        if not isinstance(mlp, MLP) or next_layer is None or \
                not next_layer.self_attn.qkv_proj.quantized:
            return mlp(x, xqs), residual
        nxt = next_layer.input_layernorm
        tail = kernels.norm_tail(residual, nxt.weight, nxt.eps,
                                 lambda: next_layer.self_attn.qkv_proj.int8_input(rows, x.device))
        y = mlp(x, xqs, tail=tail)
        if tail is not None and tail.done:
            return kernels.Normed(tail.out, tail.res_out, tail.xqs), None
        return y, residual


class LlamaForCausalLM(nn.Module):
    # checkpoint projections loaded as shards of one fused projection: name -> (fused, shard)
    STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    tree_span = True  # its attention honours `AttnMetadata.tree_span` (`spec.tree_graph`)

    def __init__(self, cfg: LlamaConfig, bias: bool = False):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, bias) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", build_cos_sin_cache(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling),
            persistent=False)
        self.requires_grad_(False)

    def forward(self, input_ids, positions, kv_caches, meta: AttnMetadata,
                layer_range: tuple[int, int] | None = None, hidden=None, probe=None):
        """Runs layers `layer_range` (default all); the first stage embeds, the last normalises.
        Returns [num_tokens, hidden] (or (hidden, residual) from a middle stage)."""
        start, end = layer_range or (0, len(self.layers))
        if start == 0:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = hidden
        for i in range(start, end):
            layer = self.layers[i]
            # a Llama layer may do the next one's input norm (DecoderLayer.forward)
            nxt = self.layers[i + 1] if i + 1 < end and isinstance(layer, DecoderLayer) and \
                isinstance(self.layers[i + 1], DecoderLayer) else None
            x, residual = layer(positions, x, residual, kv_caches[i], meta, self.cos_sin, probe,
                                **({"next_layer": nxt} if nxt is not None else {}))
        if isinstance(x, kernels.Summed):  # the last layer added the residual already
            if end < len(self.layers):  # a stage hands on (x, residual): (h, 0) adds exactly
                return x.h, torch.zeros_like(x.h)
            return self.norm(x.h)
        if end < len(self.layers):
            return x, residual
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # loading -----------------------------------------------------------------------------------
    def load_weights(self, weights, dtype: torch.dtype | None = None,
                     device: torch.device | str = "cpu", quantize: str | None = None) -> None:
        """Loads HF-named tensors (dense tensors or QuantWeights), fusing q/k/v and gate/up into
        the stacked projections. Each tensor goes to `device` in `dtype` (default: the model's)
        as it arrives, so the host never holds a dense copy of a quantized model. `quantize`
        (int8|int4) quantizes the dense weights of the decoder layers' projections."""
        dtype = dtype or self.embed_tokens.weight.dtype
        device = torch.device(device)
        params = dict(self.named_parameters())
        linears = {name: m for name, m in self.named_modules() if isinstance(m, Linear)}
        stacked = self.STACKED
        tied = self.cfg.tie_word_embeddings
        for name, tensor in self._route_weights(weights, dtype, device):
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and tied):
                continue
            module, _, leaf = name.rpartition(".")
            shard = 0
            for part, (fused, i) in stacked.items():
                if module.endswith("." + part):
                    module, shard = module[:-len(part)] + fused, i
                    break
            if module in linears and leaf == "weight":
                linears[module].load_shard(shard, tensor, dtype, device,
                                           quantize if module.startswith("layers.") else None)
            elif module in linears and leaf == "bias":
                self._load_bias_shard(linears[module], shard, tensor, dtype, device)
            elif name == "embed_tokens.weight":
                self.embed_tokens.load(tensor, dtype, device, tied)
            elif name in params:
                if params[name].shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(params[name].shape)}")
                owner = self.get_submodule(module)
                setattr(owner, leaf, nn.Parameter(tensor.to(device, dtype), requires_grad=False))
            else:
                raise KeyError(f"unexpected weight {name!r} in checkpoint")
        for module, lin in linears.items():
            if not (module == "lm_head" and tied):
                lin.finalize()
        if tied:
            self.lm_head.share_parts(self.embed_tokens)
        missing = [n for n, p in self.named_parameters() if p.is_meta]
        if missing:
            raise KeyError(f"checkpoint lacks weights: {sorted(missing)[:5]}")

    def _route_weights(self, weights, dtype: torch.dtype, device: torch.device):
        """The stream of (HF name, tensor) that the loop of `load_weights` loads, after a
        subclass took the tensors it loads itself (`moe.ExpertLoading`: the experts)."""
        return weights

    def _load_bias_shard(self, lin: Linear, shard: int, tensor, dtype, device) -> None:
        start = sum(lin.out_sizes[:shard])
        if lin.bias.is_meta:
            lin.bias = nn.Parameter(torch.zeros(lin.out_features, dtype=dtype, device=device),
                                    requires_grad=False)
        lin.bias.data.narrow(0, start, lin.out_sizes[shard]).copy_(tensor)

    def weight_types(self) -> list[str]:
        """The types the projections and embeddings are stored in (`q4_k`, `bfloat16`, ...)."""
        kinds = set()
        for m in self.modules():
            if isinstance(m, Linear):
                kinds.update(kernels.weight_kind(p) for p in m.parts or [m.weight])
            elif isinstance(m, Embedding):
                kinds.add(m.qweight.qtype if m.qweight is not None else
                          kernels.weight_kind(m.head_part if m.table_in_head else m.weight))
        return sorted(kinds)

    def weight_bytes(self) -> int:
        """Bytes the weights take on their device (quantized parts at their packed size)."""
        layers = [m for m in self.modules() if isinstance(m, (Linear, Embedding))
                  and not (m is self.lm_head and self.cfg.tie_word_embeddings)]
        owned = {id(m.weight) for m in layers if m.weight is not None}
        rest = sum(p.numel() * p.element_size() for p in self.parameters() if id(p) not in owned)
        return sum(m.weight_bytes() for m in layers) + rest
