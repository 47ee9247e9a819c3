"""CUDA graphs for decode steps (one query token per request).

Graphs are captured per batch-size bucket, largest first, sharing one memory pool; a step
replays the smallest bucket that fits, padded (padding rows write no KV: slot -1, and attend to
one key). Attention inside a graph sees `max_seq_len` = the model's context, a static bound:
the Triton decode kernel reads the real lengths from `seq_lens`. Steps that do not fit (prefill
chunks, speculative verification, bigger batches) run eagerly. Works on ROCm through the same
`torch.cuda` API."""
from __future__ import annotations

import torch

from .models import AttnMetadata

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device):
        self.model, self.kv_caches = model, kv_caches
        self.buckets = [b for b in _BUCKETS if b <= max_num_seqs] or [1]
        self.max_bs = self.buckets[-1]
        self.max_model_len = max_model_len
        max_blocks = -(-max_model_len // block_size)
        n = self.max_bs
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks, **i32)
        self.seq_lens = torch.ones(n, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttnMetadata:
        return AttnMetadata(self.slot_mapping[:bs], self.block_tables[:bs], self.seq_lens[:bs],
                            self.query_start_loc[:bs + 1], 1, self.max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        for bs in reversed(self.buckets):
            args = (self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs))
            self.model(*args)  # warm-up: compiles kernels outside the graph
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outputs[bs] = self.model(*args)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()

    def fits(self, num_tokens: int, max_query_len: int) -> bool:
        return max_query_len == 1 and num_tokens <= self.max_bs and bool(self.graphs)

    def run(self, input_ids, positions, meta: AttnMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
