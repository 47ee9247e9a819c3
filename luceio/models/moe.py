"""Qwen3-MoE (transformers `qwen3_moe`): Qwen3's decoder with sparse mixture-of-experts MLPs.

Rules:
- Attention, norms, embeddings and LM head are Qwen3's (`llama.py`); only the MLP of a layer
  differs. Layer i is sparse when `num_experts > 0`, `(i + 1) % decoder_sparse_step == 0`
  and i is not in `mlp_only_layers`; the other layers keep the dense MLP of width
  `intermediate_size`. A sparse layer's experts have width `moe_intermediate_size`.
- Routing and the experts' arithmetic are `kernels/moe.py`'s (top-k of an fp32 softmax,
  `norm_topk_prob` renormalisation, tokens grouped by expert); the experts run through the
  `kernels.fused_moe` dispatcher (the grouped-GEMM Triton kernel on GPUs, the reference on CPU).
- Weights arrive under the HF Hub's per-expert names (`mlp.experts.{e}.gate_proj.weight`, ...,
  and the router `mlp.gate.weight`) and are stacked per layer: `w_gate_up`
  [num_experts, 2 * inter, hidden] ([gate | up] rows), `w_down` [num_experts, hidden, inter].
- Expert weights are dense in the model dtype, stacked, or, from a GGUF whose expert stacks are
  in a repacked type (Q4_K, Q8_0, ...), kept quantized: on the Triton kernels, with one qtype for every
  expert's gate/up and one for the downs, stacked per projection (`q_stacks`, read by
  `kernels/moe_quant_triton.py` at decode sizes and in CUDA graphs; `q_experts` are row views
  for steps of many tokens); otherwise expert by expert (`q_experts`, each projection through
  `kernels.linear`), reading the routing on the host each step (`kernels.moe.per_expert_moe`),
  so the model runs without CUDA graphs. `--quantization int8|int4` is refused for these models.
- Expert offload (`--expert-memory`, `expert_offload.py`): a layer given an `ExpertStore` before
  loading loads its dense experts into the store's host stacks (its `w_gate_up` / `w_down` are
  then the store's device slots), or hands its stacked quantized experts to the store at
  `finalize` (`q_stacks` are then the slots; other quantized layouts are refused). Steps read
  the experts in place (`expert_tables.py`) or run them in the store's rounds.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import kernels
from ..kernels.moe import DECODE_MAX_TOKENS, route_topk_ref
from .linear import Linear
from .llama import LlamaConfig, LlamaForCausalLM

if TYPE_CHECKING:
    from .expert_offload import ExpertStore

_EXPERT_WEIGHT = re.compile(
    r"(?:model\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]

    @classmethod
    def from_hf(cls, c: dict) -> "MoeConfig":
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"qwen3_moe with hidden_act {c['hidden_act']!r} is not supported "
                             "(the experts run SiLU-gated MLPs)")
        num_experts = c.get("num_experts") or c.get("num_local_experts") or 0
        step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(c["num_hidden_layers"])
                       if num_experts > 0 and (i + 1) % step == 0 and i not in dense)
        return cls(num_experts=num_experts, top_k=c["num_experts_per_tok"],
                   moe_intermediate_size=c["moe_intermediate_size"],
                   norm_topk_prob=bool(c.get("norm_topk_prob", False)), sparse_layers=sparse)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig):
        super().__init__()
        e, inter = moe.num_experts, moe.moe_intermediate_size
        self.num_experts, self.inter, self.hidden = e, inter, hidden_size
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self.gate = Linear(hidden_size, e)  # the router: one logit per expert
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * inter, hidden_size), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(e, hidden_size, inter), requires_grad=False)
        self._loaded: set[tuple[int, str]] = set()
        self._quantized: dict[tuple[int, str], object] = {}  # (expert, proj) -> QuantWeight
        self.q_experts: list | None = None  # quantized experts: [(gate_up, down)] per expert
        self.q_stacks: tuple | None = None  # their stacked GPU form (`_stack_quantized`)
        self.q_slots: list | None = None  # offloaded: (gate_up, down) views of each slot
        self.store: ExpertStore | None = None  # expert offload

    def offload(self, store: ExpertStore) -> None:
        """Keeps the experts in `store` (before the weights load): see the module docstring."""
        self.store = store

    def int8_input(self, rows: int, device: torch.device) -> dict:
        """No quantized one-row GEMV reads this block's input (see `MLP.int8_input`)."""
        return {}

    def decodes(self, x: torch.Tensor) -> bool:
        """Whether `x` takes the few-token path (`kernels/moe_decode_triton.py`; stacked
        quantized experts: `kernels/moe_quant_triton.py`, also every step inside a CUDA graph):
        dense experts (resident or offloaded) or stacked quantized ones on the Triton kernels."""
        if not kernels.use_triton(x) or (self.q_experts is not None and self.q_stacks is None):
            return False
        return x.shape[0] <= DECODE_MAX_TOKENS or (
            self.q_stacks is not None and x.is_cuda and torch.cuda.is_current_stream_capturing())

    def forward(self, x: torch.Tensor, xqs: dict | None = None, shared=None) -> torch.Tensor:
        """`shared`: (a shared expert's output, its gate logit), added as
        sigmoid(gate) * output (by the few-token path in its last launch)."""
        rounds = None
        in_place = self.store.in_place_for(x) if self.store is not None else None
        if self.decodes(x):
            from ..kernels.moe_decode_triton import moe_decode, route_topk
            weights, expert_ids = route_topk(self.gate(x), self.top_k, self.renormalize)
            if self.q_stacks is not None:
                from ..kernels.moe_quant_triton import moe_decode_quant
                if self.store is not None and in_place is None:
                    raise RuntimeError("offloaded quantized experts decode in place only "
                                       "(`ExpertOffload.start` sets the tables up)")
                return moe_decode_quant(x, *self.q_stacks, self.inter, weights, expert_ids,
                                        *(shared or (None, None)), in_place=in_place)
            if self.store is not None and in_place is None:
                rounds = self.store.rounds(expert_ids)
            return moe_decode(x, self.w_gate_up, self.w_down, weights, expert_ids,
                              *(shared or (None, None)), rounds=rounds, in_place=in_place)
        weights, expert_ids = route_topk_ref(self.gate(x), self.top_k, self.renormalize)
        if self.q_stacks is not None and self.store is not None:  # quantized, offloaded
            from ..kernels.moe import per_expert_moe
            routed = per_expert_moe(x, self.q_slots, weights, expert_ids, kernels.linear,
                                    rounds=self.store.rounds(expert_ids),
                                    num_experts=self.num_experts)
        elif self.q_experts is not None:
            from ..kernels.moe import per_expert_moe
            routed = per_expert_moe(x, self.q_experts, weights, expert_ids, kernels.linear)
        else:
            if self.store is not None and in_place is None:
                rounds = self.store.rounds(expert_ids)
            routed = kernels.fused_moe(x, self.w_gate_up, self.w_down, weights, expert_ids,
                                       rounds=rounds, in_place=in_place)
        return routed if shared is None else routed + torch.sigmoid(shared[1]) * shared[0]

    def load_expert(self, expert: int, proj: str, tensor, dtype: torch.dtype,
                    device: torch.device) -> None:
        """One expert's HF `gate_proj` / `up_proj` / `down_proj` weight, into the stacks."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has "
                             f"{self.num_experts} experts")
        stack = "w_down" if proj == "down_proj" else "w_gate_up"
        if not isinstance(tensor, torch.Tensor):  # a QuantWeight: kept quantized (`finalize`)
            want = (self.inter, self.hidden) if proj != "down_proj" else (self.hidden, self.inter)
            if tuple(tensor.shape) != want:
                raise ValueError(f"expert {expert} {proj}: shape {tuple(tensor.shape)}, "
                                 f"expected {want}")
            # offloaded: kept on the host until `finalize` hands them to the store
            self._quantized[expert, proj] = tensor.to(device if self.store is None else "cpu")
            self._loaded.add((expert, proj))
            self._dtype, self._device = dtype, torch.device(device)
            if getattr(self, stack).is_meta:  # no dense stack (so far): it takes no memory
                setattr(self, stack, nn.Parameter(torch.empty(0, dtype=dtype, device=device),
                                                  requires_grad=False))
            return
        if self.store is not None:
            if self.store.host_gate_up is None:
                self.store.allocate_dense(dtype)
                self.w_gate_up = nn.Parameter(self.store.slot_gate_up, requires_grad=False)
                self.w_down = nn.Parameter(self.store.slot_down, requires_grad=False)
            w_gate_up, w_down = self.store.host_gate_up, self.store.host_down
        else:  # each stack allocated when its first dense expert arrives
            if getattr(self, stack).is_meta or not getattr(self, stack).numel():
                shape = (self.num_experts, 2 * self.inter, self.hidden) if stack == "w_gate_up" \
                    else (self.num_experts, self.hidden, self.inter)
                setattr(self, stack, nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                                  requires_grad=False))
            w_gate_up, w_down = self.w_gate_up, self.w_down
        rows = {"gate_proj": slice(0, self.inter), "up_proj": slice(self.inter, None)}
        target = w_down[expert] if proj == "down_proj" else w_gate_up[expert, rows[proj]]
        if target.shape != tensor.shape:
            raise ValueError(f"expert {expert} {proj}: shape {tuple(tensor.shape)}, expected "
                             f"{tuple(target.shape)}")
        target.copy_(tensor)
        self._loaded.add((expert, proj))

    def finalize(self) -> None:
        """Checks that every expert's three weights arrived; places the pinned ones."""
        expected = 3 * self.num_experts
        if len(self._loaded) != expected:
            raise KeyError(f"checkpoint has {len(self._loaded)} of the {expected} expert weights "
                           "of a mixture-of-experts layer")
        self._loaded = set()
        if self._quantized:
            self._keep_quantized()
        if self.store is not None:
            self.store.place_pinned()

    def _keep_quantized(self) -> None:
        """Per expert (gate_up, down) in the device's quantized forms; dense projections of the
        same layer (a file may quantize some stacks only) stay slices of the stacks."""
        from ..kernels.quant import cat_rows
        if self.store is not None and self._offload_quantized():
            return
        dtype = self._dtype
        q, experts = self._quantized, []
        if self._stack_quantized():
            return
        for e in range(self.num_experts):
            gate, up, down = (q.get((e, p)) for p in ("gate_proj", "up_proj", "down_proj"))
            if gate is not None and up is not None and gate.qtype == up.qtype:
                gate_up = kernels.prepare_weight(cat_rows([gate, up]), dtype)
            else:
                gate_up = tuple(kernels.prepare_weight(w, dtype) if w is not None else
                                self.w_gate_up[e, rows]
                                for w, rows in ((gate, slice(0, self.inter)),
                                                (up, slice(self.inter, None))))
            down = kernels.prepare_weight(down, dtype) if down is not None else self.w_down[e]
            experts.append((gate_up, down))
        self.q_experts, self._quantized = experts, {}

    def _offload_quantized(self) -> bool:
        """Hands the layer's quantized experts, stacked, to its store (`hold_quantized`), the
        stacks' device slots becoming `q_stacks`. Returns False when every expert fits the
        budget: the store is dropped and the experts stay resident. Raises ValueError for
        layouts the in-place kernels cannot read."""
        stacks = self._plain_stacks()
        if stacks is None:
            kinds = sorted({getattr(self._quantized.get((e, p)), "qtype", "dense")
                            for e in range(self.num_experts)
                            for p in ("gate_proj", "up_proj", "down_proj")})
            raise ValueError(
                "--expert-memory with quantized experts needs the Triton kernels (a GPU) and "
                "every expert's gate and up in one quantized type and its down in one; layer "
                f"{self.store.layer} has {', '.join(kinds)} experts on {self._device}")
        if not self.store.hold_quantized(*stacks):
            self.store = None
            self._quantized = {k: w.to(self._device) for k, w in self._quantized.items()}
            return False
        self.q_stacks = (self.store.slot_gate_up, self.store.slot_down)
        self.q_slots = [(_rows(self.q_stacks[0], s, 2 * self.inter),
                         _rows(self.q_stacks[1], s, self.hidden))
                        for s in range(self.store.num_slots)]
        self._quantized = {}
        return True

    def _plain_stacks(self) -> tuple | None:
        """(gate_up [E * 2 * inter, hidden], down [E * hidden, inter]): every expert's
        projections stacked row-wise in expert order, when the Triton kernels run and every
        expert has gate, up (one qtype) and down (one qtype, maybe another) quantized; else
        None."""
        from ..kernels.quant import cat_rows
        q, e_all = self._quantized, range(self.num_experts)
        ws = [[q.get((e, p)) for e in e_all] for p in ("gate_proj", "up_proj", "down_proj")]
        if any(w is None for row in ws for w in row) or not kernels.use_triton(self._device) \
                or ws[0][0].qtype != ws[1][0].qtype \
                or any(w.qtype != row[0].qtype for row in ws for w in row):
            return None
        return cat_rows([w for e in e_all for w in (ws[0][e], ws[1][e])]), cat_rows(ws[2])

    def _stack_quantized(self) -> bool:
        """On the Triton kernels, when every expert has gate, up (one qtype) and down (one
        qtype, maybe another) quantized: each projection's experts stacked row-wise into one
        weight (`q_stacks`: gate_up [E * 2 * inter, hidden], down [E * hidden, inter]) for
        `kernels/moe_quant_triton.py`, the per-expert weights (`q_experts`, for steps of many
        tokens) row views of the stacks, so the experts are held once. Returns whether it did;
        other layouts keep per-expert weights only (and the model its eager decode)."""
        stacks = self._plain_stacks()
        if stacks is None:
            return False
        gate_up, down = (kernels.prepare_weight(w, self._dtype) for w in stacks)
        self.q_stacks = (gate_up, down)
        self.q_experts = [(_rows(gate_up, e, 2 * self.inter), _rows(down, e, self.hidden))
                          for e in range(self.num_experts)]
        self._quantized = {}
        return True

    def quantized_bytes(self) -> int:
        """Bytes of the experts kept quantized (not parameters, so not in `parameters()`)."""
        if self.q_stacks is not None:  # per-expert weights are views of them
            return sum(kernels.weight_nbytes(w) for w in self.q_stacks)
        if self.q_experts is None:
            return 0
        seen, total = set(), 0
        for gate_up, down in self.q_experts:
            for w in (*(gate_up if isinstance(gate_up, tuple) else (gate_up,)), down):
                if not isinstance(w, torch.Tensor) and id(w) not in seen:
                    seen.add(id(w))
                    total += kernels.weight_nbytes(w)
        return total


class ExpertLoading:
    """Loading and accounting of a model whose `moe_cfg.sparse_layers` hold `SparseMoeBlock`s,
    mixed in before its dense model class: the experts' tensors are taken out of the weight
    stream into the blocks (`take_experts`, at `LlamaForCausalLM._route_weights`, after the
    model's own name mapping), the rest loads as the model loads it."""

    def _route_weights(self, weights, dtype: torch.dtype, device: torch.device):
        return take_experts(self, super()._route_weights(weights, dtype, device), dtype, device)

    def load_weights(self, weights, dtype: torch.dtype | None = None,
                     device: torch.device | str = "cpu", quantize: str | None = None,
                     **kwargs) -> None:
        if quantize:
            raise ValueError(f"--quantization {quantize}: mixture-of-experts models load dense "
                             "for now")
        super().load_weights(weights, dtype, device, **kwargs)
        for i in self.moe_cfg.sparse_layers:
            self.layers[i].mlp.finalize()

    def weight_types(self) -> list[str]:
        return sorted(set(super().weight_types()) | expert_kinds(self))

    def weight_bytes(self) -> int:
        return super().weight_bytes() + quantized_expert_bytes(self)


class Qwen3MoeForCausalLM(ExpertLoading, LlamaForCausalLM):
    def __init__(self, cfg: LlamaConfig, moe: MoeConfig, bias: bool = False):
        super().__init__(cfg, bias)
        self.moe_cfg = moe
        for i in moe.sparse_layers:
            self.layers[i].mlp = SparseMoeBlock(cfg.hidden_size, moe)


def take_experts(model, weights, dtype: torch.dtype, device: torch.device):
    """Loads the expert tensors into `model`'s sparse blocks (`model.moe_cfg.sparse_layers`,
    `model.layers[i].mlp`) as they stream by; yields every other tensor."""
    for name, tensor in weights:
        match = _EXPERT_WEIGHT.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        layer, expert, proj = int(match[1]), int(match[2]), match[3]
        if layer not in model.moe_cfg.sparse_layers:
            raise KeyError(f"unexpected weight {name!r}: layer {layer} is dense")
        model.layers[layer].mlp.load_expert(expert, proj, tensor, dtype, device)


def expert_kinds(model) -> set[str]:
    """The types `model`'s experts are stored in (dense stacks, quantized experts)."""
    kinds = set()
    for i in model.moe_cfg.sparse_layers:
        block = model.layers[i].mlp
        if block.q_experts is None:
            kinds.add(kernels.weight_kind(block.w_gate_up))
            continue
        for gate_up, down in block.q_experts:
            for w in (*(gate_up if isinstance(gate_up, tuple) else (gate_up,)), down):
                kinds.add(kernels.weight_kind(w))
    return kinds


def quantized_expert_bytes(model) -> int:
    return sum(model.layers[i].mlp.quantized_bytes() for i in model.moe_cfg.sparse_layers)


def routes_on_host(model) -> bool:
    """Whether a forward of `model` reads expert routing on the host (quantized experts that
    could not be stacked, or a block that says so, `host_routing`: Gemma 4's torch experts);
    such models run without CUDA graphs."""
    return any((isinstance(m, SparseMoeBlock) and m.q_experts is not None
                and m.q_stacks is None)
               or getattr(m, "host_routing", False) for m in model.modules())


def _rows(w, e: int, n: int):
    """Rows e * n ... (e + 1) * n of a quantized weight: views of its arrays."""
    from dataclasses import replace
    return replace(w, shape=(n, w.shape[1]),
                   **{name: t[e * n:(e + 1) * n] for name, t in w.tensors().items()})
