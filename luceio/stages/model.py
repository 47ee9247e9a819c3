"""A stage's share of the model: its decoder layers' weights and its layers' KV pool."""
from __future__ import annotations

import torch
from torch import nn


def keep_layers(model: nn.Module, layer_range: tuple[int, int], rank: int) -> None:
    """Frees the weights of the layers other stages run. The embedding and the LM head stay with
    stage 0 (which embeds and computes the logits), the final norm with the last stage (the
    model's forward applies it after the last layer)."""
    start, end = layer_range
    for i in range(len(model.layers)):
        if not start <= i < end:
            model.layers[i] = nn.Module()
    if rank > 0:
        model.embed_tokens = None
        model.lm_head = None


def stage_kv_caches(cfg, layer_range: tuple[int, int], num_blocks: int, block_size: int,
                    dtype: torch.dtype, device: torch.device) -> list[torch.Tensor | None]:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] cache per layer of the stage,
    None for the others: the model indexes the list by layer number."""
    from ..memory import zeros_pool
    start, end = layer_range
    pool = zeros_pool((end - start, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
                      dtype, device)
    return [None] * start + list(pool) + [None] * (cfg.num_layers - end)
