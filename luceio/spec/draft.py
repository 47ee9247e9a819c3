"""Draft-model proposer: a small model with the target's tokenizer drafts k tokens per request,
batched across requests, with its own paged KV cache managed by the same block-pool code.

The draft cache of a request holds the tokens it was fed; after verification the valid part is
the longest common prefix of what it was fed and the request's (now verified) tokens, so the
cache stays consistent after rejections and the next round only feeds the 1–2 new tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache import KVCacheManager
from ..sampling_params import SamplingParams
from ..scheduler import ScheduledRequest, SchedulerOutput
from .proposer import Proposal, ProposalInput, Proposer

_NO_LOGPROBS = SamplingParams(max_tokens=None)


@dataclass
class DraftSeq:
    """The draft model's view of one request (quacks like a Request for the runner)."""
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=lambda: _NO_LOGPROBS)

    @property
    def num_prompt_tokens(self) -> int:
        return 0

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids)

    def positions(self, start: int, end: int) -> range:
        return range(start, end)


class DraftModelProposer(Proposer):
    def __init__(self, runner, block_size: int, sampler):
        self.runner = runner  # a ModelRunner over the draft model, eager
        self.sampler = sampler  # the engine's: drafts are drawn with each request's parameters
        self.kv = KVCacheManager(runner.num_blocks, block_size, enable_prefix_caching=False)
        self.seqs: dict[str, DraftSeq] = {}

    def propose(self, batch: list[ProposalInput]) -> Proposal:
        """Drafts batch[i].k tokens for each batch[i].request (tokens: batch[i].tokens), in one
        draft forward per draft position. `Proposal.probs`: when any request samples, the
        distributions [sum(len(drafts)), vocab] the drafts were drawn from."""
        reqs, ks, sampler = [p.request for p in batch], [p.k for p in batch], self.sampler
        seqs = [self._sync(p.request.request_id, list(p.tokens)) for p in batch]
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        live = [i for i, k in enumerate(ks) if k > 0]
        any_sampled = any(not r.params.greedy for r in reqs)
        for step in range(max(ks, default=0)):
            live = [i for i in live if len(drafts[i]) < ks[i] and self._room(seqs[i])]
            if not live:
                break
            sched = SchedulerOutput([ScheduledRequest(seqs[i], seqs[i].num_tokens_with_spec -
                                                      seqs[i].num_computed_tokens) for i in live], [])
            inp = self.runner.prepare(sched, self.kv)
            logits = self.runner.execute(inp)
            live_reqs = [reqs[i] for i in live]
            processed = sampler.process(logits, live_reqs)
            tokens = sampler.draw(processed, live_reqs).tolist()
            p = processed.softmax(-1) if any_sampled else None
            for row, i in enumerate(live):
                s = seqs[i]
                s.num_computed_tokens = len(s.all_token_ids)
                s.all_token_ids.append(tokens[row])
                drafts[i].append(tokens[row])
                if p is not None:
                    probs[i].append(p[row])
        flat = [t for i in range(len(reqs)) for t in probs[i]]
        return Proposal(drafts, torch.stack(flat) if any_sampled and flat else None)

    def _sync(self, request_id: str, tokens: list[int]) -> DraftSeq:
        """Rolls the draft cache back to what still matches the request's verified tokens."""
        s = self.seqs.get(request_id)
        if s is None:
            s = self.seqs[request_id] = DraftSeq(request_id, [])
        fed = s.all_token_ids[:s.num_computed_tokens]
        n = 0
        limit = min(len(fed), len(tokens) - 1)
        while n < limit and fed[n] == tokens[n]:
            n += 1
        s.num_computed_tokens = n
        s.all_token_ids = tokens
        self.kv.trim(s, n)
        return s

    def _room(self, s: DraftSeq) -> bool:
        if len(s.all_token_ids) >= self.runner.cfg.max_position_embeddings:
            return False
        return self.kv.allocate_slots(s, len(s.all_token_ids) - s.num_computed_tokens)

    def release(self, request_id: str) -> None:
        s = self.seqs.pop(request_id, None)
        if s is not None:
            self.kv.free(s)
