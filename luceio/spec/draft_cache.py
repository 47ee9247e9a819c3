"""The draft model's view of each request (`DraftSeq`) and of its own KV cache: catching up
with the target's verified tokens and rolling back past rejected drafts (`_sync`), room for
what a step feeds, and the draft cache's prefix caching (a new request adopts the longest
cached prefix of its tokens; verified full blocks are registered as the draft catches up), and
the draft's context window (`window`: a long prompt is read from its first block and its last
`window` tokens only). `DraftCache` is a mixin of `DraftModelProposer`, which provides `kv`, `seqs`, `runner`,
`vocab` and `pad`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..sampling_params import SamplingParams
from .proposer import ProposalInput
from .tree import DraftTree

_NO_LOGPROBS = SamplingParams(max_tokens=None)


@dataclass
class DraftSeq:
    """The draft model's view of one request (quacks like a Request for the runner)."""
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    spec_tree: DraftTree | None = None
    params: SamplingParams = field(default_factory=lambda: _NO_LOGPROBS)
    matched: int = 0  # the fed prefix `_sync` found equal to the request's tokens last time
    looked: int = -1  # the draft cache's registered block count when its prefix was looked up
    sink: int = 0  # with `skip`: the draft reads tokens[:sink] + tokens[sink + skip:] (`_view`)
    skip: int = 0
    position_ids: ClassVar[None] = None  # positions are cache indices

    @property
    def num_prompt_tokens(self) -> int:
        return 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids)

    def positions(self, start: int, end: int) -> range:
        return range(start, end)


class DraftCache:
    # the draft's context window: a request whose prompt leaves more than `window` tokens to
    # feed when the draft first sees it is read as its first KV block (the attention sink the
    # model was trained with) and its last `window` tokens, at the draft's own consecutive
    # positions (RoPE: the scores depend on distances between the tokens it holds); 0: whole
    window: int = 0

    @staticmethod
    def _behind(seqs: list[DraftSeq], batch: list[ProposalInput]) -> int:
        """Tokens the drafting requests' caches lack before their last one (`Proposal.fed`)."""
        return sum(max(len(s.all_token_ids) - 1 - s.num_computed_tokens, 0)
                   for s, p in zip(seqs, batch) if p.k > 0)

    def uncached(self, request_id: str, num_tokens: int, tokens=None) -> int:
        """Tokens before a request's last that its draft cache does not hold (an estimate read
        between steps: the fed prefix that still matches is found when drafting). A request
        new to the draft, given its `tokens`, first takes what the prefix cache holds of them
        (`_adopt`)."""
        s = self.seqs.get(request_id)
        if s is None and tokens is not None:
            s = self._adopt(request_id, self._ids(list(tokens)))
        elif s is not None and tokens is not None:
            self._extend(s, tokens)
        skipped = s.skip if s is not None else 0
        return max(num_tokens - skipped - 1 - (s.num_computed_tokens if s is not None else 0), 0)

    def _adopt(self, request_id: str, tokens: list[int]) -> DraftSeq:
        """The draft's view of a request it has not seen, holding the longest prefix of its
        tokens whose full blocks the draft's prefix cache has (at least the last token is
        left to feed). With a `window`, one that would still have more than `window` tokens
        to feed is read through its window instead (`_view`)."""
        s = self.seqs[request_id] = DraftSeq(request_id, tokens)
        s.looked = self.kv.pool.num_registered
        blocks, hit = self.kv.get_computed_blocks(s)
        sink = self.kv.block_size
        if self.window and len(tokens) - 1 - hit > self.window and \
                len(tokens) > sink + self.window:
            s.sink, s.skip = sink, len(tokens) - sink - self.window
            s.all_token_ids = self._view(s, tokens)
            self.kv.forget_hashes(request_id)  # memoised for the whole prompt's blocks
            blocks, hit = self.kv.get_computed_blocks(s)  # the sink block, most often
        if hit and self.kv.allocate_slots(s, 0, blocks):
            s.num_computed_tokens = s.matched = hit
        return s

    @staticmethod
    def _view(s: DraftSeq, tokens: list[int]) -> list[int]:
        """A request's tokens as the draft reads them: past its window, the sink and the rest."""
        return tokens[:s.sink] + tokens[s.sink + s.skip:] if s.skip else tokens

    def _extend(self, s: DraftSeq, tokens) -> None:
        """A request whose draft cache holds only verified tokens in full blocks (one adopted
        cold, or caught up to a block's end) takes the cached blocks that follow them: other
        requests with the same prefix (copies of a prompt, a shared system prompt arriving
        together) may have registered more of it since. Looked up again only when the draft
        cache registered blocks since the last look."""
        table = self.kv.blocks_of(s.request_id)
        if s.looked == self.kv.pool.num_registered or s.num_computed_tokens != s.matched \
                or s.num_computed_tokens != len(table) * self.kv.block_size:
            return
        s.looked = self.kv.pool.num_registered
        s.all_token_ids = self._view(s, self._ids(list(tokens)))  # verified: no drafts now
        blocks, hit = self.kv.get_computed_blocks(s)
        if hit > s.num_computed_tokens and blocks[:len(table)] == table and \
                self.kv.allocate_slots(s, 0, blocks[len(table):]):
            s.num_computed_tokens = s.matched = hit

    def _ids(self, tokens: list[int]) -> list[int]:
        """The request's ids as the draft reads them: target ids past the draft's rows as 0."""
        if self.pad and max(tokens, default=0) >= self.vocab:
            return [t if t < self.vocab else 0 for t in tokens]
        return tokens

    def _room_for_tree(self, s: DraftSeq, tree: DraftTree) -> bool:
        if len(s.all_token_ids) + tree.num_nodes >= self.runner.cfg.max_position_embeddings:
            return False
        return self.kv.allocate_slots(s, 1 + tree.num_nodes)  # from the root

    def _sync(self, request_id: str, tokens: list[int]) -> DraftSeq:
        """Rolls the draft cache back to what still matches the request's verified tokens, and
        registers the full blocks of that verified prefix in the draft's prefix cache."""
        tokens = self._ids(tokens)
        s = self.seqs.get(request_id)
        if s is None:
            s = self._adopt(request_id, list(tokens))
        tokens = self._view(s, tokens)
        fed = s.all_token_ids[:s.num_computed_tokens]
        limit = min(len(fed), len(tokens) - 1)
        # the prefix that matched last time still matches (a request's tokens only grow), which
        # one C-level comparison confirms; the rest is walked token by token
        n = min(s.matched, limit)
        if fed[:n] != tokens[:n]:
            n = 0
        while n < limit and fed[n] == tokens[n]:
            n += 1
        s.matched = n
        s.num_computed_tokens = n
        s.all_token_ids = tokens
        self.kv.trim(s, n)
        self.kv.cache_blocks(s)  # blocks of verified tokens only: n <= len(tokens) - 1
        return s

    def _room(self, s: DraftSeq, pending: int = 0) -> bool:
        """Room in the context and the draft cache for the sequence's tokens and the `pending`
        drafts sampled for it that it does not hold yet (`propose`)."""
        n = len(s.all_token_ids) + pending
        if n >= self.runner.cfg.max_position_embeddings:
            return False
        return self.kv.allocate_slots(s, n - s.num_computed_tokens)

    def release(self, request_id: str) -> None:
        s = self.seqs.pop(request_id, None)
        if s is not None:
            self.kv.free(s)
