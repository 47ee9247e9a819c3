"""A draft model's greedy chain steps 2..k in one launch: one CUDA graph replay on GPUs.

`DraftModelProposer.propose` runs a chain's first draft step through the runner (it catches the
draft cache up with the request's new tokens, a varlen step). The steps after it feed one token
per request, the draft the step before chose, so their shapes are known in advance: this
module captures S of them back to back in one graph per (batch bucket, S), with the argmax
between steps on the device. The host prepares everything once, before the replay: each step's
positions and sequence lengths are the first step's plus j (computed inside the graph), the KV
slots of all S steps come from block tables allocated for them beforehand. A request whose chain
is shorter than S writes no KV past its last step (slot -1); what the graph computes for it
there is discarded.

Rules:
- Greedy only: every request's draft is the argmax of its raw logits (`plain_argmax`), so a
  chain equals drafting step by step with the same graphs (tested on the GPU, and on the CPU,
  where the same body runs eagerly with no padding).
- The graphs share the draft runner's memory pool and read its KV caches; buckets and step
  counts are those `SpecDecoder.batch_cap` can ask for (k up to the cap at batch <= 4, half of it
  up to 16 requests).
"""
from __future__ import annotations

import numpy as np
import torch

from ..cuda_graphs import capture_in_pool, gc_paused
from ..models import AttnMetadata

_BUCKETS = (1, 2, 4, 8, 16)


def plain_argmax(reqs) -> bool:
    """Whether the sampler's draw for these requests is the argmax of their raw logits: greedy,
    no allowed-token list, no logit bias (drafting requests have no penalties and are past
    min_tokens: `SpecDecoder.eligible`)."""
    return all(r.params.greedy and not r.params.allowed_token_ids and not r.params.logit_bias
               for r in reqs)


class DraftChain:
    def __init__(self, runner, max_steps: int, max_seqs: int):
        """`max_steps`: the longest chain past its first step (k_max - 1)."""
        self.runner, self.model, self.kv_caches = runner, runner.model, runner.kv_caches
        self.device, self.block_size = runner.device, runner.block_size
        self.max_model_len = runner.max_model_len
        self.max_blocks = -(-self.max_model_len // self.block_size)
        buckets = [b for b in _BUCKETS if b <= max(max_seqs, 1)]
        # (batch bucket -> most steps): SpecDecoder.batch_cap halves k past 4 requests
        self.steps_for = {b: max_steps if b <= 4 else max(max_steps + 1, 2) // 2 - 1
                          for b in buckets}
        n, s, dev = buckets[-1], max(max_steps, 1), self.device
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)  # the first step's drafts
        self.pos0 = torch.zeros(n, dtype=torch.long, device=dev)
        self.lens0 = torch.zeros(n, dtype=torch.int32, device=dev)
        self.slots = torch.full((s, n), -1, dtype=torch.long, device=dev)
        self.tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.pos = torch.zeros(s, n, dtype=torch.long, device=dev)
        self.lens = torch.zeros(s, n, dtype=torch.int32, device=dev)
        self.out = torch.zeros(s, n, dtype=torch.long, device=dev)  # drafts 2..S+1
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def bucket(self, n: int, steps: int) -> int | None:
        """The batch bucket whose graph runs `steps` steps for n requests, or None."""
        b = next((b for b in self.steps_for if b >= n), None)
        if b is None or steps > self.steps_for[b] or steps < 1:
            return None
        return b

    @torch.inference_mode()
    def capture(self) -> None:
        """Every (bucket, steps) graph, in the draft runner's graph pool (GPU only)."""
        with gc_paused():
            for b, most in sorted(self.steps_for.items(), reverse=True):
                for steps in range(most, 0, -1):
                    self.lens0[:b].fill_(1)
                    self.slots[:, :b].fill_(-1)
                    self.graphs[b, steps] = capture_in_pool(
                        self.runner.graphs, self.device, lambda: self._body(b, steps))
        torch.cuda.synchronize(self.device)

    def _body(self, bs: int, steps: int) -> None:
        """`steps` draft steps over rows [:bs]: what the graph of (bs, steps) holds."""
        ids = self.ids[:bs]
        for j in range(steps):
            pos, lens = self.pos[j, :bs], self.lens[j, :bs]
            torch.add(self.pos0[:bs], j, out=pos)
            torch.add(self.lens0[:bs], j, out=lens)
            meta = AttnMetadata(self.slots[j, :bs], self.tables[:bs], lens, self.qsl[:bs + 1],
                                1, self.max_model_len)
            hidden = self.model(ids, pos, self.kv_caches, meta)
            ids = self.out[j, :bs]
            torch.argmax(self.model.compute_logits(hidden), -1, out=ids)

    def run(self, first: torch.Tensor, seqs, num_steps: list[int], kv) -> torch.Tensor:
        """Chains `seqs` on from their first step's drafts `first` [n] (device): seq i runs
        num_steps[i] more steps (its cache holds all but its first draft; blocks for the
        steps are allocated). Returns the drafts [S, n] on the device (rows past a request's
        steps are garbage)."""
        n, steps = len(seqs), max(num_steps)
        graphed = self.device.type == "cuda"
        bs = self.bucket(n, steps) if graphed else n
        bsz = self.block_size
        pos0 = np.zeros(bs, np.int64)
        lens0 = np.ones(bs, np.int64)  # padded rows: a one-token sequence at position 0
        slots = np.full((steps, bs), -1, np.int64)
        attn = [kv.attention_table(s.request_id) for s in seqs]
        # only the columns in use (the kernels read a table only as far as its length)
        tables = np.zeros((bs, max([len(t) for t, _ in attn], default=1) or 1), np.int64)
        for i, (s, m) in enumerate(zip(seqs, num_steps)):
            table, skipped = attn[i]
            first_idx = len(s.all_token_ids)  # cache index of draft 1, fed by step 1
            pos0[i] = first_idx
            lens0[i] = first_idx + 1 - skipped
            idx = first_idx - skipped + np.arange(m)
            slots[:m, i] = np.asarray(table, np.int64)[idx // bsz] * bsz + idx % bsz
            tables[i, :len(table)] = table
        p, l_, sl, t = self.runner.staging.to_device(np.int64, [pos0, lens0, slots, tables])
        self.ids[:n].copy_(first)
        self.pos0[:bs].copy_(p)
        self.lens0[:bs].copy_(l_)
        self.slots[:steps, :bs].copy_(sl.view(steps, bs))
        self.tables[:bs, :tables.shape[1]].copy_(t.view(bs, -1))
        if graphed:
            self.graphs[bs, steps].replay()
        else:
            self._body(bs, steps)
        return self.out[:steps, :n]
