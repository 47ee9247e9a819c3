"""Speculative prefill: a draft model with the target's tokenizer reads a long prompt cheaply
and scores each prompt token by the attention that the last `window` prompt positions pay to
it (max over heads and layers, mean over the window). The target then prefills only the top
`keep` fraction of the prompt, taken in contiguous spans (the first and last spans always), at
their original position ids, and decodes as usual from there.

The draft's prefill is chunked (at most `chunk` tokens per forward) and its scoring only ever
holds a [window, prompt] slice of attention per layer, never the full matrix. This trades
exactness for time to first token: with keep < 1 the target never sees the dropped tokens."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..cache import KVCacheManager
from ..kernels.attention import gather_kv
from ..scheduler import ScheduledRequest, SchedulerOutput
from .draft_cache import DraftSeq


class _WindowProbe:
    """Per layer: softmax attention of the window's queries over all prompt keys so far."""

    def __init__(self, window_start: int, prompt_len: int, device):
        self.window_start, self.prompt_len = window_start, prompt_len
        self.score = torch.zeros(prompt_len - window_start, prompt_len, device=device)

    def __call__(self, q, k_cache, meta, scale: float) -> None:
        num_tokens, num_heads, head_dim = q.shape
        k = gather_kv(k_cache, meta.block_tables, self.prompt_len)[0]  # [L, Hkv, D]
        num_kv = k.shape[1]
        qw = q.view(num_tokens, num_kv, num_heads // num_kv, head_dim).float()
        s = torch.einsum("wkgd,lkd->wkgl", qw, k.float()) * scale  # [W, Hkv, G, L]
        qpos = self.window_start + torch.arange(num_tokens, device=q.device)
        causal = torch.arange(self.prompt_len, device=q.device)[None, :] > qpos[:, None]
        s.masked_fill_(causal[:, None, None, :], float("-inf"))
        probs = s.softmax(-1).flatten(1, 2).amax(1)  # max over heads: [W, L]
        torch.maximum(self.score, probs, out=self.score)  # max over layers


class SpecPrefill:
    def __init__(self, draft_runner, kv: KVCacheManager, window: int = 64, span: int = 16,
                 chunk: int = 2048):
        self.runner, self.kv = draft_runner, kv
        self.window, self.span, self.chunk = window, span, chunk

    @torch.inference_mode()
    def scores(self, prompt_ids: list[int]) -> torch.Tensor:
        """Importance of each prompt token, [len(prompt_ids)]."""
        n = len(prompt_ids)
        w = min(self.window, n)
        seq = DraftSeq("__spec_prefill__", list(prompt_ids))
        if not self.kv.allocate_slots(seq, n):
            raise RuntimeError(f"the draft model's KV cache cannot hold a {n}-token prompt")
        try:
            bounds = list(range(0, n - w, self.chunk)) + [n - w, n]
            probe = _WindowProbe(n - w, n, self.runner.device)
            for start, end in zip(bounds[:-1], bounds[1:]):
                seq.num_computed_tokens = start
                seq.all_token_ids = list(prompt_ids[:end])
                sched = SchedulerOutput([ScheduledRequest(seq, end - start)], [])
                inp = self.runner.prepare(sched, self.kv)
                self.runner.execute(inp, probe=probe if end == n else None)
            return probe.score.mean(0)
        finally:
            self.kv.free(seq)

    def select(self, prompt_ids: list[int], keep: float) -> list[int]:
        """Original positions of the kept tokens, ascending."""
        n = len(prompt_ids)
        num_spans = math.ceil(n / self.span)
        want = max(math.ceil(keep * num_spans), min(2, num_spans))
        if want >= num_spans:
            return list(range(n))
        tok = self.scores(prompt_ids).cpu().numpy()
        span_score = np.array([tok[i * self.span:(i + 1) * self.span].mean()
                               for i in range(num_spans)])
        span_score[[0, num_spans - 1]] = np.inf  # the first and last spans always stay
        kept = np.sort(np.argsort(-span_score, kind="stable")[:want])
        return [p for s in kept for p in range(s * self.span, min((s + 1) * self.span, n))]
