"""Qwen3.5 GGUF files (`qwen35`, `qwen35moe`) as llama.cpp's converter writes them
(`conversion/qwen.py`: `Qwen3_5TextModel`, `Qwen3_5MoeTextModel` on `Qwen3NextModel`):

- names: the linear-attention layer's in_proj_qkv is `attn_qkv`, in_proj_z `attn_gate`,
  in_proj_b / _a `ssm_beta` / `ssm_alpha`, conv1d `ssm_conv1d` ([conv_dim, kernel], squeezed),
  A_log `ssm_a` (no suffix), dt_bias `ssm_dt.bias`, the gated norm `ssm_norm`, out_proj
  `ssm_out`; the post-attention norm `post_attention_norm`; the shared expert `*_shexp` and its
  gate `ffn_gate_inp_shexp`; experts stacked (`ffn_*_exps`, or gate and up fused as
  `ffn_gate_up_exps`).
- values: `ssm_a` holds -exp(A_log); every other `*norm.weight` but `ssm_norm` holds 1 + w
  (llama.cpp's RMSNorm multiplies by the stored weight, HF's Qwen3.5 norm by 1 + w); the
  full-attention q_proj keeps its per-head [query | gate] rows and RoPE its NeoX halves.
- v heads: with fewer k heads than v heads the converter reorders every v-head tensor from
  HF's grouped order to a tiled one (v head j reads k head j % num_k_heads). The tensors load
  as they are (quantized ones stay quantized) and the model runs the DeltaNet in tiled order
  (`linear_v_head_order: tiled` in the config, `Qwen35Config.linear_v_tiled`).
- multi-token-prediction layers (`nextn_predict_layers`, appended after the last block) are
  not loaded: `block_count` counts them.
- `qwen3next` (Qwen3-Next, the same converter's base class): HF's interleaved in_proj_qkvz is
  written already regrouped as `attn_qkv` + `attn_gate`, in_proj_ba as it is (`ssm_ba`, which
  `models/qwen3_next.py` regroups), and the v heads keep HF's grouped order.
"""
from __future__ import annotations

import numpy as np
import torch

ARCHITECTURES = {"qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM",
                 "qwen3next": "Qwen3NextForCausalLM"}

# blk.{i}.<gguf part> -> model.layers.{i}.<HF module>, over llama.cpp's common names
# (`gguf._LAYER_TENSORS`: attention, q/k norms, MLP, router, expert stacks)
_LAYER = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",  # qwen3next
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
           "model.norm.weight", "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str, num_layers: int, common: dict[str, str]) -> str | None:
    """The HF name of a qwen35 GGUF tensor (`common`: the layer names shared with the other
    architectures); None for a multi-token-prediction layer's."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or len(parts) < 3:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart that luceio knows")
    layer, part = int(parts[1]), parts[2]
    if layer >= num_layers:
        return None
    prefix = f"model.layers.{layer}."
    if part == "ssm_a" and len(parts) == 3:
        return prefix + "linear_attn.A_log"
    if part == "ssm_dt" and parts[3:] == ["bias"]:
        return prefix + "linear_attn.dt_bias"
    hf = _LAYER.get(part) or common.get(part)
    if hf is None or len(parts) != 4:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart that luceio knows")
    return f"{prefix}{hf}.{parts[3]}"


def dense_value(gguf_name: str, array: np.ndarray) -> np.ndarray:
    """A dense tensor's HF value: A_log from -exp(A_log), w from 1 + w, the conv's channel
    axis back."""
    if gguf_name.endswith(".ssm_a"):
        return np.log(-array.astype(np.float32))
    if gguf_name.endswith(".ssm_conv1d.weight"):
        return array.reshape(array.shape[0], 1, array.shape[-1])
    if gguf_name.endswith("norm.weight") and not gguf_name.endswith(".ssm_norm.weight"):
        return array - np.float32(1.0)
    if gguf_name.endswith(".ffn_gate_inp_shexp.weight") and array.ndim == 1:
        return array.reshape(1, -1)
    return array


def split_gate_up(name: str, stack: torch.Tensor):
    """`...mlp.experts.gate_up_proj.weight` [E, 2 * inter, hidden] -> the gate and up stacks."""
    inter = stack.shape[1] // 2
    prefix = name.removesuffix("gate_up_proj.weight")
    yield prefix + "gate_proj.weight", stack[:, :inter]
    yield prefix + "up_proj.weight", stack[:, inter:]


def config_fields(key, config: dict, arch: str) -> dict:
    """Qwen3.5 fields of an HF text config from the file's metadata (`key(name)` reads
    `qwen35.<name>`), over the generic ones in `config`."""
    num_layers = config["num_hidden_layers"] - (key("nextn_predict_layers") or 0)
    recurrent = key("attention.recurrent_layers")
    if recurrent is not None:
        types = ["linear_attention" if r else "full_attention" for r in recurrent[:num_layers]]
    else:
        interval = key("full_attention_interval") or 4
        types = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(num_layers)]
    head_dim = config["head_dim"]
    v_heads = key("ssm.time_step_rank")
    k_heads = key("ssm.group_count")
    fields = {
        "model_type": "qwen3_next" if arch == "qwen3next" else "qwen3_5_text",
        "num_hidden_layers": num_layers,
        "layer_types": types,
        "rope_parameters": {"rope_type": "default", "rope_theta": config["rope_theta"],
                            "partial_rotary_factor": (key("rope.dimension_count") or head_dim)
                            / head_dim},
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": key("ssm.inner_size") // v_heads,
        "linear_v_head_order": "tiled" if k_heads != v_heads and arch != "qwen3next"
                               else "grouped",
    }
    if key("expert_count"):
        fields.update({"num_experts": key("expert_count"),
                       "num_experts_per_tok": key("expert_used_count"),
                       "moe_intermediate_size": key("expert_feed_forward_length"),
                       "shared_expert_intermediate_size":
                           key("expert_shared_feed_forward_length")})
    return fields
