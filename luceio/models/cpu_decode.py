"""The CPU decode step: `LlamaForCausalLM.forward` for a batch in which every request decodes
one token, in a handful of calls per layer.

On two CPU threads a small model's decode step is mostly the fixed cost of small ops (~3 us
each, however few bytes they touch). SmolLM2-135M Q4_1's module forward runs ~100 per layer
(rotary ~25, the KV write 8 with a host sync, attention ~15, each re-deriving per-step facts
from the batch): of its 21.5 ms step, 8.8 ms were matmuls and the rest rms_norm 2.0, rotary 1.9,
KV write 0.9, attention 4.0, SiLU 0.5 and module glue 2.6. Here a layer is four matmuls and
four kernel calls (kernels/decode_cpu.py):

  add_rms_norm -> qkv_proj -> attention (q/k norm, rotary, KV write, attention:
  kernels/rows_attention_cpu.py, Gemma's sliding windows decode_cpu.decode_attention)
  -> o_proj -> add_rms_norm -> gate_up_proj -> silu_and_mul -> down_proj

and the step took ~10.5 ms: matmuls 4.8 + LM head 2.2, attention 1.1, norms and SiLU 0.4,
the matmuls' wrappers 0.6, this file's own Python 0.7, the engine 0.7. With every quantized
type in its own bits (qdot_cpu.py), Qwen2.5-Coder-0.5B Q4_K_M's step (60 cached tokens, two
threads) took 32.4 ms: gate_up 11.2, LM head 6.6, down 6.5 (q6_k 3.9, q4_k 2.6), q/k/v 2.5,
o 1.4, attention 1.2 (numba), SiLU 0.6,
norms 0.25, the rest Python and the engine. Projections whose parts
are in their own bits (qdot_cpu.py) write them side by side into an fp32 buffer kept per batch
size, from the fp32 buffer the kernel before wrote, numpy views passed along; other projections
(dense weights, int4-packed parts, batches on the dense path) run the module, in fp32. A
quantized token embedding is dequantized row by row by qdot_cpu.py, bit for bit as the module
does.

Measured against the alternatives on the same step (SmolLM2, one request, 100 cached tokens,
the LM head excluded, medians of interleaved runs): module forward 25.9 ms, the same step in
fused torch ops (per-step work hoisted, ~45 ops per layer, bit-exact) 17.2 ms, that fused step
under `torch.compile` (inductor, whole forward, dynamic shapes) 11.1 ms, this path 9.3 ms,
its matmuls alone 7.0 ms. The compiled step took 65 s to compile on these two cores (10 s from
inductor's cache; 167 s with `cpp_wrapper`, no faster), once more for batch sizes above one,
recompiled on shape guards, and broke graphs on the module path's host sync; numba compiles
these kernels in ~4 s once and caches them on disk.

Rules:
- The model runner sends a step here when every request has exactly one query token (or, in
  a verify step of draft chains or trees, a few: `VERIFY_ROWS`; trees not in stages nor on
  Gemma's step), the
  model runs in fp32 on the CPU, numba is installed, no `LUCEIO_KERNELS` asks for the torch
  references or the Triton kernels, and no probe (speculative prefill, residency scoring)
  needs the per-layer queries.
- Same arithmetic as the module forward, reduced in another order: hidden states agree to
  fp32 rounding on dense weights, and to the int16 roundings of the matmul inputs on quantized
  ones (tests/test_cpu_decode.py).
- It reads the model's parameters and the runner's KV cache; between steps it keeps only
  scratch buffers.
- A mixture-of-experts MLP (`moe.SparseMoeBlock`) runs its module forward.
- Gemma 3 (`gemma.py`) has a step of its own (`_gemma_step`): its (1 + w) norms are these
  kernels' norms with 1 + w as the weight, the post-attention and post-feedforward norms are
  norms without the add, the MLP is `gelu_tanh_and_mul`, and attention takes the layer's
  scale, sliding window and RoPE table. Other subclasses of it (Gemma 4) run their whole
  module forward.
"""
from __future__ import annotations

import numpy as np
import torch

from ..kernels import decode_cpu, half_cpu, qdot_cpu, rows_attention_cpu
from ..kernels.half_cpu import CpuHalf
from ..kernels.qdot_cpu import CpuQuant
from ..kernels.quant_cpu import dense_min_rows
from .gemma import Gemma3ForCausalLM
from .linear import Linear
from .llama import AttnMetadata, LlamaForCausalLM
from .moe import SparseMoeBlock

_EMPTY = np.zeros(0, np.float32)
VERIFY_ROWS = 64
"""The most query tokens a request may have in a step this path takes: a verify's drafts (a
chain, or a tree's nodes) and the token before them. Each row attends as a one-token request
whose keys end at its own cache index (a tree row: its ancestors among the step's rows); the
attention kernel (`kernels/rows_attention_cpu.py`) writes every row's K and V before it reads
any, and reads each key once for all of a request's rows."""


class CpuDecoder:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor | None],
                 layer_range: tuple[int, int] | None = None):
        """`layer_range` (a pipeline stage's layers, `stages/`): only those run; a stage after
        the first takes the (x, residual) pair the stage before handed on, and a stage before
        the last hands on its own, as `LlamaForCausalLM.forward` does with a layer range."""
        cfg = model.cfg
        self.model, self.num_heads, self.eps = model, cfg.num_heads, cfg.rms_norm_eps
        self.start, self.end = layer_range or (0, len(model.layers))
        self.gemma = type(model) is Gemma3ForCausalLM
        self.module_forward = isinstance(model, Gemma3ForCausalLM) and not self.gemma
        if self.module_forward:
            self.kv_caches = kv_caches
            return
        self.kv = [decode_cpu.as_numpy(kv) if kv is not None else None for kv in kv_caches]
        self.cos_sin = model.cos_sin.numpy()
        self.scale = cfg.head_dim ** -0.5
        self.layers = [_GemmaLayer(model.layers[i], model) if self.gemma
                       else _Layer(model.layers[i]) for i in range(self.start, self.end)]
        self.embed_rows = self._embed_rows(model.embed_tokens) if self.start == 0 else None
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, np.ndarray]] = {}
        w = model.norm.weight.float()
        self.final_norm = (1.0 + w if self.gemma else w).numpy()  # Gemma: 1 + w

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return decode_cpu.available() and dtype == torch.float32

    @staticmethod
    def takes(num_tokens: int, num_seqs: int, max_query_len: int = 1, prefill: bool = True,
              tree: bool = False) -> bool:
        """Whether this path runs a step, on the default kernels (`LUCEIO_KERNELS=torch|triton`
        asks for the torch references or the Triton kernels): one query token a request, or
        a verify step of draft chains or trees (no prompt tokens, up to `VERIFY_ROWS` a
        request; `tree`: the step has tree rows this decoder does not take, `trees`)."""
        from .. import kernels
        chains = not prefill and not tree and max_query_len <= VERIFY_ROWS
        return kernels.kernel_mode() == "auto" and (num_tokens == num_seqs or chains)

    @property
    def trees(self) -> bool:
        """Whether this decoder takes verify steps of draft trees (`rows_attention_cpu`): not
        Gemma's step (sliding windows) nor a module forward."""
        return not self.gemma and not self.module_forward

    @classmethod
    def for_stage(cls, model, kv_caches, layer_range: tuple[int, int]) -> "CpuDecoder | None":
        """The decoder of a pipeline stage's layers, or None where this path has no stage
        form (Gemma's own step and the module-forward models run the module)."""
        if isinstance(model, Gemma3ForCausalLM):
            return None
        return cls(model, kv_caches, layer_range)

    def __call__(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                 meta: AttnMetadata, hidden: tuple[torch.Tensor, torch.Tensor] | None = None):
        """fp32 hidden states [num_seqs, hidden] after the final norm, as `model.forward`; with
        a layer range, `hidden` in and (x, residual) out as there."""
        if self.module_forward:
            return self.model(input_ids, positions, self.kv_caches, meta)
        qdot_cpu.use_torch_threads()  # for attention; the matmuls ask too
        if self.gemma:
            return self._gemma_step(input_ids, positions, meta)
        batch = self._batch(positions, meta)
        if self.start == 0:
            residual = self._embed(input_ids)  # fp32 [num_seqs, hidden]
            x, add = residual.numpy(), False  # nothing to add before layer 0
        else:  # the next norm adds x to the residual handed on (its own copy: added in place)
            x, residual = hidden[0].numpy(), hidden[1].float().clone()
            add = True
        rows, width = residual.shape
        for i, layer in enumerate(self.layers, self.start):
            h = self._norm(x, residual, add, layer.input_norm, self._scratch(rows, width))
            attn = self._attend(layer, h, i, batch, self.cos_sin, self.scale, 0)
            h = self._norm(attn[1], residual, True, layer.post_norm, self._scratch(rows, width))
            x, add = self._mlp(layer, h, rows), True
        if self.end < len(self.model.layers):  # x leaves the scratch buffers (sent, not kept)
            return torch.from_numpy(x).clone(), residual
        out = torch.empty_like(residual)
        return self._norm(x, residual, True, self.final_norm, (out, out.numpy()))[0]

    def _gemma_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    meta: AttnMetadata) -> torch.Tensor:
        """Gemma 3's layers: input norm, attention, post-attention norm, + residual,
        pre-feedforward norm, GELU MLP, post-feedforward norm, + residual (each add done by
        the next norm's kernel), then the final norm."""
        batch = self._batch(positions, meta)
        residual = self.model._embed(input_ids).float().contiguous()  # its scale, as the model
        rows, hidden = residual.shape
        x = residual.numpy()  # what the next norm adds (nothing before layer 0)
        for i, layer in enumerate(self.layers, self.start):
            h = self._norm(x, residual, i > 0, layer.input_norm, self._scratch(rows, hidden))
            attn = self._attend(layer, h, i, batch, layer.cos_sin, layer.scale, layer.window)[1]
            post = self._norm(attn, attn, False, layer.post_attn_norm,
                              self._scratch(rows, hidden, 1))
            h = self._norm(post[1], residual, True, layer.pre_ff_norm, self._scratch(rows, hidden))
            gate_up = layer.gate_up(*h)
            act = self._scratch(rows, layer.down.lin.in_features)
            decode_cpu.gelu_tanh_and_mul(gate_up[1], act[1])
            down = layer.down(*act)[1]
            x = self._norm(down, down, False, layer.post_ff_norm, self._scratch(rows, hidden, 1))[1]
        out = torch.empty_like(residual)
        return self._norm(x, residual, True, self.final_norm, (out, out.numpy()))[0]

    def _batch(self, positions: torch.Tensor, meta: AttnMetadata) -> tuple:
        """(positions, slots, block tables, seq lens) as `decode_cpu`'s kernels read them, one
        entry a query row, then the step's `RowsAttention` plan (Gemma's sliding-window layers
        take `decode_cpu`'s kernels instead). A request's rows
        of a verify step attend as one-token requests would, row i of q up to its own cache
        index (seq_len - q + i + 1, causal), a tree's rows to their ancestors."""
        tables, seq_lens = meta.block_tables.numpy(), meta.seq_lens.numpy()
        num_seqs = len(seq_lens)
        row_starts = np.arange(num_seqs + 1)
        words = None
        if len(positions) != num_seqs:  # a verify step's rows (query starts from 0)
            row_starts = meta.query_start_loc.numpy()
            q_lens = np.diff(row_starts)
            seq = np.repeat(np.arange(num_seqs), q_lens)
            row = np.arange(len(seq)) - np.repeat(row_starts[:-1], q_lens)
            tables = tables[seq]
            seq_lens = (seq_lens[seq] - q_lens[seq] + row + 1).astype(np.int32)
            if meta.tree_mask is not None:
                if meta.tree_span:
                    raise ValueError("the CPU decode path takes no tree span")
                words = meta.tree_mask.numpy()
        kv = next(c for c in self.kv if c is not None)
        kvh, dim = kv.shape[3], kv.shape[4]
        plan = rows_attention_cpu.RowsAttention(
            row_starts, seq_lens, np.full(len(seq_lens), -1) if words is None else words,
            tables, self.num_heads, kvh, dim)
        return positions.numpy(), meta.slot_mapping.numpy(), tables, seq_lens, plan

    def _attend(self, layer, h, i: int, batch: tuple, cos_sin: np.ndarray, scale: float,
                window: int) -> tuple[torch.Tensor, np.ndarray]:
        """Layer i's QKV projection of h, the attention kernel (q/k norm, RoPE, KV write,
        attention), then its o projection."""
        positions, slots, tables, seq_lens, plan = batch
        qkv = layer.qkv(*h)
        o = self._scratch(h[0].shape[0], layer.o.lin.in_features)
        if plan is not None and not window:  # a request's rows read each key once
            plan(qkv[1], cos_sin, positions, self.kv[i], slots, *layer.qk_norm, self.eps, o[1],
                 scale)
            return layer.o(*o)
        args = (qkv[1], cos_sin, positions, self.kv[i], slots, tables, seq_lens, self.num_heads,
                *layer.qk_norm, self.eps, o[1], scale, window)
        splits = decode_cpu.attention_splits(seq_lens, window)
        if splits:  # long contexts on several threads
            decode_cpu.decode_attention_split(*args, splits)
        else:
            decode_cpu.decode_attention(*args)
        return layer.o(*o)

    def _mlp(self, layer: "_Layer", h: tuple[torch.Tensor, np.ndarray], rows: int) -> np.ndarray:
        if layer.moe is not None:  # experts run as in the module forward
            return layer.moe(h[0]).numpy()
        gate_up = layer.gate_up(*h)
        act = self._scratch(rows, layer.down.lin.in_features)
        decode_cpu.silu_and_mul(gate_up[1], act[1])
        return layer.down(*act)[1]

    @staticmethod
    def _embed_rows(emb) -> CpuQuant | None:
        """The quantized table's CPU form to dequantize rows from: the tied LM head's where
        the table lives there (`Embedding.table_in_head`), else views of it (no copy)."""
        if emb.table_in_head:
            return emb.head_part
        table = emb.qweight
        if table is None or table.qtype not in qdot_cpu.KINDS:
            return None
        return qdot_cpu.prepare(table, interleaved=False)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_rows is None:
            return self.model.embed_tokens(input_ids).float().contiguous()
        return qdot_cpu.dequantize_ids(self.embed_rows, input_ids)  # the table's rows

    def _norm(self, x: np.ndarray, residual, add: bool, weight: np.ndarray, out):
        """out (a (tensor, numpy view) pair) = the norm of residual (+= x). `residual`: a
        tensor or its numpy view (only read without `add`)."""
        res = residual if isinstance(residual, np.ndarray) else residual.numpy()
        decode_cpu.add_rms_norm(x, res, add, weight, self.eps, out[1])
        return out

    def _scratch(self, rows: int, cols: int, slot: int = 0) -> tuple[torch.Tensor, np.ndarray]:
        """An fp32 [rows, cols] buffer and its numpy view, reused from step to step (and within
        one: each is read by the matmul that follows before it is written again; `slot` keeps
        two buffers of one width apart)."""
        t, a = self._buffers.get((cols, slot), (None, None))
        if t is None or t.shape[0] != rows:
            t = torch.empty(rows, cols)
            t, a = self._buffers[cols, slot] = t, t.numpy()
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
        self.moe = layer.mlp if isinstance(layer.mlp, SparseMoeBlock) else None
        if self.moe is None:
            self.gate_up = _Projection(layer.mlp.gate_up_proj)
            self.down = _Projection(layer.mlp.down_proj)


class _GemmaLayer:
    """One Gemma 3 decoder layer's weights as the decode step reads them: its norms' scales as
    1 + w (fp32), its attention's scale, window and RoPE table."""

    def __init__(self, layer, model):
        def scale(norm):
            return (1.0 + norm.weight.float()).numpy()
        attn = layer.self_attn
        self.input_norm, self.post_attn_norm = scale(layer.input_layernorm), \
            scale(layer.post_attention_layernorm)
        self.pre_ff_norm, self.post_ff_norm = scale(layer.pre_feedforward_layernorm), \
            scale(layer.post_feedforward_layernorm)
        self.qk_norm = (scale(attn.q_norm), scale(attn.k_norm))
        self.scale, self.window = attn.scale, attn.window
        self.cos_sin = (model.cos_sin_local if attn.window else model.cos_sin).numpy()
        self.qkv, self.o = _Projection(attn.qkv_proj), _Projection(attn.o_proj)
        self.gate_up = _Projection(layer.mlp.gate_up_proj)
        self.down = _Projection(layer.mlp.down_proj)


class _Projection:
    """A `Linear` as the decode step calls it: (x, its numpy view) -> (y, its numpy view).
    Parts in their own bits (`CpuQuant`, 16-bit `CpuHalf`) write fp32 side by side into a buffer
    kept per batch size; everything else (dense fp32 weights, int4-packed parts, batches on the
    dense path) runs the module, in fp32."""

    def __init__(self, lin: Linear):
        self.lin = lin
        self.parts: list[CpuQuant | CpuHalf] = lin.parts \
            if lin.parts and all(isinstance(p, (CpuQuant, CpuHalf)) for p in lin.parts) else []
        self.kernels = [half_cpu.matvec if isinstance(p, CpuHalf) else qdot_cpu.matvec
                        for p in self.parts]
        self.min_rows = min([dense_min_rows(p) for p in self.parts
                             if isinstance(p, CpuQuant)], default=1 << 62 if self.parts else 0)
        self._outs: dict[int, tuple] = {}  # rows -> (y, its numpy view, one view per part)

    def __call__(self, x: torch.Tensor, x_np: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        rows = x.shape[0]
        if rows >= self.min_rows:  # (no parts: min_rows 0)
            y = self.lin(x)
            return y, y.numpy()
        y, y_np, outs = self._out(rows)
        for kernel, w, out in zip(self.kernels, self.parts, outs):
            kernel(x_np, w, out)
        if self.lin.bias is not None:
            y.add_(self.lin.bias)
        return y, y_np

    def _out(self, rows: int):
        if rows not in self._outs:
            y = torch.empty(rows, self.lin.out_features)
            ends = np.cumsum([0] + [w.shape[0] for w in self.parts])
            self._outs[rows] = (y, y.numpy(), [y.numpy()[:, a:b] for a, b in zip(ends, ends[1:])])
        return self._outs[rows]
