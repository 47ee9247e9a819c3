"""Draft-token proposer interface for speculative decoding.

A proposer guesses the next few tokens of each running request. The target
model then verifies the guesses in one forward pass and the rejection sampler
(:mod:`luceio.spec.rejection`) decides which to keep, so a proposer only
affects speed, never the output distribution.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import numpy as np

TokenHistory = Union[np.ndarray, Sequence[int]]


@dataclass
class ProposalInput:
    """What a proposer sees of one request.

    tokens: the request's full token history, prompt followed by the tokens
        generated so far (1-D numpy int array or list of ints).
    k: the maximum number of draft tokens wanted for this step (>= 0).
    request: the engine's request, for proposers that keep per-request state
        (its ``request_id``) or sample with its parameters (a draft model);
        None where the proposer needs only the tokens (n-gram lookup).
    tree: whether a proposer with a tree budget may answer with a tree (False:
        a chain of at most ``k``, as without a budget). One value for a batch:
        the engine decides per step which of the two pays (`SpecDecoder`).
    """

    tokens: TokenHistory
    k: int
    request: Any = None
    tree: bool = True


@dataclass
class Proposal:
    """A proposer's answer for a batch.

    drafts: one list per input, in input order (see :class:`Proposer`).
    probs: for proposers that sample, the distributions the drafts were drawn
        from, one row per draft token in batch order ``[sum(len(d)), vocab]``;
        None for deterministic proposers (a point mass at each draft).
    """

    drafts: list[list[int]] = field(default_factory=list)
    probs: Any = None
    # tree speculation (`spec.tree.DraftTree` per input, or None): drafts[i] is then
    # trees[i].tokens, the nodes in topological order
    trees: Any = None
    # tokens the proposer computed to catch up with the requests before drafting (a draft
    # model reading new prompts); the engine measures what catching up costs from it
    fed: int = 0


class Proposer(abc.ABC):
    """Proposes draft tokens for a batch of requests: the one interface of the
    n-gram proposer and the draft model.

    Rules for :meth:`propose`:

    * returns one draft list per input, in input order;
    * each list holds at most ``k`` token ids (plain ``int``) for that input,
      possibly none (no good guess, or ``k == 0``);
    * the drafts continue the history: draft 0 is the guess for the token that
      follows ``tokens[-1]``, draft 1 the one after, and so on;
    * a proposer must not mutate its inputs: the engine alone attaches drafts
      to requests (``SpecDecoder.apply``).

    Proposers that do not sample (e.g. n-gram lookup) are deterministic: the
    rejection sampler treats their draft distribution as a point mass
    (``Proposal.probs`` is None).
    """

    @abc.abstractmethod
    def propose(self, batch: list[ProposalInput]) -> Proposal:
        ...

    def uncached(self, request_id: str, num_tokens: int, tokens=None) -> int:
        """Of a request's `num_tokens` tokens (`tokens`: the ids, where the proposer may look
        them up in a cache of its own), how many the proposer would have to read before
        drafting for it (a draft model's cache of it is behind); 0 for stateless proposers."""
        return 0

    def release(self, request_id: str) -> None:
        """Frees what the proposer keeps for a request that has finished."""
