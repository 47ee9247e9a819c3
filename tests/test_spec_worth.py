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


def _losing_chain(spec: SpecDecoder) -> None:
    """Plain steps 10 ms; a chain step 30 ms that emits ~1 token a request: worth ~0.35."""
    r = _req()
    for _ in range(300):
        spec._record(r, 4, 0)
    spec.observe(1, drafted=False, num_tokens=1, seconds=0.010)


def test_a_losing_way_skips_its_next_probes_doubling():
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
    _losing_chain(spec)
    spec._step = 3
    assert spec.mode(1) == "chain"  # never measured: tried
    spec.observe(1, drafted=True, num_tokens=1, seconds=0.030)
    assert spec.mode(1, step=4) is None
    assert spec.mode(1, step=8) is None  # the probe 5 steps after it lost: skipped
    assert spec.mode(1, step=24) is None
    assert spec.mode(1, step=40) == "chain"  # 2 cycles on (the loss at step 3 + 32)
    spec._step = 40
    spec.observe(1, drafted=True, num_tokens=1, seconds=0.030)  # lost again: 4 cycles
    assert [spec.mode(1, step=s) for s in (56, 72, 88)] == [None] * 3
    assert spec.mode(1, step=104) == "chain"
    for n in range(6):  # the gap stops growing at 16 cycles (256 steps)
        spec.observe(1, drafted=True, num_tokens=1, seconds=0.030)
    assert spec._resume[(1, "chain")] == 40 + 256


def test_a_way_that_pays_again_is_probed_every_cycle():
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
    _losing_chain(spec)
    spec._step = 3
    spec.observe(1, drafted=True, num_tokens=1, seconds=0.030)
    assert spec.mode(1, step=8) is None
    r = _req()
    for _ in range(300):
        spec._record(r, 4, 4)  # the drafts start matching
    spec._step = 40
    spec.observe(1, drafted=True, num_tokens=5, seconds=0.012)  # cost average falls too
    spec.observe(1, drafted=True, num_tokens=5, seconds=0.012)
    assert spec._worth(1, "chain", 4) > 1
    assert (1, "chain") not in spec._resume
    assert spec.mode(1, step=41) == "chain"


def _chain_worth(spec: SpecDecoder, accepted: int, chain_ms: float) -> None:
    """Plain steps measured (10 ms) at step 5, then chain steps of `chain_ms` accepting
    `accepted` of 4 drafts."""
    r = _req()
    for _ in range(300):
        spec._record(r, 4, accepted)
    spec._step = 5
    spec.observe(1, drafted=False, num_tokens=1, seconds=0.010)
    for _ in range(20):
        spec.observe(1, drafted=True, num_tokens=1 + accepted, seconds=chain_ms / 1000,
                     drafting=1, drafts=4)


def test_a_way_well_ahead_of_plain_probes_plain_every_fourth_cycle():
    """A chain worth ~3.5 plain steps: the plain probe (phase 0 of each 16-step cycle) is
    skipped in the 3 cycles after the one plain decoding was measured in (every 64 steps)."""
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
    _chain_worth(spec, accepted=4, chain_ms=14.0)  # plain measured at step 5: cycle 0
    assert spec._worth(1, "chain", 4) > 1.25
    assert [spec.mode(1, step=s) for s in (16, 32, 48)] == ["chain"] * 3
    assert spec.mode(1, step=64) is None  # the fourth cycle after: probe it
    spec._step = 64
    spec.observe(1, drafted=False, num_tokens=1, seconds=0.010)  # measured again
    assert [spec.mode(1, step=s) for s in (80, 96, 112)] == ["chain"] * 3
    assert spec.mode(1, step=128) is None


def test_both_plain_probe_steps_of_a_cycle_decide_alike():
    """With overlapped scheduling a plain probe is two steps and only the second is measured
    (the first follows a drafting step). Four cycles on, both steps probe again; deciding by
    steps since the measurement let the first draft (63 steps) and the second run plain
    (64) after a drafting step, measuring nothing, so plain was re-measured every 80 steps."""
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
    spec.plain_probe_steps = 2
    _chain_worth(spec, accepted=4, chain_ms=14.0)
    spec._step = 65  # the second plain step of the cycle at 64, measured
    spec.observe(1, drafted=False, num_tokens=1, seconds=0.010)
    assert [spec.mode(1, step=s) for s in (80, 81, 96, 97, 112, 113)] == ["chain"] * 6
    assert [spec.mode(1, step=s) for s in (128, 129)] == [None, None]


def test_a_way_barely_ahead_probes_plain_every_cycle():
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None)
    _chain_worth(spec, accepted=1, chain_ms=17.0)
    worth = spec._worth(1, "chain", 4)
    assert 1.0 <= worth < 1.25
    assert spec.mode(1, step=17) == "chain"
    assert [spec.mode(1, step=s) for s in (16, 32)] == [None, None]
