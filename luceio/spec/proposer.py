"""Draft-token proposer interface for speculative decoding.

A proposer guesses the next few tokens of each running request. The target
model then verifies the guesses in one forward pass and the rejection sampler
(:mod:`luceio.spec.rejection`) decides which to keep, so a proposer only
affects speed, never the output distribution.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

TokenHistory = Union[np.ndarray, Sequence[int]]


@dataclass
class ProposalInput:
    """What a proposer sees of one request.

    tokens: the request's full token history, prompt followed by the tokens
        generated so far (1-D numpy int array or list of ints).
    k: the maximum number of draft tokens wanted for this step (>= 0).
    """

    tokens: TokenHistory
    k: int


class Proposer(abc.ABC):
    """Proposes draft tokens for a batch of requests.

    Rules for :meth:`propose`:

    * returns one list per input, in input order;
    * each list holds at most ``k`` token ids (plain ``int``) for that input,
      possibly none (no good guess, or ``k == 0``);
    * the drafts continue the history: draft 0 is the guess for the token that
      follows ``tokens[-1]``, draft 1 the one after, and so on;
    * a proposer must not mutate its inputs.

    Proposers that do not sample (e.g. n-gram lookup) are deterministic: the
    rejection sampler treats their draft distribution as a point mass
    (``draft_probs=None``).
    """

    @abc.abstractmethod
    def propose(self, requests: list[ProposalInput]) -> list[list[int]]:
        ...
