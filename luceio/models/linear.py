"""Linear and embedding layers whose weights are dense or quantized.

A `Linear` is loaded shard by shard (fused projections: q/k/v, gate/up), then `finalize`d into
one or more row segments ("parts"), each a dense tensor in the model dtype or a `QuantWeight`
kept in its file's quantized type. Consecutive shards of one type are concatenated into one
part (one kernel); a fused projection whose shards differ in type (a Q4_K_M file stores some
`attn_v` in Q6_K and `attn_q`/`attn_k` in Q4_K) runs one kernel per part and concatenates the
outputs. Quantized parts are never cast: `Module.to(dtype)` would turn their fp16 scales into
bf16, so `finalize` places them on the device itself and the model's `to()` sees no quantized
tensor (they are plain attributes, not parameters or buffers).

An `Embedding` with a quantized table gathers the rows of the tokens in the batch and
dequantizes only those.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .. import kernels
from ..kernels import half_cpu
from ..kernels.quant import QuantWeight


def _is_dense(w) -> bool:
    return isinstance(w, torch.Tensor)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_sizes: list[int] | int, bias: bool = False):
        super().__init__()
        self.out_sizes = [out_sizes] if isinstance(out_sizes, int) else list(out_sizes)
        self.in_features, self.out_features = in_features, sum(self.out_sizes)
        # dense until a quantized shard is loaded (built directly, e.g. random benchmark models)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) \
            if bias else None
        self.parts: list = []  # quantized: [QuantWeight | dense tensor | backend-packed form]
        self._shards: dict[int, object] = {}

    # loading -----------------------------------------------------------------------------------
    def load_shard(self, shard: int, value, dtype: torch.dtype, device: torch.device,
                   quantize: str | None = None) -> None:
        """Shard `shard` of `out_sizes`: a dense [rows, in] tensor or a QuantWeight. It moves
        to `device` at once (a model never sits whole in host memory); the parts are built when
        the last shard arrives. `quantize` (int8|int4) quantizes a dense shard whose input size
        allows it (a multiple of 32)."""
        from ..kernels import quant
        rows = self.out_sizes[shard]
        shape = tuple(value.shape)
        if shape != (rows, self.in_features):
            raise ValueError(f"shard {shard} has shape {shape}, expected {(rows, self.in_features)}")
        if not _is_dense(value):
            value = value.to(device)
        elif quantize and self.in_features % 32 == 0:
            value = quant.quantize_rtn(value.to(device), quantize)
        elif half_cpu.keeps(value, dtype, device):  # bf16 / fp16 for an fp32 CPU model: as is
            value = value.to(device)
        else:
            value = value.to(device, dtype)
        self._shards[shard] = value
        if len(self._shards) == len(self.out_sizes):
            self._build(dtype)

    def finalize(self) -> None:
        """Checks that every shard arrived."""
        if self._shards or (self.weight is not None and self.weight.is_meta):
            missing = [i for i in range(len(self.out_sizes)) if i not in self._shards]
            raise KeyError(f"shards {missing} of a {self.out_sizes} projection were never loaded")

    def _build(self, dtype: torch.dtype) -> None:
        from ..kernels import quant
        shards = [self._shards[i] for i in range(len(self.out_sizes))]
        self._shards = {}
        if len({s.dtype for s in shards if _is_dense(s) and s.dtype != dtype}) > 1:
            shards = [s.to(dtype) if _is_dense(s) else s for s in shards]  # bf16 and fp16 mixed
        if all(_is_dense(s) for s in shards) and shards[0].dtype == dtype:
            self.weight = nn.Parameter(torch.cat(shards) if len(shards) > 1 else shards[0],
                                       requires_grad=False)
            self.parts = []
            return
        groups: list[list] = []
        for s in shards:  # runs of one type become one part
            if groups and _same_kind(groups[-1][-1], s):
                groups[-1].append(s)
            else:
                groups.append([s])
        self.parts = [_dense_part(torch.cat(g), dtype) if _is_dense(g[0]) else
                      kernels.prepare_weight(quant.cat_rows(g) if len(g) > 1 else g[0], dtype)
                      for g in groups]
        self.weight = None

    def share_parts(self, other: "Linear | Embedding") -> None:
        """Tied weights: use another layer's weight (dense parameter or quantized parts)."""
        if isinstance(other, Embedding) and other.head_part is not None:
            self.weight = None
            self.parts = [other.head_part]
        else:
            self.weight = other.weight
            self.parts = []

    # forward -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, xqs: dict | None = None, tail=None) -> torch.Tensor:
        """`xqs`: x's int8 forms for the quantized GEMV, made by x's producer (`int8_input`).
        `tail`: the op after this projection (`kernels.glu_tail`, `norm_tail`), done by one
        quantized part's GEMV where it can (`tail.done`)."""
        if not self.parts:
            return kernels.linear(x, self.weight, self.bias)
        if len(self.parts) == 1:
            return kernels.linear(x, self.parts[0], self.bias, xqs=xqs, tail=tail)
        return kernels.linear_parts(x, self.parts, self.bias, xqs=xqs)

    def silu_and_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu_and_mul(gate_up)) for gate_up [..., 2 * in_features] as [gate | up]: one
        launch where the dense GEMV runs (`kernels.silu_and_mul_linear`)."""
        if not self.parts:
            return kernels.silu_and_mul_linear(gate_up, self.weight, self.bias)
        return self(kernels.silu_and_mul(gate_up))

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor, glu: bool = False) -> tuple:
        """(self(x), residual) (glu: of silu_and_mul(x)) for the projection before a norm, or
        (kernels.Summed, None) where the dense GEMV adds the residual in its epilogue
        (`kernels.linear_add`)."""
        if not self.parts:
            return kernels.linear_add(x, self.weight, self.bias, residual, glu)
        return self.silu_and_mul_forward(x) if glu else self(x), residual

    def int8_input(self, rows: int, device: torch.device) -> dict:
        """Buffers for the int8 forms of a [rows, in_features] input that this layer's
        quantized GEMV reads, for the kernel producing that input to fill; {} when no such
        GEMV runs (see `kernels.gemv_input_buffers`)."""
        return kernels.gemv_input_buffers(self.parts, rows, self.in_features, device)

    @property
    def quantized(self) -> bool:
        return bool(self.parts)

    def weight_bytes(self) -> int:
        if not self.parts:
            return self.weight.numel() * self.weight.element_size()
        return sum(kernels.weight_nbytes(p) for p in self.parts)

    def extra_repr(self) -> str:
        kinds = [kernels.weight_kind(p) for p in self.parts] or [str(self.weight.dtype)]
        return f"in={self.in_features}, out={self.out_sizes}, weights={'+'.join(kinds)}"


def _same_kind(a, b) -> bool:
    if _is_dense(a) or _is_dense(b):
        return _is_dense(a) and _is_dense(b) and a.dtype == b.dtype
    return a.qtype == b.qtype


def _dense_part(w: torch.Tensor, dtype: torch.dtype):
    """A dense part: in the model dtype, or a kept 16-bit one's `half_cpu.CpuHalf`."""
    return w if w.dtype == dtype else half_cpu.prepare(w, dtype)


class Embedding(nn.Module):
    """Token embeddings: a dense table, or a quantized one whose rows are dequantized on use
    (a 16-bit table kept by an fp32 CPU model: widened on use)."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.num_embeddings, self.dim = num_embeddings, dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)
        self.qweight: QuantWeight | None = None
        self.head_part = None  # the tied LM head's form of the quantized (or 16-bit) table
        self.out_dtype = torch.float32
        self.widened = False  # a bf16 / fp16 table kept for an fp32 model (half_cpu.keeps)

    def load(self, value, dtype: torch.dtype, device: torch.device, tied: bool) -> None:
        if _is_dense(value):
            keep = self.widened = half_cpu.keeps(value, dtype, device)  # widened on use (exact)
            self.weight = nn.Parameter(value.to(device, None if keep else dtype),
                                       requires_grad=False)
            self.out_dtype = dtype
            if keep and tied:  # the LM head reads the same 16-bit table
                self.head_part = half_cpu.prepare(self.weight.data, dtype)
            return
        self.qweight, self.out_dtype, self.weight = value.to(device), dtype, None
        if tied:
            self.head_part = kernels.prepare_weight(self.qweight, dtype)
            if isinstance(self.head_part, QuantWeight):  # the GPU form: one copy for both uses
                self.qweight = self.head_part
            elif getattr(self.head_part, "interleaved", False):  # the CPU head's own copy
                self.qweight = None  # (qdot_cpu.interleave): rows read from it, one copy

    @property
    def table_in_head(self) -> bool:
        """Whether the quantized table lives only in the tied LM head's CPU form (rows
        interleaved by 4, `qdot_cpu.interleave`): its rows are dequantized from there."""
        return self.qweight is None and self.weight is None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table_in_head:  # equal bit for bit to `dequantize` (qdot_cpu.dequantize_rows)
            from ..kernels import qdot_cpu
            return qdot_cpu.dequantize_ids(self.head_part, ids).to(self.out_dtype)
        if self.qweight is None:
            rows = nn.functional.embedding(ids, self.weight)
            return rows.to(self.out_dtype) if self.widened else rows
        from ..kernels.quant import dequantize, permute_rows
        return dequantize(permute_rows(self.qweight, ids)).to(self.out_dtype)

    def weight_bytes(self) -> int:
        if self.table_in_head:
            return kernels.weight_nbytes(self.head_part)
        if self.qweight is None:
            return self.weight.numel() * self.weight.element_size()
        from ..kernels.quant import nbytes
        head, extra = self.head_part, 0  # not the GPU's own form, nor views of the table
        if head is not None and head is not self.qweight:
            extra = kernels.weight_nbytes(head)
            if getattr(head, "arrays", None) is not None:  # a CPU form: its own arrays only
                fields = (getattr(self.qweight, f) for f in ("qs", "qh", "d", "m", "sc", "mn"))
                table = [t.numpy() for t in fields if t is not None]
                extra = sum(a.nbytes for a in head.arrays
                            if not any(np.may_share_memory(a, t) for t in table))
        return nbytes(self.qweight) + extra
