"""Speculative decoding inside the engine step: propose drafts for running requests (adaptive k),
verify them in the one target forward, and keep acceptance statistics. Which requests speculate:
decoding ones whose params allow it (`use_speculation`, no penalties — they depend on each
emitted token — and `min_tokens` already met). How many drafts: per request, the k expected to
emit the most tokens per cost from the request's own acceptance and the measured cost of a draft
token (`spec.length`), capped by `num_speculative_tokens`; a request whose drafts keep failing
drops to k = 0 and probes again now and then. Larger batches speculate less: the target forward
stops being memory-bound, so rejected drafts cost real compute."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..request import Request
from .cost import _PROBE_EVERY, CostModel
from .length import DraftLength
from .proposer import ProposalInput
from .rejection import rejection_sample_batch
from .tree import accept as tree_accept


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    draft_seconds: float = 0.0  # proposer time (draft-model forwards or n-gram search)
    verify_seconds: float = 0.0  # rejection-sampling time (the target forward is not included)
    # verify steps by accepted drafts: accepted_histogram[a] verifies accepted exactly a
    accepted_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the recovered/bonus token)."""
        return (self.num_accepted_tokens + self.num_verify_steps) / max(self.num_verify_steps, 1)


class SpecDecoder(CostModel):
    def __init__(self, method: str, num_speculative_tokens: int, proposer, sampler,
                 tree_budget: int = 0):
        self.method = method
        self.tree_budget = tree_budget  # > 0: the proposer may draft trees (`spec.tree`)
        self.k_max = num_speculative_tokens
        self.proposer = proposer
        self.sampler = sampler
        self.stats = SpecStats()
        self._length: dict[str, DraftLength] = {}  # by request id
        self._released: list[str] = []  # proposer state is freed on the loop thread, between steps
        self._init_cost_model()
        self._draft_cost = self.draft_token_cost(1)  # `plan` sets it for its batch
        self._step = 0
        self.last_draft_seconds = 0.0
        # plain steps at the start of each probe cycle (the engine sets 2 with overlapped
        # scheduling: only the second is overlapped, the cost plain decoding really has)
        self.plain_probe_steps = 1

    # proposing ---------------------------------------------------------------------------------
    def batch_cap(self, batch_size: int) -> int:
        if batch_size <= 4:
            return self.k_max
        if batch_size <= 16:
            return max(self.k_max // 2, 1)
        return 1 if batch_size <= 32 else 0

    def eligible(self, r: Request) -> bool:
        return r.num_computed_tokens == r.num_tokens - 1 and self._allowed(r)

    @staticmethod
    def _allowed(r: Request) -> bool:
        """Params and progress that allow drafting once the request's tokens are all known."""
        p = r.params
        return (p.use_speculation and r.num_output_tokens + r.num_pending_tokens >= p.min_tokens
                and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
                and p.presence_penalty == 0.0)

    def may_draft(self, running: list[Request]) -> bool:
        """Whether the next `plan` may draft for `running` once their tokens still on the device
        have landed (no side effects). Drafts start from a request's latest token, so overlapped
        scheduling waits for the step in flight before such a step."""
        n = len(running)
        return bool(self.batch_cap(n)) and self.pays(n, self._step + 1) and any(
            self._allowed(r) and (r.num_pending_tokens or r.num_computed_tokens == r.num_tokens - 1)
            for r in running)

    def k_for(self, r: Request, cap: int) -> int:
        """Drafts for `r` this step, at most `cap` (`spec.length`), at the draft token's cost
        `plan` looked up for this step's batch (`CostModel.draft_token_cost`)."""
        room = min(r.max_tokens - r.num_output_tokens, r.max_model_len - r.num_tokens) - 1
        if min(cap, room) <= 0:
            return 0
        return max(0, min(self._length_of(r).k(cap, self._draft_cost), room))

    def _length_of(self, r: Request) -> DraftLength:
        """`r`'s draft length, made with the batch's recent acceptance as its prior at first use."""
        length = self._length.get(r.request_id)
        if length is None:
            length = self._length[r.request_id] = DraftLength(self.acceptance_rate(), _PROBE_EVERY)
        return length

    def plan(self, running: list[Request]) -> tuple[list[Request], list[int], bool]:
        """Loop thread: which requests draft this step, how many tokens each, and whether as
        trees (with a tree budget: `mode`)."""
        for rid in self._released:
            self.proposer.release(rid)
        self._released.clear()
        self._step += 1
        mode = self.mode(len(running))
        cap = self.batch_cap(len(running)) if mode is not None else 0
        reqs = [r for r in running if self.eligible(r)] if cap else []
        self._draft_cost = self.draft_token_cost(len(running))
        ks = [self.k_for(r, cap) for r in reqs]
        picked = self._catch_up([(r, k) for r, k in zip(reqs, ks) if k], len(running), mode, cap)
        return [r for r, _ in picked], [k for _, k in picked], mode == "tree"

    def draft(self, reqs: list[Request], ks: list[int], tree: bool = True):
        """Worker thread: runs the proposer (reads request tokens, writes only its own state);
        `tree`: a proposer with a tree budget may draft trees (`plan`'s choice)."""
        t0 = time.perf_counter()
        self.last_draft_seconds = 0.0
        proposal = self.proposer.propose([ProposalInput(r.all_token_ids, k, r, tree)
                                          for r, k in zip(reqs, ks)])
        self.last_draft_seconds = time.perf_counter() - t0
        self.stats.draft_seconds += self.last_draft_seconds
        self._note_feed(getattr(proposal, "fed", 0), self.last_draft_seconds, sum(ks))
        return proposal.drafts, proposal.probs, proposal.trees

    def apply(self, reqs: list[Request], drafts, probs, trees=None) -> None:
        """Loop thread: attaches the drafts (and their trees) to requests still running. A
        constrained request takes its tree's first path: grammar masks walk drafts in a line."""
        offset = 0
        for i, (r, d) in enumerate(zip(reqs, drafts)):
            if not r.is_finished and r.num_computed_tokens == r.num_tokens - 1:
                tree = trees[i] if trees is not None else None
                if tree is not None and r.params.structured_outputs is not None:
                    tree = tree.first_path()
                r.spec_tree = tree if tree is not None and tree.num_nodes else None
                r.spec_token_ids = list(tree.tokens) if tree is not None else list(d)
                r.draft_probs = probs[offset:offset + len(d)] if probs is not None else None
            offset += len(d)

    # verifying ---------------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, rows: dict[str, slice], scheduled,
               bitmask: torch.Tensor | None = None) -> tuple[dict, dict, dict]:
        """Rejection-samples every request that had drafts verified this step. Returns
        (tokens per request id, per-token logprob dicts per request id, the accepted rows per
        request id that verified a tree: see `spec.tree`). `bitmask`: the grammar masks of the
        logits' rows (`luceio.structured`), or None; a draft its grammar refuses has
        probability zero, so it is rejected."""
        t0 = time.perf_counter()
        trees = [s for s in scheduled if s.spec_tree is not None and s.req.request_id in rows]
        tokens, logprobs, paths = self._verify_trees(logits, rows, trees)
        items = [s for s in scheduled if s.spec_token_ids and s.spec_tree is None
                 and s.req.request_id in rows]
        if not items:
            self.stats.verify_seconds += time.perf_counter() - t0
            return tokens, logprobs, paths
        reqs = [s.req for s in items]
        raw = torch.cat([logits[rows[r.request_id]] for r in reqs])
        per_row = [r for r in reqs for _ in range(rows[r.request_id].stop - rows[r.request_id].start)]
        masks = torch.cat([bitmask[rows[r.request_id]] for r in reqs]) \
            if bitmask is not None else None
        processed = self.sampler.process(raw, per_row, masks)
        greedy = [r.params.greedy for r in reqs]
        target = processed if all(greedy) else processed.softmax(-1)
        draft_probs = None
        if self.method != "ngram" and not all(greedy):
            # one row per verified draft; greedy requests' rows are ignored, so zeros do
            draft_probs = torch.cat([
                r.draft_probs[:len(s.spec_token_ids)].to(raw.device) if r.draft_probs is not None
                else raw.new_zeros(len(s.spec_token_ids), raw.shape[-1]) for r, s in zip(reqs, items)])
        gens = [None if r.params.greedy or r.params.seed is None
                else self.sampler.request_generator(r, logits.device) for r in reqs]
        out = rejection_sample_batch(target, [s.spec_token_ids for s in items], draft_probs,
                                     greedy, gens)
        start = 0
        for r, s, toks in zip(reqs, items, out):
            n_rows = len(s.spec_token_ids) + 1
            tokens[r.request_id] = toks
            if r.params.logprobs is not None:
                sl = raw[start:start + len(toks)]
                logprobs[r.request_id] = self.sampler.logprobs(
                    sl, torch.tensor(toks, device=sl.device), [r.params.logprobs] * len(toks))
            start += n_rows
            self._record(r, len(s.spec_token_ids), len(toks) - 1)
        self.stats.verify_seconds += time.perf_counter() - t0
        return tokens, logprobs, paths

    def _verify_trees(self, logits: torch.Tensor, rows: dict[str, slice], items
                      ) -> tuple[dict, dict, dict]:
        """`spec.tree.accept` per request that verified a draft tree (no grammar: constrained
        requests draft chains). Returns tokens, logprobs and the accepted rows, by request id."""
        tokens, logprobs, paths = {}, {}, {}
        for s in items:
            r, sl = s.req, rows[s.req.request_id]
            raw = logits[sl]
            processed = self.sampler.process(raw, [r] * (sl.stop - sl.start))
            greedy = r.params.greedy
            gen = None if greedy or r.params.seed is None \
                else self.sampler.request_generator(r, logits.device)
            path, toks = tree_accept(s.spec_tree, processed if greedy else processed.softmax(-1),
                                     greedy, gen)
            tokens[r.request_id], paths[r.request_id] = toks, path
            if r.params.logprobs is not None:
                seq = torch.tensor([0] + path, device=raw.device)
                logprobs[r.request_id] = self.sampler.logprobs(
                    raw[seq], torch.tensor(toks, device=raw.device),
                    [r.params.logprobs] * len(toks))
            # a walk that ended on a leaf (a node no other names as parent) rejected nothing
            rejected = (path[-1] - 1 if path else -1) in s.spec_tree.parents
            self._record(r, s.spec_tree.num_nodes, len(toks) - 1, tree=True, rejected=rejected)
        return tokens, logprobs, paths

    def _record(self, r: Request, num_drafts: int, num_accepted: int, tree: bool = False,
                rejected: bool | None = None) -> None:
        st = self.stats
        if r.is_finished:  # aborted during the step: its state is already released
            return
        st.num_drafts += 1
        st.num_verify_steps += 1
        st.num_draft_tokens += num_drafts
        st.num_accepted_tokens += num_accepted
        st.accepted_histogram[num_accepted] = st.accepted_histogram.get(num_accepted, 0) + 1
        self._count_acceptance(num_drafts, num_accepted, tree)
        self._length_of(r).record(num_drafts, num_accepted, rejected)

    def release(self, request_id: str) -> None:
        self._length.pop(request_id, None)
        self._released.append(request_id)
