"""CUDA graphs of one pipeline stage's layers, for plain decode steps.

An eager decode step launches every kernel from Python; on the H200 that is ~15 ms of host
time for a 1.5B model against ~1.2 ms of GPU work, so a staged step without graphs ran at 0.06x
of one graphed GPU (bench/results/h200/stages_bench_one_gpu.json). Each stage on a CUDA device
captures its own layers here, a graph per batch bucket as `cuda_graphs.StepGraphs` does for a
whole model (the same buckets and padding: a padded request writes no KV and its rows are
dropped), with one token a request only: prefill chunks, verify steps and trees stay eager, and
so do runs cut into micro-batches (`--stage-micro-batches` > 1).
- Stage 0 (the engine's runner): the graph embeds the step's ids and runs the stage's layers;
  it is queued first, and the step's message is packed from the host batch while it runs
  (`StageGroup.forward(..., first=)`); nothing of the step is staged for eager layers.
- Every other stage (`worker._serve`): the graph reads the received hidden states from static
  buffers; a step that fits (one token a request, a bucket, the captured context) has its
  inputs filled from its ints while its hidden states are still on their way (`prepare`),
  then they are copied in and the graph replays (`replay`); any other runs eagerly.
The last stage's graph ends in the final norm, the others hand on (hidden, residual). Rows are
computed as the eager layers compute them, with the kernels' graph-time bounds (attention
sized for the whole context, `StepGraphs`), so a staged run with graphs equals one GPU with
graphs, as a staged run without equals one GPU without (tests/gpu/test_stages_gpu.py).
Stage 0 decides whether graphs run (`wanted`) and tells the others in the startup handshake,
with the context and the batch buckets they must capture for."""
from __future__ import annotations

import numpy as np
import torch

from ..cuda_graphs import StepGraphs, gc_paused
from .wire import split_ints


def wanted(device: torch.device, enforce_eager: bool, stateful: bool, kv_cache,
           micro_batches: int) -> bool:
    """Whether a staged run captures graphs: CUDA stage 0, not --enforce-eager, the Triton
    kernels (static shapes), no recurrent state (hybrid models keep eager stages), whole
    steps (--stage-micro-batches 1: a micro-batch is no host batch of its own to replay)."""
    from .. import kernels
    return device.type == "cuda" and not enforce_eager and not stateful and \
        micro_batches == 1 and kernels.use_triton(kv_cache)


class StageGraphs(StepGraphs):
    def __init__(self, model, kv_caches, layer_range: tuple[int, int], first: bool,
                 max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, staging):
        super().__init__(model, kv_caches, max_num_seqs, max_model_len, block_size, device,
                         staging=staging)
        self.layer_range, self.first = layer_range, first
        # a later stage's inputs: the hidden states and residual of every padded row
        self.hidden = None if first else torch.zeros(2, self.tok.shape[1], model.cfg.hidden_size,
                                                     dtype=dtype, device=device)

    def _layers(self, bs: int):
        ids, pos, meta = self._inputs(bs, 1, False)
        hidden = None if self.first else (self.hidden[0, :bs], self.hidden[1, :bs])
        return self.model(ids if self.first else None, pos, self.kv_caches, meta,
                          layer_range=self.layer_range, hidden=hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        with gc_paused():
            empty = np.zeros(0, np.int64)
            for bs in reversed(self.buckets[1, False]):
                self._fill(*self._pad(empty, empty, empty, np.zeros((0, 1), np.int64),
                                      empty, empty, bs, 1))
                self._layers(bs)  # compiles the kernels
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self.outputs[bs, 1, False] = self._layers(bs)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[bs, 1, False] = g
            torch.cuda.synchronize(self.device)

    def _rows(self, out, n: int):
        return out[:n] if isinstance(out, torch.Tensor) else (out[0][:n], out[1][:n])

    def run_first(self, h, ids_from=None):
        """Stage 0: (the stage's output for host batch `h` (which `fits`), its real rows; the
        device index of the batch's logits rows among them)."""
        out, rows, _ = self.run(h, ids_from)
        return self._rows(out, len(h.input_ids)), rows

    def prepare(self, header: list[int], ints: torch.Tensor) -> int | None:
        """A later stage: fills the graph's inputs for a received step from its ints (before
        its hidden states are in) and returns the batch bucket to `replay`; None where the
        step does not fit a graph (it then runs eagerly)."""
        _, n, num_seqs, max_blocks, max_query_len, max_seq_len, prefill, tree, _ = header
        if prefill or tree or max_query_len != 1 or n != num_seqs or \
                max_blocks > self.max_blocks or max_seq_len > self.max_model_len:
            return None
        bs = next((b for b in self.buckets[1, False] if b >= n), None)
        if bs is None:
            return None
        pos, slots, tables, seq_lens, *_ = (t.numpy() for t in split_ints(header, ints))
        self._fill(*self._pad(np.zeros(n, np.int64), pos, slots, tables.reshape(n, max_blocks),
                              seq_lens, np.ones(n, np.int64), bs, 1))
        return bs

    def replay(self, bs: int, hidden: torch.Tensor):
        """The prepared step's output, its real rows. `hidden`: the received [2, n,
        hidden_size] (pinned host memory: copied in as the graph's first work; or on the
        device)."""
        n = hidden.shape[1]
        self.hidden[:, :n].copy_(hidden, non_blocking=True)  # in stream order
        self.graphs[bs, 1, False].replay()
        return self._rows(self.outputs[bs, 1, False], n)
