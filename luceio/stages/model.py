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


def kv_budget_error(args, device: torch.device, rank: int) -> str | None:
    """Why this stage's weights and KV pool, both in place, break --gpu-memory-utilization on
    its own GPU, or None. The rule is the runner's (the fraction of the device, less what is
    in use, less 1 GiB of headroom for activations); stage 0's runner sizes the pool under it,
    and every other stage checks its own device here. A pool fixed by --num-kv-blocks or
    --kv-cache-memory is the user's choice and is not checked."""
    if device.type != "cuda" or args.num_kv_blocks or args.kv_cache_memory:
        return None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    allowed = int(total * args.gpu_memory_utilization) - (1 << 30)
    if total - free <= allowed:
        return None
    return (f"stage {rank} on {device}: its weights and KV pool ({(total - free) / 2**30:.2f} "
            f"GiB in use on the device) exceed --gpu-memory-utilization "
            f"{args.gpu_memory_utilization} of {total / 2**30:.1f} GiB less 1 GiB of headroom; "
            "raise it, or give this stage fewer layers (--layer-split)")
