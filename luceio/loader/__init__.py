"""Checkpoint readers. Every format becomes one `Checkpoint`: an HF-style config dict, weights
under HF tensor names (`model.layers.0.self_attn.q_proj.weight`, ...), and the tokenizer
pieces. The model and tokenizer code only ever see this convention."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch


@dataclass
class Checkpoint:
    config: dict
    """HF `config.json` contents (architectures, hidden_size, rope parameters, ...)."""
    weights: Callable[..., Iterator[tuple[str, object]]]
    """`weights(keep_quantized=False)` yields (HF tensor name, tensor) pairs; called once at
    load. With `keep_quantized`, a GGUF's quantized tensors come as `kernels.quant.QuantWeight`
    (repacked, not dequantized) and only the others as dense tensors."""
    tokenizer: object | None = None
    """A `tokenizers.Tokenizer`, a sentencepiece processor path, or None (token ids only)."""
    tokenizer_config: dict = field(default_factory=dict)
    """HF `tokenizer_config.json` contents: chat_template, bos_token, eos_token, ..."""
    generation_config: dict = field(default_factory=dict)
    """HF `generation_config.json` contents: eos_token_id, ..."""
    source: str = ""


def load_checkpoint(path: str) -> Checkpoint:
    """Opens an HF checkpoint folder or a `.gguf` file (after name resolution)."""
    if os.path.isdir(path):
        from .hf import load_hf_folder
        return load_hf_folder(path)
    if path.endswith(".gguf") and os.path.isfile(path):
        from .gguf import load_gguf
        return load_gguf(path)
    raise FileNotFoundError(f"no HF checkpoint folder or .gguf file at {path!r}")
