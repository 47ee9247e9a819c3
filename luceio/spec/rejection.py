"""Rejection sampling for lossless speculative decoding.

A proposer drafts ``k`` tokens ``d_0 .. d_{k-1}`` for a request. The target
model scores the request's context followed by the drafts, which yields ``k+1``
next-token distributions ``p_0 .. p_k``: ``p_j`` is the target distribution
for the token after ``d_{j-1}`` (``p_0``: after the last real token, ``p_k``:
after the last draft). ``q_j`` is the distribution ``d_j`` was drawn from.

Definitions used throughout:

* **accepted tokens**: the longest prefix ``d_0 .. d_{m-1}`` of the drafts that
  passes verification, i.e. every ``d_j`` with ``j < m`` is accepted and
  ``d_m`` (if ``m < k``) is the first rejected draft.
* **recovered token**: when ``d_m`` is rejected (``m < k``), the replacement
  token emitted at position ``m``, drawn from the residual distribution
  ``normalize(max(0, p_m - q_m))`` (greedy: ``argmax p_m``). Drafts after
  ``d_m`` are discarded.
* **bonus token**: when all ``k`` drafts are accepted (``m == k``), one extra
  token drawn from ``p_k`` (greedy: ``argmax p_k``), which the verify pass
  computed for free.

The output is the accepted drafts followed by exactly one recovered or bonus
token, so its length is in ``1 .. k+1``. With sampling, each emitted token is
distributed exactly as if it were sampled from the target model one step at a
time (Leviathan et al. 2023, Chen et al. 2023):

* draft ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``;
* deterministic proposers (n-gram lookup, ``draft_probs=None``) have ``q_j`` a
  point mass at ``d_j``: accept with probability ``p_j(d_j)``, and the residual
  is ``p_j`` with ``d_j`` zeroed and renormalised.

Random draws, per sampled request and in this order: ``torch.rand(k)`` (one
uniform per draft) then one ``torch.multinomial`` draw from the chosen
recovered/bonus distribution, both from the request's generator when it has
one, so seeded requests are reproducible and give the same result whether
verified alone or in a batch. Requests without a generator share the default
generator and are drawn batched.
"""
from __future__ import annotations

from typing import Sequence

import torch


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[int],
    draft_probs: torch.Tensor | None,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Verify one request's drafts.

    target_probs: [k+1, V] target probabilities at the k+1 verify positions,
        after the request's sampling transforms (temperature, top-k/p, min-p).
        For ``greedy`` any monotone score works (logits or probs): only argmax
        is used.
    draft_token_ids: the k drafts (k may be 0).
    draft_probs: [k, V] draft distributions ``q_j``, or None for a
        deterministic proposer (point mass at each draft).
    greedy: accept d_j iff d_j == argmax target_probs[j]; the extra token is
        the argmax at the first mismatch (or at position k).
    generator: source of every random draw (ignored for greedy); must live on
        target_probs' device.

    Returns accepted drafts + one recovered/bonus token (length 1..k+1).
    """
    return rejection_sample_batch(
        target_probs,
        [list(draft_token_ids)],
        draft_probs,
        [greedy],
        [generator],
    )[0]


def rejection_sample_batch(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,
    greedy: Sequence[bool] | bool,
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[list[int]]:
    """Verify many requests at once (flat layout, request after request).

    target_probs: [sum_i (k_i + 1), V]; request i owns k_i + 1 consecutive rows.
        Rows of greedy requests may hold logits instead of probabilities.
    draft_token_ids: per request, its k_i drafts.
    draft_probs: [sum_i k_i, V] (request i owns k_i consecutive rows), or None
        for a deterministic proposer. Rows of greedy requests are ignored.
    greedy: per request (or one bool for all).
    generators: per request generator or None (default generator); None = all
        default.

    Returns, per request, the output of :func:`rejection_sample`. Costs at most
    two host syncs for the whole batch.
    """
    num_reqs = len(draft_token_ids)
    if isinstance(greedy, bool):
        greedy = [greedy] * num_reqs
    if generators is None:
        generators = [None] * num_reqs
    if len(greedy) != num_reqs or len(generators) != num_reqs:
        raise ValueError("greedy / generators must have one entry per request")
    ks = [len(d) for d in draft_token_ids]
    total_rows = sum(ks) + num_reqs
    if target_probs.dim() != 2 or target_probs.shape[0] != total_rows:
        raise ValueError(
            f"target_probs must be [{total_rows}, V], got {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and (
        draft_probs.dim() != 2
        or draft_probs.shape[0] != sum(ks)
        or draft_probs.shape[1] != target_probs.shape[1]
    ):
        raise ValueError(
            f"draft_probs must be [{sum(ks)}, {target_probs.shape[1]}], "
            f"got {tuple(draft_probs.shape)}"
        )
    if num_reqs == 0:
        return []
    device = target_probs.device

    # Row bookkeeping: t_start[i] = first target row, q_start[i] = first draft row.
    t_start, q_start = [], []
    t, q = 0, 0
    for k in ks:
        t_start.append(t)
        q_start.append(q)
        t += k + 1
        q += k
    flat_drafts = [tok for d in draft_token_ids for tok in d]
    # Target row of each draft: request i's draft j is scored by row t_start[i] + j.
    draft_rows = [t_start[i] + j for i, k in enumerate(ks) for j in range(k)]
    sampled = [i for i in range(num_reqs) if not greedy[i]]
    any_greedy = len(sampled) < num_reqs

    # ---- pass 1: acceptance of every draft, vectorised over the batch ------
    accept_cpu = None
    argmax_cpu = None
    if flat_drafts:
        d_t = torch.tensor(flat_drafts, dtype=torch.long, device=device)
        rows_t = torch.tensor(draft_rows, dtype=torch.long, device=device)
        accept = torch.zeros(len(flat_drafts), dtype=torch.bool, device=device)
        if any_greedy:
            argmax = target_probs.argmax(dim=-1)
            accept = argmax.index_select(0, rows_t) == d_t
        if sampled:
            s_mask = torch.tensor(
                [not greedy[i] for i, k in enumerate(ks) for _ in range(k)],
                dtype=torch.bool,
                device=device,
            )
            p_d = target_probs[rows_t, d_t].float()
            if draft_probs is None:
                q_d = torch.ones_like(p_d)
            else:
                q_d = draft_probs[torch.arange(len(flat_drafts), device=device), d_t].float()
            u = _uniforms(ks, sampled, generators, len(flat_drafts), q_start, device)
            # u in [0, 1): P(u * q < p) = min(1, p / q). q == 0 (cannot happen
            # for a draft drawn from q) accepts iff p > 0.
            s_accept = u * q_d < p_d
            accept = torch.where(s_mask, s_accept, accept)
        accept_cpu = accept.tolist()
    elif any_greedy:
        argmax = target_probs.argmax(dim=-1)

    # ---- number accepted per request ---------------------------------------
    num_acc = []
    for i, k in enumerate(ks):
        m = 0
        qs = q_start[i]
        while m < k and accept_cpu[qs + m]:
            m += 1
        num_acc.append(m)

    # ---- greedy: extra token is the argmax at row m ------------------------
    extra: list[int | None] = [None] * num_reqs
    if any_greedy:
        g_idx = [i for i in range(num_reqs) if greedy[i]]
        sel = torch.tensor([t_start[i] + num_acc[i] for i in g_idx], dtype=torch.long, device=device)
        argmax_cpu = argmax.index_select(0, sel).tolist()
        for i, tok in zip(g_idx, argmax_cpu):
            extra[i] = tok

    # ---- sampling: recovered (m < k) or bonus (m == k) ---------------------
    if sampled:
        tok = _sample_extra(
            target_probs, draft_token_ids, draft_probs, ks, num_acc,
            t_start, q_start, sampled, generators, device,
        )
        for i, tk in zip(sampled, tok):
            extra[i] = tk

    return [
        list(draft_token_ids[i][: num_acc[i]]) + [int(extra[i])] for i in range(num_reqs)
    ]


def _uniforms(ks, sampled, generators, n, q_start, device) -> torch.Tensor:
    """One uniform per draft of each sampled request (zeros elsewhere)."""
    u = torch.zeros(n, dtype=torch.float32, device=device)
    shared = []  # draft rows of sampled requests without a generator
    for i in sampled:
        k = ks[i]
        if k == 0:
            continue
        g = generators[i]
        if g is None:
            shared.extend(range(q_start[i], q_start[i] + k))
        else:
            u[q_start[i] : q_start[i] + k] = torch.rand(k, generator=g, device=device)
    if shared:
        idx = torch.tensor(shared, dtype=torch.long, device=device)
        u[idx] = torch.rand(len(shared), device=device)
    return u


def _sample_extra(
    target_probs, draft_token_ids, draft_probs, ks, num_acc,
    t_start, q_start, sampled, generators, device,
) -> list[int]:
    """Draw the recovered/bonus token of every sampled request."""
    rows = torch.tensor([t_start[i] + num_acc[i] for i in sampled], dtype=torch.long, device=device)
    p = target_probs.index_select(0, rows).float()
    rejected = [num_acc[i] < ks[i] for i in sampled]
    dist = p
    if any(rejected):
        rej_pos = [j for j, r in enumerate(rejected) if r]
        rej_t = torch.tensor(rej_pos, dtype=torch.long, device=device)
        p_rej = p.index_select(0, rej_t)
        if draft_probs is None:
            d = torch.tensor(
                [draft_token_ids[sampled[j]][num_acc[sampled[j]]] for j in rej_pos],
                dtype=torch.long,
                device=device,
            )
            residual = p_rej.scatter(1, d.unsqueeze(1), 0.0)
        else:
            q_rows = torch.tensor(
                [q_start[sampled[j]] + num_acc[sampled[j]] for j in rej_pos],
                dtype=torch.long,
                device=device,
            )
            residual = (p_rej - draft_probs.index_select(0, q_rows).float()).clamp_(min=0.0)
        # Residual can vanish only through rounding (p ~= q): fall back to p.
        s = residual.sum(dim=-1, keepdim=True)
        residual = torch.where(s > 0, residual, p_rej)
        dist = p.index_copy(0, rej_t, residual)

    out = torch.empty(len(sampled), dtype=torch.long, device=device)
    shared = []
    for j, i in enumerate(sampled):
        g = generators[i]
        if g is None:
            shared.append(j)
        else:
            out[j] = torch.multinomial(dist[j], 1, generator=g)[0]
    if shared:
        idx = torch.tensor(shared, dtype=torch.long, device=device)
        out[idx] = torch.multinomial(dist.index_select(0, idx), 1).squeeze(1)
    return out.tolist()
