"""Model registry: HF `architectures` name → implementation."""
from __future__ import annotations

import torch

from ..loader import Checkpoint
from . import gemma, gemma4, qwen3_5, qwen3_5_moe, qwen3_next
from .gemma import Gemma3Config, Gemma3ForCausalLM
from .gemma4 import Gemma4Config, Gemma4ForCausalLM
from .llama import AttnMetadata, LlamaConfig, LlamaForCausalLM
from .moe import MoeConfig, Qwen3MoeForCausalLM
from .qwen3_5 import Qwen35Config, Qwen3_5ForCausalLM
from .qwen3_5_moe import Qwen3_5MoeForCausalLM
from .qwen3_next import Qwen3NextForCausalLM

_ARCHS = {
    "LlamaForCausalLM": False,  # value: whether q/k/v carry a bias by default
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "Qwen3ForCausalLM": False,
    "Qwen3MoeForCausalLM": False,
    "Gemma3ForCausalLM": False,
    "Gemma4ForCausalLM": False,
    "Qwen3_5ForCausalLM": False,
    "Qwen3_5ForConditionalGeneration": False,
    "Qwen3_5MoeForCausalLM": False,
    "Qwen3_5MoeForConditionalGeneration": False,
    "Qwen3NextForCausalLM": False,
}

# hybrid linear-attention families (models/qwen3_5.py and the two built on it)
_HYBRID = qwen3_5.ARCHITECTURES + qwen3_5_moe.ARCHITECTURES + qwen3_next.ARCHITECTURES

__all__ = ["AttnMetadata", "LlamaConfig", "LlamaForCausalLM", "build_model", "context_limit",
           "check_engine_support"]


def _arch(config: dict) -> str:
    return (config.get("architectures") or ["?"])[0]


def model_config(config: dict) -> LlamaConfig:
    """The model config of an HF config dict (Gemma's carries its per-layer windows)."""
    arch = _arch(config)
    if arch not in _ARCHS:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(_ARCHS)}")
    if arch in gemma.ARCHITECTURES:
        return Gemma3Config.from_hf(config)
    if arch in gemma4.ARCHITECTURES:
        return Gemma4Config.from_hf(config)
    if arch in _HYBRID:
        return Qwen35Config.from_hf(config)
    return LlamaConfig.from_hf(config)


def check_engine_support(args, ckpt: Checkpoint | None, model) -> None:
    """Raises ValueError, before anything is built, for an engine feature (`args`) that the
    model (a checkpoint, or a model object) cannot run exactly."""
    arch = _arch(ckpt.config) if ckpt is not None else None
    if isinstance(model, Gemma4ForCausalLM) or arch in gemma4.ARCHITECTURES:
        gemma.check_engine_support(args, "Gemma 4")
        cfg = model.cfg if model is not None else model_config(ckpt.config)
        if cfg.kv_layer_shapes is not None and args.preemption_mode == "swap":
            raise ValueError("--preemption-mode swap is not supported for Gemma 4 models whose "
                             "global layers have another KV shape (global_head_dim)")
        if cfg.num_experts and args.expert_memory is not None:
            raise ValueError("--expert-memory (expert offload) is not supported for Gemma 4 "
                             "mixture-of-experts models")
    elif isinstance(model, Gemma3ForCausalLM) or arch in gemma.ARCHITECTURES:
        gemma.check_engine_support(args)
    elif isinstance(model, Qwen3_5ForCausalLM) or arch in _HYBRID:
        qwen3_5.check_engine_support(args)


def caches_prefixes(model) -> bool:
    """Whether prefix caching can serve this model: a hybrid model's cached KV would come
    without the linear-attention state after it (`qwen3_5.py`), so it runs without."""
    return not getattr(model, "has_state", False)


def runs_spec_prefill(model) -> bool:
    """Whether speculative prefill may shorten prompts for this model (target) or score them
    with it (draft); a Gemma 3 or 4 model can do neither (see `gemma.py`). None: no model."""
    return not isinstance(model, (Gemma3ForCausalLM, Qwen3_5ForCausalLM))


def context_limit(ckpt: Checkpoint | None, model, max_model_len: int | None) -> int:
    """The longest context to serve: `max_model_len`, or the model's own when None (its
    position limit, cut at a sliding window over every layer, past which this engine would
    not be exact; Gemma's per-layer windows are masked, so they cut nothing); more than the
    model's own is a ValueError. From `model.cfg` when a model object is given, else from the
    checkpoint's config."""
    cfg = model.cfg if model is not None else model_config(ckpt.config)
    native = cfg.max_position_embeddings
    if cfg.sliding_window:
        native = min(native, cfg.sliding_window)
    if max_model_len is None:
        return native
    if max_model_len > native:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context {native}")
    return max_model_len


def build_model(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                quantization: str = "auto", expert_offload=None) -> LlamaForCausalLM:
    """Builds the model on the meta device and loads each tensor straight onto `device`.
    `quantization`: auto (a GGUF keeps its quantized types, other checkpoints stay dense),
    none (everything dense in `dtype`), int8 / int4 (dense checkpoints quantized at load).
    `expert_offload`: an `expert_offload.ExpertOffload`, attached before the weights load."""
    arch, cfg = _arch(ckpt.config), model_config(ckpt.config)
    bias = _ARCHS[arch] or bool(ckpt.config.get("attention_bias", False))
    with torch.device("meta"):
        if arch == "Qwen3MoeForCausalLM":
            model = Qwen3MoeForCausalLM(cfg, MoeConfig.from_hf(ckpt.config), bias)
        elif arch in gemma.ARCHITECTURES:
            model = Gemma3ForCausalLM(cfg)
        elif arch in gemma4.ARCHITECTURES:
            model = Gemma4ForCausalLM(cfg)
        elif arch in qwen3_5.ARCHITECTURES:
            model = Qwen3_5ForCausalLM(cfg)
        elif arch in qwen3_5_moe.ARCHITECTURES:
            model = Qwen3_5MoeForCausalLM(cfg, *qwen3_5_moe.moe_config(ckpt.config))
        elif arch in qwen3_next.ARCHITECTURES:
            model = Qwen3NextForCausalLM(cfg, *qwen3_next.moe_config(ckpt.config))
        else:
            model = LlamaForCausalLM(cfg, bias=bias)
    if expert_offload is not None:
        expert_offload.attach(model, dtype, device, quantized_file=ckpt.source.endswith(
            ".gguf") and quantization == "auto")
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
    if isinstance(cfg, Gemma4Config):
        return gemma4.global_rope(cfg)
    if isinstance(cfg, Qwen35Config):
        return qwen3_5.rope_cache(cfg)
    return build_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                               cfg.rope_scaling)
