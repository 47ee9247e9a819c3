"""Gemma 4 GGUF files (`gemma4`) as llama.cpp's converter writes them (`conversion/gemma.py`:
`Gemma4Model` on `Gemma3Model` and `TextModel`), read the way llama.cpp's gemma4 graph
(`src/models/gemma4-iswa.cpp`) runs them:

- names: gguf's MODEL_ARCH.GEMMA4 map. The per-layer inputs are `per_layer_token_embd`,
  `per_layer_model_proj`, `per_layer_proj_norm` and in each block `inp_gate`, `proj`,
  `post_norm`; the layer scalar `layer_output_scale.weight` (HF `layer_scalar`, no suffix); the
  MoE router `ffn_gate_inp.weight` / `.scale`, its per-expert scale `ffn_down_exps.scale`, the
  experts `ffn_gate_up_exps` / `ffn_down_exps` (stacked, as the HF checkpoint stores them) and
  their norms `pre_ffw_norm_2`, `post_ffw_norm_1`, `post_ffw_norm_2`.
- values: as the HF checkpoint's. Gemma 4's norms scale by w and are stored as w (no 1 + w as
  for Gemma 3), Q/K rows are not permuted (NeoX RoPE), and every scale (embedding, per-layer
  inputs, attention) is applied at run time, none folded into a tensor.
- attention: `attention.key_length` is the global layers' head size, `key_length_swa` the local
  ones'; `head_count_kv` one count or one per layer; a global layer without `attn_v` takes its
  values from the key projection (`attention_k_eq_v`); the last `attention.shared_kv_layers`
  blocks have no K/V tensors and read the cache of the last earlier layer of their type, as
  transformers does (llama.cpp takes the last two unshared layers, local then global: the same
  layers in the released shapes and the tests'). `sliding_window_pattern` holds
  one bool per layer (True: local). `feed_forward_length` is one per layer when the shared
  layers' MLPs are double wide.
- RoPE: `rope.freq_base` / `freq_base_swa` the global / local bases. The global layers' RoPE
  is "proportional": the converter rotates the whole head (`rope.dimension_count` = head size)
  and writes `rope_freqs` [head_size / 2] = 1.0 for the first partial_rotary_factor share of
  the frequency pairs and 1e30 for the others (llama.cpp divides each pair's frequency by its
  entry, so those stop turning). This reader takes `partial_rotary_factor` back from the number
  of finite entries and `factor` from their common value (the converter writes 1.0: it drops an
  HF `factor`); any other `rope_freqs` is refused.
Refused (ValueError): files whose metadata or tensors say something the converter does not
write or luceio does not run (listed in `config_fields` and `hf_name`).
"""
from __future__ import annotations

import math

import numpy as np

ARCHITECTURES = {"gemma4": "Gemma4ForCausalLM"}

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
           "output": "lm_head", "per_layer_token_embd": "model.embed_tokens_per_layer",
           "per_layer_model_proj": "model.per_layer_model_projection",
           "per_layer_proj_norm": "model.per_layer_projection_norm"}
# blk.{i}.<part>.<suffix> -> model.layers.{i}.<HF module>.<suffix>: Gemma 4's parts beyond
# Gemma 3's (`common`, loader/gguf.py's gemma3 table: attention, the four norms, the MLP)
_LAYER = {
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}
# the common table's router and per-expert stacks are not Gemma 4's (its are `_LEAVES`)
_NOT_COMMON = frozenset({"ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})
_LEAVES = {  # (part, suffix) whose HF name has another leaf -> that name inside the layer
    ("layer_output_scale", "weight"): "layer_scalar",
    ("ffn_gate_inp", "weight"): "router.proj.weight",
    ("ffn_gate_inp", "scale"): "router.scale",
    ("ffn_down_exps", "scale"): "router.per_expert_scale",
    ("ffn_gate_up_exps", "weight"): "experts.gate_up_proj",
    ("ffn_down_exps", "weight"): "experts.down_proj",
}
_KV_PARTS = ("attn_k", "attn_v", "attn_k_norm")
# loaded dense even where `weights(keep_quantized=True)` keeps the others quantized: the model's
# per-layer table is a plain embedding, which takes no QuantWeight
DENSE = frozenset({"model.embed_tokens_per_layer.weight"})
# a `rope_freqs` entry at least this large stops its frequency pair (the converter writes 1e30;
# an F16 copy reads inf): llama.cpp's angle, position / entry, is then below 1e-14
_UNROTATED = 1e20


def hf_name(gguf_name: str, first_shared: int, common: dict[str, str]) -> str | None:
    """The HF name of a gemma4 GGUF tensor (`common`: the layer names shared with gemma3);
    None for `rope_freqs` (read into the config) and for K/V tensors of a KV-shared layer
    (from `first_shared` on), which llama.cpp ignores too."""
    if gguf_name == "rope_freqs.weight":
        return None
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _GLOBAL:
        return f"{_GLOBAL[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        layer, part, suffix = int(parts[1]), parts[2], parts[3]
        if part in _KV_PARTS and layer >= first_shared:
            return None
        module = _LAYER.get(part) or (common.get(part) if part not in _NOT_COMMON else None)
        leaf = _LEAVES.get((part, suffix)) or (module and f"{module}.{suffix}")
        if leaf:
            return f"model.layers.{layer}.{leaf}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Gemma 4 HF counterpart that luceio "
                     "knows (split ffn_gate_exps / ffn_up_exps experts are not read: the "
                     "converter writes them fused as ffn_gate_up_exps)")


def proportional_rope(freqs: np.ndarray, head_dim: int) -> dict:
    """`partial_rotary_factor` and `factor` of the global layers' proportional RoPE from the
    `rope_freqs` tensor: [head_dim / 2] entries, the rotated pairs' first, all one finite
    positive value (the frequencies are divided by it: 1.0 from the converter), then the
    stopped pairs' (>= 1e20, or inf). Anything else raises ValueError."""
    freqs = np.asarray(freqs, dtype=np.float64).reshape(-1)
    if freqs.size != head_dim // 2:
        raise ValueError(f"GGUF rope_freqs has {freqs.size} entries; the global layers' head "
                         f"size {head_dim} needs {head_dim // 2} (one per frequency pair)")
    stopped = freqs >= _UNROTATED
    rotated = int(freqs.size - stopped.sum())
    head = freqs[:rotated]
    if stopped[:rotated].any() or np.isnan(freqs).any() or \
            (rotated and not (np.all(head == head[0]) and 0 < head[0] < _UNROTATED)):
        raise ValueError(
            "GGUF rope_freqs is not proportional RoPE as llama.cpp's converter writes it (the "
            "first pairs one finite value, 1.0, the rest >= 1e20, 1e30 as written): "
            f"{freqs.tolist()}")
    share = 2 * rotated / head_dim
    if int(share * head_dim // 2) != rotated:  # as `gemma4.global_rope` counts them back
        share = math.nextafter(share, 2.0)
    return {"partial_rotary_factor": share, "factor": _f32(head[0]) if rotated else 1.0}


def _per_layer(value, num_layers: int, what: str) -> list:
    if isinstance(value, list):
        if len(value) != num_layers:
            raise ValueError(f"GGUF {what} has {len(value)} entries for {num_layers} layers")
        return list(value)
    return [value] * num_layers


def _one(values: list, what: str):
    """The one value all `values` share (None for none)."""
    if len(set(values)) > 1:
        raise ValueError(f"Gemma 4 GGUF with {what} {values}: luceio runs one value for the "
                         "local and one for the global layers")
    return values[0] if values else None


def config_fields(key, config: dict, shapes: dict[str, tuple[int, ...]],
                  rope_freqs: np.ndarray | None) -> dict:
    """The gemma4_text fields of the HF config from the file's metadata (`key(name)` reads
    `gemma4.<name>`), over the generic `config`, the tensor shapes and the `rope_freqs`
    values. Refuses what the converter does not write or luceio does not run."""
    layers = config["num_hidden_layers"]
    pattern = key("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ValueError("Gemma 4 GGUF needs attention.sliding_window_pattern as one bool per "
                         f"layer, as llama.cpp's converter writes it; the file has {pattern!r}")
    local = [bool(p) for p in pattern]
    if local[-1]:
        raise ValueError("Gemma 4 GGUF whose last layer is local: transformers (and luceio) "
                         "always run the last layer global")
    if key("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"Gemma 4 GGUF with rope.scaling.type {key('rope.scaling.type')!r}: "
                         "the converter writes none (its global RoPE is in rope_freqs)")
    global_dim = key("attention.key_length") or config["hidden_size"] // \
        config["num_attention_heads"]
    local_dim = key("attention.key_length_swa", global_dim)
    if (key("attention.value_length", global_dim), key("attention.value_length_swa", local_dim)) \
            != (global_dim, local_dim):
        raise ValueError("Gemma 4 GGUF with value lengths other than its key lengths")
    n_rot = key("rope.dimension_count", global_dim)
    if n_rot != global_dim or (any(local) and key("rope.dimension_count_swa", n_rot) != local_dim):
        raise ValueError(f"Gemma 4 GGUF rotating {n_rot} / {key('rope.dimension_count_swa')} "
                         f"dimensions of heads of {global_dim} / {local_dim}: luceio rotates "
                         "whole heads (the global layers' partial share comes from rope_freqs)")
    heads = config["num_attention_heads"]
    kv = _per_layer(key("attention.head_count_kv", heads), layers, "attention.head_count_kv")
    shared = key("attention.shared_kv_layers") or 0
    first_shared = layers - shared
    has_k = [f"blk.{i}.attn_k.weight" in shapes for i in range(first_shared)]
    has_v = [f"blk.{i}.attn_v.weight" in shapes for i in range(first_shared)]
    if not all(has_k) or (not all(v for v, lo in zip(has_v, local) if lo)):
        raise ValueError("Gemma 4 GGUF with a layer before the KV-shared ones lacking attn_k, "
                         "or a local layer lacking attn_v")
    k_eq_v = _one([not v for v, lo in zip(has_v, local) if not lo], "global layers with and "
                  "without attn_v")
    fields = {
        "architectures": [ARCHITECTURES["gemma4"]],
        "model_type": "gemma4_text",
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": local_dim,
        "num_key_value_heads": _one([h for h, lo in zip(kv, local) if lo], "local KV heads")
        or kv[-1],
        "layer_types": ["sliding_attention" if lo else "full_attention" for lo in local],
        "sliding_window": key("attention.sliding_window"),
        "num_kv_shared_layers": shared,
        "attention_k_eq_v": bool(k_eq_v),
        "final_logit_softcapping": _f32(key("final_logit_softcapping")),
        **_mlp_fields(key, layers, first_shared),
        **_per_layer_input_fields(key, shapes),
        **_moe_fields(key, shapes, layers),
    }
    global_kv = _one([h for h, lo in zip(kv, local) if not lo], "global KV heads")
    fields["per_layer_config"] = {  # the global layers' attention shape
        str(i): {"head_dim": global_dim, "num_key_value_heads": global_kv}
        for i, lo in enumerate(local) if not lo}
    if rope_freqs is None:
        raise ValueError("Gemma 4 GGUF without a rope_freqs tensor: llama.cpp's converter "
                         "always writes one (the global layers' proportional RoPE), and "
                         "llama.cpp requires it")
    theta = _f32(key("rope.freq_base", 10000.0))  # llama.cpp's defaults where the file is silent
    fields["rope_parameters"] = {
        "full_attention": {"rope_type": "proportional", "rope_theta": theta,
                           **proportional_rope(rope_freqs, global_dim)},
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": _f32(key("rope.freq_base_swa")) or theta}}
    return {**config, **fields}


def _mlp_fields(key, layers: int, first_shared: int) -> dict:
    """`intermediate_size` and `use_double_wide_mlp` from `feed_forward_length` (one per layer
    when the KV-shared layers' MLPs are twice as wide)."""
    widths = _per_layer(key("feed_forward_length"), layers, "feed_forward_length")
    width = widths[0]
    wide = widths[first_shared:] == [2 * width] * (layers - first_shared) and first_shared < layers
    if widths[:first_shared] != [width] * first_shared or \
            widths[first_shared:] != [width * (2 if wide else 1)] * (layers - first_shared):
        raise ValueError(f"Gemma 4 GGUF with MLP widths {widths}: luceio runs one width, "
                         "doubled on the KV-shared layers with use_double_wide_mlp")
    return {"intermediate_size": width, "use_double_wide_mlp": wide}


def _per_layer_input_fields(key, shapes: dict[str, tuple[int, ...]]) -> dict:
    size = key("embedding_length_per_layer_input") or 0
    if not size:
        return {"hidden_size_per_layer_input": 0}
    return {"hidden_size_per_layer_input": size,
            "vocab_size_per_layer_input": shapes["per_layer_token_embd.weight"][0]}


def _moe_fields(key, shapes: dict[str, tuple[int, ...]], layers: int) -> dict:
    """Mixture-of-experts fields: luceio's Gemma 4 runs them on every layer or none."""
    routed = [f"blk.{i}.ffn_gate_inp.weight" in shapes for i in range(layers)]
    if not any(routed):
        return {"enable_moe_block": False}
    if not all(routed) or not key("expert_count"):
        raise ValueError("Gemma 4 GGUF with experts on some layers only, or without "
                         "expert_count: luceio runs them on every layer")
    return {"enable_moe_block": True, "num_experts": key("expert_count"),
            "top_k_experts": key("expert_used_count"),
            "moe_intermediate_size": key("expert_feed_forward_length")}


def _f32(value) -> float | None:
    """The shortest decimal of a GGUF f32 (as `gguf._float32`); None stays None."""
    return None if value is None else float(str(np.float32(value)))
