"""llama.cpp's `infill` sampler stage, which llama.vim and llama.vscode ask for on every code
completion (`"samplers": ["top_k", "top_p", "infill"]`). It runs on the few candidates top-k /
top-p left and reshapes their distribution for fill-in-the-middle, where stopping early is
better than rambling on:

1. the candidates' logits are softmaxed again (probabilities among the candidates);
2. if 3 x (end-of-generation probability) x (number of candidates) exceeds the probability of
   all text tokens, only the end-of-generation tokens stay;
3. otherwise a candidate whose text is a prefix of another's text is merged with it (the
   likelier of the two keeps the summed probability), so " foo" and " foobar" do not split the
   mass of one continuation;
4. text tokens under probability 0.2 are dropped (end-of-generation tokens always stay); with no
   text token left the result is the end-of-turn token (end-of-sequence where the vocabulary has
   none) with probability 1;
5. what is left is renormalised, and text tokens under 1 / (number of text tokens + 1) are
   dropped again and the rest renormalised.

The final draw from the returned distribution is the caller's (the engine's seeded draw). Read
from llama.cpp's `llama_sampler_infill_apply` for the rules; written here from them.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence


def infill_filter(ids: Sequence[int], logits: Sequence[float], is_eog: Callable[[int], bool],
                  piece: Callable[[int], bytes], eot: int) -> tuple[list[int], list[float]]:
    """(ids, probabilities) after the infill stage, from the candidates' `ids` and (processed)
    `logits`. `piece(id)`: the token's bytes as text (empty for control tokens); `eot`: the
    token returned when no text token survives."""
    ids = list(ids)
    if not ids:
        return [eot], [1.0]
    top = max(logits)
    if top == -math.inf:
        return [eot], [1.0]
    p = [math.exp(x - top) for x in logits]
    total = sum(p)
    p = [v / total for v in p]
    eog = [is_eog(t) for t in ids]
    p_eog = sum(v for v, e in zip(p, eog) if e)
    p_txt = sum(v for v, e in zip(p, eog) if not e)
    if 3 * p_eog * len(ids) > p_txt:
        keep = [i for i, e in enumerate(eog) if e]
        s = sum(p[i] for i in keep)
        return [ids[i] for i in keep], [p[i] / s for i in keep]

    alive = [x != -math.inf for x in logits]
    text = [piece(t) for t in ids]
    for i0 in range(len(ids)):
        for i1 in range(len(ids)):
            if not alive[i0]:
                break
            if i0 == i1 or not alive[i1]:
                continue
            a, b = text[i0], text[i1]
            if a and len(a) <= len(b) and b.startswith(a):  # i0 is a prefix of i1
                dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
                p[dst] += p[src]
                p[src] = 0.0
                alive[src] = False

    keep = [i for i in range(len(ids)) if eog[i] or p[i] >= 0.2]
    n_text = sum(1 for i in keep if not eog[i])
    if n_text == 0:
        return [eot], [1.0]
    s = sum(p[i] for i in keep)
    q = {i: p[i] / s for i in keep}
    thold = 1.0 / (n_text + 1)
    keep = [i for i in keep if eog[i] or q[i] >= thold]
    s = sum(q[i] for i in keep)
    return [ids[i] for i in keep], [q[i] / s for i in keep]


def token_piece(tokenizer):
    """token id -> its text as UTF-8 bytes, empty for special tokens (llama.cpp's
    token_to_piece without specials): what the infill stage compares; None without a tokenizer."""
    if tokenizer is None:
        return None
    return lambda t: tokenizer.decode([t], skip_special_tokens=True).encode()
