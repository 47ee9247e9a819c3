"""Draft-tree rows on the CPU decode path (luceio/models/cpu_decode.py): the attention of a
verify step whose rows are draft trees (`spec.tree`). A row sees its request's cached context
before the tree and, of the step's rows, those its ancestor mask names (its ancestors, the root
and itself), as `attention.paged_attention_ref` computes it with a `tree_mask` (no tree span,
no sliding window). q/k norm, rotary at the row's own position (root + depth) and the KV write
are `decode_cpu`'s; a request's rows come in order, parents first, so a row's K and V are in
the cache before any row that sees it reads them.
"""
from __future__ import annotations

import numpy as np

from .decode_cpu import _dots, _exp, _head_scratch, _njit, _rope_write, _store


@_njit
def _attend_keys(q, kv, table, h, keys, n, scale, top, total, acc):
    """`decode_cpu._attend_range` for KV head h's query group q [group, D] over the cache
    indices keys[:n] (n > 0) instead of a range: per query the scores' max (`top`), the sum
    of their exponentials (`total`) and the unnormalised output (`acc` [group, D])."""
    block_size = kv.shape[2]
    group = q.shape[0]
    scores = np.empty((group, n), np.float32)
    for i in range(n):
        t = keys[i]
        key = kv[0, table[t // block_size], t % block_size, h]
        g = 0
        while g < group:
            width = 4 if group - g >= 4 else (2 if group - g >= 2 else 1)
            _dots(q, key, g, width, scale, scores, i)
            g += width
    for g in range(group):
        top[g] = scores[g].max()
        s = np.float32(0)
        for i in range(n):
            e = _exp(scores[g, i] - top[g])
            scores[g, i] = e
            s += e
        total[g] = s
    acc[:] = 0
    for i in range(n):
        t = keys[i]
        v = kv[1, table[t // block_size], t % block_size, h]
        for g in range(group):
            s0 = scores[g, i]
            row = acc[g]
            for j in range(row.shape[0]):
                row[j] += s0 * v[j]


@_njit
def tree_attention(qkv, cos_sin, positions, kv, slots, block_tables, seq_lens, firsts, words,
                   num_heads, q_norm, k_norm, eps, out, scale):
    """`decode_cpu.decode_attention` for rows of draft trees: row b (one entry per row in
    every array) sees the cache indices below firsts[b] (its request's first row of the step)
    and, of those from firsts[b] up to its own (seq_lens[b] - 1), firsts[b] + j where bit j of
    words[b] is set (j < 64; from 64 on, every one: the reference's rule). A request without a
    tree passes words -1: causal attention."""
    num_kv_heads, head_dim = kv.shape[3], kv.shape[4]
    group, q, acc, top, total = _head_scratch(num_heads, kv)
    scale = np.float32(scale)
    keys = np.empty(max(int(seq_lens.max()), 1), np.int64)
    for b in range(qkv.shape[0]):
        _rope_write(b, qkv, cos_sin, positions, kv, slots, num_heads, q_norm, k_norm, eps, q)
        first, end, word = firsts[b], seq_lens[b], words[b]
        n = 0
        for t in range(first):
            keys[n] = t
            n += 1
        for j in range(end - first):
            if j >= 64 or (word >> j) & 1:
                keys[n] = first + j
                n += 1
        for h in range(num_kv_heads):
            _attend_keys(q[h * group:(h + 1) * group], kv, block_tables[b], h, keys, n, scale,
                         top, total, acc)
            for g in range(group):
                for j in range(head_dim):
                    _store(out, b, (h * group + g) * head_dim + j, acc[g, j] / total[g])
