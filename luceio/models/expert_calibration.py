"""Expert placement for `--expert-placement`: `luceio calibrate-experts` counts each sparse
layer's routed experts over prompts (`count_experts`) and writes them most used first
(`placement`); `load_placement` reads such a file back for `expert_offload.ExpertOffload`."""
from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator

import torch

from ..kernels.moe import route_topk_ref
from .moe import SparseMoeBlock

PLACEMENT_FORMAT = "luceio-expert-placement/1"


def has_experts(model) -> bool:
    """Whether `model` has sparse layers of `SparseMoeBlock`s (Qwen3-MoE, Qwen3.5-MoE)."""
    moe = getattr(model, "moe_cfg", None)
    return moe is not None and all(isinstance(model.layers[i].mlp, SparseMoeBlock)
                                   for i in moe.sparse_layers)


@contextmanager
def count_experts(model) -> Iterator[dict[int, torch.Tensor]]:
    """While open, counts each sparse layer's routed (token, expert) pairs: layer -> int64
    [num_experts] counts, on the host. Routes each router output again, as the layer does."""
    if not has_experts(model):
        raise ValueError(f"{type(model).__name__} has no experts to calibrate")
    counts = {i: torch.zeros(model.moe_cfg.num_experts, dtype=torch.int64)
              for i in model.moe_cfg.sparse_layers}

    def hook(block: SparseMoeBlock, layer: int):
        def count(_module, _inputs, logits):
            _, ids = route_topk_ref(logits, block.top_k, block.renormalize)
            counts[layer] += torch.bincount(ids.flatten(), minlength=len(counts[layer])).cpu()
        return count

    handles = [model.layers[i].mlp.gate.register_forward_hook(hook(model.layers[i].mlp, i))
               for i in counts]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def placement(counts: dict[int, torch.Tensor], model: str | None) -> dict:
    """The placement file's content: per layer the experts by count, most used first (ties:
    lower id first), and the counts by expert id."""
    layers = {}
    for i, c in counts.items():
        order = sorted(range(len(c)), key=lambda e: (-int(c[e]), e))
        layers[str(i)] = {"experts": order, "counts": c.tolist()}
    num_experts = len(next(iter(counts.values())))
    return {"format": PLACEMENT_FORMAT, "model": model, "num_experts": num_experts,
            "layers": layers}


def load_placement(path: str, layers: tuple[int, ...], num_experts: int) -> dict[int, list[int]]:
    """A placement file's experts by count, per sparse layer; ValueError when it does not fit
    the model."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != PLACEMENT_FORMAT:
        raise ValueError(f"--expert-placement {path}: not a `luceio calibrate-experts` file")
    if data["num_experts"] != num_experts or sorted(map(int, data["layers"])) != list(layers):
        raise ValueError(f"--expert-placement {path}: made for another model ({data['num_experts']}"
                         f" experts, sparse layers {sorted(map(int, data['layers']))}; this one "
                         f"has {num_experts}, sparse layers {list(layers)})")
    out = {}
    for i in layers:
        order = data["layers"][str(i)]["experts"]
        if sorted(order) != list(range(num_experts)):
            raise ValueError(f"--expert-placement {path}: layer {i} does not list each expert "
                             "once")
        out[i] = order
    return out
