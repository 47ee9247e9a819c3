"""GGUF files (llama.cpp): metadata becomes an HF config, tensors get HF names and layouts, and
the vocabulary becomes a `tokenizers.Tokenizer` (`gguf_tokenizer.py`).

The `gguf` package reads and dequantizes; it is imported inside functions so that luceio imports
on machines without it. Tensors come out as fp32, the way transformers dequantizes a GGUF, or,
with `weights(keep_quantized=True)`, quantized tensors are repacked losslessly into
`QuantWeight`s (`kernels/quant.py`) and only F32/F16/BF16 (and types without a repacked layout)
are dense, F16 and BF16 matrices in their own 16 bits (an fp32 CPU model keeps them so:
`kernels/half_cpu.py`).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from . import Checkpoint, gguf_gemma4, gguf_qwen35
from .gguf_tokenizer import gguf_tokenizer

logger = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", **gguf_qwen35.ARCHITECTURES,
                 **gguf_gemma4.ARCHITECTURES}

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
_LAYER_TENSORS = {  # inside blk.{i} -> inside model.layers.{i}
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the mixture-of-experts router
    "ffn_gate_exps": "mlp.experts.gate_proj",  # [num_experts, ...] stacks, split by expert
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_EXPERT_STACKS = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
# Gemma's four norms a layer (gguf's MODEL_ARCH.GEMMA3 map): its `ffn_norm` is the norm before
# the MLP, as in llama, but HF names that one pre_feedforward_layernorm
_ARCH_LAYER_TENSORS = {"gemma3": {**_LAYER_TENSORS,
                                  "post_attention_norm": "post_attention_layernorm",
                                  "ffn_norm": "pre_feedforward_layernorm",
                                  "post_ffw_norm": "post_feedforward_layernorm"}}
# llama.cpp's Gemma converters store every `*norm.weight` as 1 + w (its RMSNorm multiplies by
# the stored weight; HF's Gemma3RMSNorm by 1 + w): the loader subtracts 1 to give HF's w
_NORM_SHIFT = {"gemma3": 1.0}


def load_gguf(path: str) -> Checkpoint:
    """Opens a llama/qwen2/qwen3/qwen3moe/gemma3/gemma4/qwen35/qwen35moe GGUF; the tensors are
    read and dequantized when `weights()` runs. Experts' stacked tensors are always dequantized
    (experts run dense), then yielded one expert at a time under the HF Hub's names
    (`mlp.experts.{e}.gate_proj.weight`), except gemma4's, stacked as its checkpoints hold them."""
    started = time.perf_counter()
    reader = open_gguf(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    # the reader holds two numpy views per vocabulary string (~0.5 GB for a 150k vocabulary):
    # free them before the weights load, so their heap is reused rather than left behind them
    reader.fields.clear()
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; luceio reads "
                         f"{', '.join(ARCHITECTURES)}.")
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    gemma4 = arch in gguf_gemma4.ARCHITECTURES  # its rope_freqs is its proportional RoPE
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None and not gemma4:
        raise ValueError(f"{path}: has a rope_freqs tensor (Llama-3.1-style rope scaling), which "
                         f"luceio cannot turn into HF rope parameters yet.")
    if rope_freqs is not None:
        from gguf.quants import dequantize
        rope_freqs = dequantize(rope_freqs.data, rope_freqs.tensor_type)
    config = gguf_config(meta, shapes, rope_freqs)
    qwen35 = arch in gguf_qwen35.ARCHITECTURES
    layers = config["num_hidden_layers"]
    names = {t.name: gguf_qwen35.hf_name(t.name, layers, _LAYER_TENSORS) if qwen35
             else gguf_gemma4.hf_name(t.name, layers - config["num_kv_shared_layers"],
                                      _ARCH_LAYER_TENSORS["gemma3"]) if gemma4
             else hf_tensor_name(t.name, arch) for t in reader.tensors}
    norm_shift = _NORM_SHIFT.get(arch, 0.0)
    tokenizer, tokenizer_config = gguf_tokenizer(meta)
    logger.info("read GGUF metadata of %s in %.1f s", path, time.perf_counter() - started)

    def weights(keep_quantized: bool = False):
        from gguf.quants import dequantize

        from ..kernels.quant import ggml_to_qtype, permute_rows, repack_gguf

        t0 = time.perf_counter()
        kept = 0
        for tensor in reader.tensors:
            if names[tensor.name] is None:  # qwen35's multi-token prediction, gemma4's rope_freqs
                continue
            # gemma4's experts stay stacked (and dense), as its HF checkpoint holds them
            part = "" if gemma4 else tensor.name.split(".")[-2]
            heads = None
            if arch == "llama" and part in ("attn_q", "attn_k"):
                heads = config["num_attention_heads" if part == "attn_q" else "num_key_value_heads"]
            shape = shapes[tensor.name]
            stack = part in _EXPERT_STACKS or part == "ffn_gate_up_exps"
            if keep_quantized and stack and len(shape) == 3 and ggml_to_qtype(tensor.tensor_type):
                kept += 1  # experts stay quantized, expert by expert (`moe.SparseMoeBlock`)
                yield from quantized_experts(names[tensor.name], tensor, shape)
                continue
            if keep_quantized and len(shape) == 2 and ggml_to_qtype(tensor.tensor_type) and \
                    names[tensor.name] not in gguf_gemma4.DENSE:
                w = repack_gguf(tensor.data, tensor.tensor_type, shape)
                if heads is not None:
                    order = unpermute_rotary_rows(np.arange(shape[0]), heads)
                    w = permute_rows(w, torch.from_numpy(order))
                kept += 1
                yield names[tensor.name], w
                continue
            half = _half(tensor) if keep_quantized and len(shape) == 2 and not stack else None
            if half is not None:  # F16 / BF16 matrices in their 16 bits
                array = half.reshape(shape)
                if heads is not None:
                    array = unpermute_rotary_rows(array, heads)
                t = torch.from_numpy(np.array(array))
                yield names[tensor.name], t.view(torch.bfloat16) if t.dtype == torch.uint16 else t
                continue
            array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            if heads is not None:
                array = unpermute_rotary_rows(array, heads)
            if norm_shift and tensor.name.endswith("norm.weight"):
                array = array - np.float32(norm_shift)
            if qwen35:
                array = gguf_qwen35.dense_value(tensor.name, array)
            if not array.flags.writeable:  # an F32 tensor is a view into the read-only mmap
                array = array.copy()
            if part in _EXPERT_STACKS:
                yield from split_experts(names[tensor.name], torch.from_numpy(array))
            elif part == "ffn_gate_up_exps":
                for name, stack in gguf_qwen35.split_gate_up(names[tensor.name],
                                                             torch.from_numpy(array)):
                    yield from split_experts(name, stack)
            else:
                yield names[tensor.name], torch.from_numpy(array)
        logger.info("read %d GGUF tensors (%d kept quantized) in %.1f s", len(reader.tensors),
                    kept, time.perf_counter() - t0)

    eos_ids = _eos_token_ids(meta)
    generation_config = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
                         "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer,
                      tokenizer_config=tokenizer_config, generation_config=generation_config,
                      source=path)


def _half(tensor) -> np.ndarray | None:
    """An F16 or BF16 tensor's values as float16 or as bf16 bits (uint16), else None. Not the
    tensors whose HF value is computed from the file's (`gguf_qwen35.dense_value`: norms, the
    conv, A): those are dequantized."""
    from gguf import GGMLQuantizationType as T
    if tensor.name.endswith(("norm.weight", ".ssm_conv1d.weight", ".ssm_a")) or \
            tensor.tensor_type not in (T.F16, T.BF16):
        return None
    return tensor.data.view(np.float16 if tensor.tensor_type == T.F16 else np.uint16)


def open_gguf(path: str):
    """`gguf.GGUFReader`, reading through a plain ndarray view of its memory map: each slice of
    an `np.memmap` runs Python code, and the reader slices twice per vocabulary string (3x faster
    on a 150k-token vocabulary)."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)
            return super()._get(offset, dtype, count, override_order)

    return Reader(path)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    base, suffix = gguf_name.rsplit(".", 1)
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        hf = _ARCH_LAYER_TENSORS.get(arch, _LAYER_TENSORS).get(part)
        hf = hf and f"model.layers.{layer}.{hf}"
    else:
        hf = _GLOBAL_TENSORS.get(base)
    if hf is None:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart that luceio knows")
    return f"{hf}.{suffix}"


def quantized_experts(name: str, tensor, shape: tuple[int, int, int]):
    """A quantized expert stack [num_experts, rows, cols] -> one (HF per-expert name,
    QuantWeight) pair per expert (gate and up apart for a fused `ffn_gate_up_exps`)."""
    from ..kernels.quant import permute_rows, repack_gguf
    data = tensor.data.reshape(shape[0], -1)
    prefix, leaf = name.split(".experts.")
    for expert in range(shape[0]):
        w = repack_gguf(data[expert], tensor.tensor_type, shape[1:])
        if leaf == "gate_up_proj.weight":
            inter = shape[1] // 2
            yield f"{prefix}.experts.{expert}.gate_proj.weight", permute_rows(w, range(inter))
            yield f"{prefix}.experts.{expert}.up_proj.weight", \
                permute_rows(w, range(inter, 2 * inter))
        else:
            yield f"{prefix}.experts.{expert}.{leaf}", w


def split_experts(name: str, stack: torch.Tensor):
    """`model.layers.0.mlp.experts.gate_proj.weight` [num_experts, rows, cols] -> one
    (`model.layers.0.mlp.experts.{e}.gate_proj.weight`, [rows, cols]) pair per expert."""
    prefix, leaf = name.split(".experts.")
    for expert, weight in enumerate(stack):
        yield f"{prefix}.experts.{expert}.{leaf}", weight


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row order. Its converter interleaves each head's two rotary halves
    (rows [h, 2, d/2] become [h, d/2, 2]) for its GPT-J-style rope; HF rotates halves."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(meta: dict, shapes: dict[str, tuple[int, ...]], rope_freqs=None) -> dict:
    """An HF config.json dict from GGUF metadata and the tensor shapes (`rope_freqs`: that
    tensor's values, read for gemma4)."""
    arch = meta["general.architecture"]

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    num_heads = key("attention.head_count")
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per layer in some files; luceio wants one count
        if len(set(num_kv_heads)) != 1 and arch not in gguf_gemma4.ARCHITECTURES:
            raise ValueError(f"GGUF has per-layer KV head counts {num_kv_heads}")
        num_kv_heads = num_kv_heads[0]
    hidden_size = key("embedding_length")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": key("attention.key_length") or hidden_size // num_heads,
        "hidden_act": "silu",
        "rms_norm_eps": _float32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _float32(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(key),
        "max_position_embeddings": key("context_length"),
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if arch in gguf_gemma4.ARCHITECTURES:  # per-layer widths, head sizes and KV heads
        return gguf_gemma4.config_fields(key, config, shapes, rope_freqs)
    if key("expert_count"):
        config.update(_moe_config(key, shapes, config["num_hidden_layers"]))
    if arch == "gemma3":
        config.update(_gemma3_config(key, config))
    if arch in gguf_qwen35.ARCHITECTURES:
        config.update(gguf_qwen35.config_fields(key, config, arch))
    return config


def _gemma3_config(key, config: dict) -> dict:
    """Gemma 3 fields of a gemma3_text config. Where the file is silent, llama.cpp's own rules
    for gemma3 hold: every 6th layer global, local RoPE base 10000, and attention scaled by
    head_dim ** -0.5, except the 62-layer 27B's (hidden / heads) ** -0.5. A file may say
    otherwise with gguf's `attention.sliding_window_pattern` (a count or one bool per layer,
    True = local), `rope.freq_base_swa` and `attention.scale`."""
    layers = config["num_hidden_layers"]
    pattern = key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        local = [bool(p) for p in pattern]
    else:
        local = [(i + 1) % pattern != 0 for i in range(layers)]
    scale = key("attention.scale")
    if scale:
        scalar = float(np.float32(scale)) ** -2
    elif layers == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = config["head_dim"]
    softcap = key("final_logit_softcapping")
    return {
        "model_type": "gemma3_text",
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
        "sliding_window": key("attention.sliding_window"),
        "rope_local_base_freq": _float32(key("rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": _float32(softcap) if softcap else None,
        "attn_logit_softcapping": key("attn_logit_softcapping"),
    }


def _moe_config(key, shapes: dict[str, tuple[int, ...]], num_layers: int) -> dict:
    """Mixture-of-experts fields of a qwen3_moe config. A layer without a router is dense. The
    top-k weights are renormalised unless the file says otherwise (`expert_weights_norm`), as
    the released Qwen3-MoE models do (`norm_topk_prob: true`)."""
    return {
        "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "norm_topk_prob": bool(key("expert_weights_norm", True)),
        "mlp_only_layers": [i for i in range(num_layers)
                            if f"blk.{i}.ffn_gate_inp.weight" not in shapes],
    }


def _float32(value: float) -> float:
    """GGUF stores floats as f32: 1e-5 reads back as 9.99999974e-06. Take the shortest decimal
    that rounds to the same f32, which is what the original config said."""
    return float(str(np.float32(value)))


def _rope_scaling(key) -> dict | None:
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported")
    scaling = {"rope_type": kind, "factor": _float32(key("rope.scaling.factor"))}
    if key("rope.scaling.original_context_length") is not None:
        scaling["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    return scaling


def _eos_token_ids(meta: dict) -> list[int]:
    """The end-of-sequence id, then end-of-turn ids where the file names other ones."""
    ids = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = meta.get(f"tokenizer.ggml.{name}")
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return ids
