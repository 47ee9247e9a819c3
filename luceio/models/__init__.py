"""Model registry: HF `architectures` name → implementation."""
from __future__ import annotations

import torch

from ..loader import Checkpoint
from .llama import AttnMetadata, LlamaConfig, LlamaForCausalLM
from .moe import MoeConfig, Qwen3MoeForCausalLM

_ARCHS = {
    "LlamaForCausalLM": False,  # value: whether q/k/v carry a bias by default
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "Qwen3ForCausalLM": False,
    "Qwen3MoeForCausalLM": False,
}

__all__ = ["AttnMetadata", "LlamaConfig", "LlamaForCausalLM", "build_model", "context_limit"]


def context_limit(ckpt: Checkpoint | None, model, max_model_len: int | None) -> int:
    """The longest context to serve: `max_model_len`, or the model's own when None (its
    position limit, cut at a sliding window, past which this engine would not be exact);
    more than the model's own is a ValueError. From `model.cfg` when a model object is given,
    else from the checkpoint's config."""
    cfg = model.cfg if model is not None else None
    native = cfg.max_position_embeddings if cfg else \
        ckpt.config.get("max_position_embeddings", 4096)
    window = cfg.sliding_window if cfg else ckpt.config.get("sliding_window")
    if window and (ckpt is None or ckpt.config.get("use_sliding_window", True)):
        native = min(native, window)
    if max_model_len is None:
        return native
    if max_model_len > native:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context {native}")
    return max_model_len


def build_model(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                quantization: str = "auto") -> LlamaForCausalLM:
    """Builds the model on the meta device and loads each tensor straight onto `device`.
    `quantization`: auto (a GGUF keeps its quantized types, other checkpoints stay dense),
    none (everything dense in `dtype`), int8 / int4 (dense checkpoints quantized at load)."""
    arch = (ckpt.config.get("architectures") or ["?"])[0]
    if arch not in _ARCHS:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(_ARCHS)}")
    cfg = LlamaConfig.from_hf(ckpt.config)
    bias = _ARCHS[arch] or bool(ckpt.config.get("attention_bias", False))
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg, MoeConfig.from_hf(ckpt.config), bias) \
            if arch == "Qwen3MoeForCausalLM" else LlamaForCausalLM(cfg, bias=bias)
    quantize = quantization if quantization in ("int8", "int4") else None
    if quantize and ckpt.source.endswith(".gguf"):
        raise ValueError(f"--quantization {quantization}: {ckpt.source} is a GGUF file, which "
                         "keeps its own quantized types (--quantization auto) or is "
                         "dequantized (--quantization none)")
    model.load_weights(ckpt.weights(keep_quantized=quantization == "auto"), dtype, device,
                       quantize)
    model.cos_sin = _rope_cache(cfg).to(device)  # stays fp32 whatever the model dtype
    return model


def _rope_cache(cfg: LlamaConfig) -> torch.Tensor:
    from ..kernels.rotary import build_cos_sin_cache
    return build_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                               cfg.rope_scaling)
