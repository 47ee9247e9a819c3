"""What a chain verify is expected to emit (`SpecDecoder.expected_tokens`, `_worth`): the
acceptance estimate is a draft's chance once the drafts before it were accepted, and k is the
mean number of drafts requests verified in that batch bucket's recent steps."""
import pytest

from luceio.request import Request
from luceio import SamplingParams
from luceio.spec import SpecDecoder


def _req() -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=100), eos_token_ids=set(),
                   max_model_len=64)


def test_acceptance_is_conditional_on_the_drafts_before():
    """Each draft accepted with probability 0.5, k = 2: a verify accepts 0, 0, 1, 2 drafts in
    proportion (emitting 1, 1, 2, 3 tokens: 1.75 on average). accepted / drafted reads 3 / 8."""
    spec = SpecDecoder("ngram", 2, proposer=None, sampler=None)
    r = _req()
    for _ in range(200):
        for accepted in (0, 2, 0, 1):
            spec._record(r, 2, accepted)
    assert spec.acceptance_rate() == pytest.approx(0.5, abs=0.03)
    assert spec.expected_tokens(2) == pytest.approx(1.75, abs=0.05)
    assert spec.stats.acceptance_rate == pytest.approx(3 / 8)  # the reported ratio stays


def test_all_accepted_chains_read_near_certain_acceptance():
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
    r = _req()
    for _ in range(300):
        spec._record(r, 4, 4)
    assert spec.acceptance_rate() > 0.98
    assert spec.expected_tokens(4) > 4.8


def test_worth_uses_the_k_requests_drafted():
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
    spec.observe(1, drafted=False, num_tokens=1, seconds=0.010)
    r = _req()
    for _ in range(100):
        for accepted in (0, 2, 0, 1):
            spec._record(r, 2, accepted)
    spec.observe(1, drafted=True, num_tokens=2, seconds=0.013, drafting=1, drafts=2)
    assert spec._k[(1, "chain")] == 2
    worth = spec._worth(1, "chain", 4)
    assert worth == pytest.approx(spec.expected_tokens(2) / 1.3)
    assert worth < spec.expected_tokens(4) / 1.3
    # at cap 4 this step would look worth 1.94 / 1.3; at the k drafted it is 1.75 / 1.3
    spec.observe(1, drafted=True, num_tokens=2, seconds=0.013, drafting=1, drafts=4)
    assert spec._k[(1, "chain")] == pytest.approx(0.2 * 4 + 0.8 * 2)


def test_a_step_without_chain_drafts_leaves_k_alone():
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
    spec.observe(1, drafted=True, num_tokens=3, seconds=0.013, tree=True, drafting=1, drafts=6)
    assert (1, "chain") not in spec._k and (1, "tree") not in spec._k
    spec.observe(1, drafted=True, num_tokens=3, seconds=0.013)  # no draft counts given
    assert (1, "chain") not in spec._k
