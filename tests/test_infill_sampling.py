"""llama.cpp's infill sampler stage (`luceio/infill_sampling.py`) on hand-worked candidate sets:
each case's expected output is computed by hand in its comment from the stage's five rules."""
from __future__ import annotations

import math

from luceio.infill_sampling import infill_filter

EOT = 99


def logits_for(probs):
    return [math.log(p) for p in probs]


def run(ids, probs, pieces, eog=()):
    return infill_filter(ids, logits_for(probs), lambda t: t in eog, lambda t: pieces.get(t, b""),
                         EOT)


def close(a, b):
    return len(a) == len(b) and all(abs(x - y) < 1e-9 for x, y in zip(a, b))


def test_end_of_generation_wins_when_three_times_its_mass_per_candidate_beats_the_text():
    # p_eog 0.2, 3 candidates: 3 * 0.2 * 3 = 1.8 > p_txt 0.8 -> only the EOG token, p = 1
    ids, p = run([1, 2, 7], [0.5, 0.3, 0.2], {1: b"a", 2: b"b"}, eog={7})
    assert ids == [7] and close(p, [1.0])
    # p_eog 0.05: 3 * 0.05 * 3 = 0.45 < 0.95 -> text stays (a 0.6 kept, b 0.35 kept, EOG kept)
    ids, p = run([1, 2, 7], [0.6, 0.35, 0.05], {1: b"a", 2: b"b"}, eog={7})
    # first pass keeps all three (EOG always), renormalised: same values; n_text = 2, thold 1/3:
    # a 0.6 and b 0.35 both >= 1/3 -> all three
    assert ids == [1, 2, 7] and close(p, [0.6, 0.35, 0.05])


def test_a_prefix_is_merged_into_the_likelier_token():
    # " foo" (0.3) is a prefix of " foobar" (0.5): merged into " foobar" (0.8); " x" 0.2 stays at
    # the first threshold (>= 0.2), renormalised 0.8 / 0.2; n_text 2 -> thold 1/3 drops " x"
    ids, p = run([1, 2, 3], [0.3, 0.5, 0.2], {1: b" foo", 2: b" foobar", 3: b" x"})
    assert ids == [2] and close(p, [1.0])
    # the likelier is the shorter one: the longer is merged into it
    ids, p = run([1, 2, 3], [0.5, 0.25, 0.25], {1: b" foo", 2: b" foobar", 3: b" x"})
    # " foo" 0.75, " x" 0.25 -> both >= 0.2; n_text 2, thold 1/3 -> " foo" only
    assert ids == [1] and close(p, [1.0])


def test_two_survivors_are_renormalised():
    # a 0.45, b 0.4, c 0.15 (no prefixes): c < 0.2 dropped; a, b renormalised to 0.45/0.85,
    # 0.4/0.85 = 0.529, 0.471, both >= 1/3
    ids, p = run([1, 2, 3], [0.45, 0.4, 0.15], {1: b"a", 2: b"b", 3: b"c"})
    assert ids == [1, 2] and close(p, [0.45 / 0.85, 0.4 / 0.85])


def test_no_text_token_left_gives_end_of_turn():
    probs = [0.19, 0.18, 0.17, 0.16, 0.15, 0.15]  # every text token under 0.2, no EOG token
    ids, p = run(list(range(1, 7)), probs, {i: bytes([96 + i]) for i in range(1, 7)})
    assert ids == [EOT] and p == [1.0]


def test_control_tokens_with_empty_text_are_not_prefixes():
    # id 5 has no text (a control token): it must not absorb everything as an empty prefix
    ids, p = run([1, 5], [0.7, 0.3], {1: b"a"})
    # no merge; 5 (0.3) >= 0.2 kept; n_text 2, thold 1/3: 5 dropped -> [1]
    assert ids == [1] and close(p, [1.0])


def test_probabilities_are_the_candidates_softmax_not_the_raw_values():
    # logits that are not log-probabilities: the stage softmaxes over the candidates first
    ids, p = infill_filter([1, 2], [10.0, 10.0], lambda t: False, lambda t: b"ab"[t - 1:t], EOT)
    # 0.5 / 0.5, both >= 0.2 and >= 1/3
    assert ids == [1, 2] and close(p, [0.5, 0.5])
