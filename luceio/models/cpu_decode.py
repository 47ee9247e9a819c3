"""The CPU decode step: `LlamaForCausalLM.forward` for a batch in which every request decodes
one token, in a handful of calls per layer.

On two CPU threads a small model's decode step is mostly the fixed cost of small ops (~3 us
each, however few bytes they touch). SmolLM2-135M Q4_1's module forward runs ~100 per layer
(rotary ~25, the KV write 8 with a host sync, attention ~15, each re-deriving per-step facts
from the batch): of its 21.5 ms step, 8.8 ms were matmuls and the rest rms_norm 2.0, rotary 1.9,
KV write 0.9, attention 4.0, SiLU 0.5 and module glue 2.6. Here a layer is four matmuls and
four kernel calls (kernels/decode_cpu.py):

  add_rms_norm -> qkv_proj -> decode_attention (q/k norm, rotary, KV write, attention)
  -> o_proj -> add_rms_norm -> gate_up_proj -> silu_and_mul -> down_proj

and the step takes ~10.5 ms: matmuls 4.8 + LM head 2.2, attention 1.1, norms and SiLU 0.4,
the matmuls' wrappers 0.6, this file's own Python 0.7, the engine 0.7. Projections stored as
packed CPU weights (quant_cpu.py) take their input as the bf16 the kernel before them wrote and
hand back bf16, which the next kernel reads as is: the conversions the module path does around
each matmul are folded into the kernels. Other projections (dense weights, batches on the dense
path) run the module, in fp32.

Measured against the alternatives on the same step (SmolLM2, one request, 100 cached tokens,
the LM head excluded, medians of interleaved runs): module forward 25.9 ms, the same step in
fused torch ops (per-step work hoisted, ~45 ops per layer, bit-exact) 17.2 ms, that fused step
under `torch.compile` (inductor, whole forward, dynamic shapes) 11.1 ms, this path 9.3 ms,
its matmuls alone 7.0 ms. The compiled step took 65 s to compile on these two cores (10 s from
inductor's cache; 167 s with `cpp_wrapper`, no faster), once more for batch sizes above one,
recompiled on shape guards, and broke graphs on the module path's host sync; numba compiles
these kernels in ~4 s once and caches them on disk.

Rules:
- The model runner sends a step here when every request has exactly one query token, the
  model runs in fp32 on the CPU, numba is installed, no `LUCEIO_KERNELS` asks for the torch
  references or the Triton kernels, and no probe (speculative prefill, residency scoring)
  needs the per-layer queries.
- Same arithmetic as the module forward, reduced in another order: hidden states agree to
  fp32 rounding on dense weights, and to the bf16 roundings of the matmul inputs on packed
  ones (tests/test_cpu_decode.py).
- It reads the model's parameters and the runner's KV cache; between steps it keeps only
  scratch buffers.
"""
from __future__ import annotations

import numpy as np
import torch

from ..kernels import decode_cpu
from ..kernels.decode_cpu import as_numpy
from ..kernels.quant_cpu import CpuPacked, packed_mm, takes_dense_path
from .linear import Linear
from .llama import AttnMetadata, LlamaForCausalLM

_EMPTY = np.zeros(0, np.float32)


class CpuDecoder:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor]):
        cfg = model.cfg
        self.model, self.num_heads, self.eps = model, cfg.num_heads, cfg.rms_norm_eps
        self.kv = [kv.numpy() for kv in kv_caches]
        self.cos_sin = model.cos_sin.numpy()
        self.layers = [_Layer(layer) for layer in model.layers]
        self._buffers: dict[tuple, tuple[torch.Tensor, np.ndarray]] = {}

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return decode_cpu.available() and dtype == torch.float32

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttnMetadata) -> torch.Tensor:
        """fp32 hidden states [num_seqs, hidden] after the final norm, as `model.forward`."""
        positions, slots = positions.numpy(), meta.slot_mapping.numpy()
        tables, seq_lens = meta.block_tables.numpy(), meta.seq_lens.numpy()
        residual = self.model.embed_tokens(input_ids).float().contiguous()  # [num_seqs, hidden]
        rows = residual.shape[0]
        x = residual  # what the next norm adds to the residual (nothing before layer 0)
        for i, layer in enumerate(self.layers):
            h = self._norm(x, residual, i > 0, layer.input_norm, self._scratch(
                rows, residual.shape[1], layer.qkv.input_dtype))
            qkv = layer.qkv(h)
            o, o_np = self._scratch(rows, layer.o.lin.in_features, layer.o.input_dtype)
            decode_cpu.decode_attention(as_numpy(qkv), self.cos_sin, positions, self.kv[i], slots,
                                        tables, seq_lens, self.num_heads, *layer.qk_norm,
                                        self.eps, o_np)
            h = self._norm(layer.o(o), residual, True, layer.post_norm, self._scratch(
                rows, residual.shape[1], layer.gate_up.input_dtype))
            gate_up = layer.gate_up(h)
            act, act_np = self._scratch(rows, layer.down.lin.in_features, layer.down.input_dtype)
            decode_cpu.silu_and_mul(as_numpy(gate_up), act_np)
            x = layer.down(act)
        out = torch.empty_like(residual)
        return self._norm(x, residual, True, self.model.norm.weight.numpy(), (out, out.numpy()))

    def _norm(self, x, residual, add: bool, weight: np.ndarray, out) -> torch.Tensor:
        decode_cpu.add_rms_norm(as_numpy(x), residual.numpy(), add, weight, self.eps, out[1])
        return out[0]

    def _scratch(self, rows: int, cols: int, dtype) -> tuple[torch.Tensor, np.ndarray]:
        """A [rows, cols] buffer and its numpy view, reused from step to step (and within one:
        each is read by the matmul that follows before it is written again)."""
        t, a = self._buffers.get((cols, dtype), (None, None))
        if t is None or t.shape[0] != rows:
            t = torch.empty(rows, cols, dtype=dtype)
            t, a = self._buffers[cols, dtype] = t, as_numpy(t)
        return t, a


class _Layer:
    """One decoder layer's weights as the decode step reads them."""

    def __init__(self, layer):
        attn = layer.self_attn
        self.input_norm = layer.input_layernorm.weight.numpy()
        self.post_norm = layer.post_attention_layernorm.weight.numpy()
        self.qk_norm = (attn.q_norm.weight.numpy(), attn.k_norm.weight.numpy()) \
            if attn.q_norm is not None else (_EMPTY, _EMPTY)
        self.qkv, self.o = _Projection(attn.qkv_proj), _Projection(attn.o_proj)
        self.gate_up, self.down = _Projection(layer.mlp.gate_up_proj), _Projection(layer.mlp.down_proj)


class _Projection:
    """A `Linear` as the decode step calls it: packed CPU weights straight through the packed
    kernel (bf16 in, bf16 out, fp32 once a bias is added); dense weights and batches on the
    dense path through the module (fp32 out)."""

    def __init__(self, lin: Linear):
        self.lin = lin
        packed = bool(lin.parts) and all(isinstance(p, CpuPacked) for p in lin.parts)
        self.parts: list[CpuPacked] = lin.parts if packed else []
        self.input_dtype = torch.bfloat16 if packed else torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.parts or any(takes_dense_path(x.shape[0], w) for w in self.parts):
            return self.lin(x)
        outs = [packed_mm(x, w)[:, :w.shape[0]] for w in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y if self.lin.bias is None else y + self.lin.bias
