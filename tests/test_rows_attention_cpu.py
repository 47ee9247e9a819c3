"""The CPU decode path's attention by query lanes (luceio/kernels/rows_attention_cpu.py): a
request's rows (a decode token, a verify step's chain or tree rows) read each key once. Against
the torch references (q/k norm, rotary, KV write, paged attention with a tree mask), and bit
for bit against itself: a verify row equals the decode step at its position, a tree row the
decode step of its path, whatever the rows, requests and threads beside it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from luceio.kernels import decode_cpu
from luceio.kernels.attention import paged_attention_ref, write_kv_ref
from luceio.kernels.norm import rms_norm_ref
from luceio.kernels.rotary import build_cos_sin_cache, rotary_ref

pytest.importorskip("numba")
from luceio.kernels.rows_attention_cpu import RowsAttention  # noqa: E402

as_numpy = decode_cpu.as_numpy


def _setup(heads, kv_heads, dim, block_size, firsts, q_lens, seed, num_blocks=64, qk_norm=False,
           io_dtype=torch.float32, kv_dtype=torch.float32):
    """A random cache (fp32, or bf16: --kv-cache-dtype); request r's rows are q_lens[r] tokens
    at cache indices firsts[r] .. (positions the same), its blocks drawn at random. Returns a
    dict of the kernel's inputs."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(kv_dtype)
    counts = [-(-(f + q) // block_size) for f, q in zip(firsts, q_lens)]
    blocks = torch.randperm(num_blocks, generator=g)[:sum(counts)].split(counts)
    tables = torch.zeros(len(firsts), max(counts), dtype=torch.int32)
    for i, b in enumerate(blocks):
        tables[i, :len(b)] = b
    seq = torch.repeat_interleave(torch.arange(len(firsts)), torch.tensor(q_lens))
    idx = torch.cat([torch.arange(f, f + q) for f, q in zip(firsts, q_lens)])
    rows = len(idx)
    return dict(
        kv=kv, tables=tables, seq=seq, idx=idx, pos=idx.clone(),
        slots=tables[seq, idx // block_size].long() * block_size + idx % block_size,
        qkv=torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(io_dtype),
        norms=(torch.rand(2, dim, generator=g) + 0.5) if qk_norm else torch.zeros(2, 0),
        cos_sin=build_cos_sin_cache(dim, 512, 10000.0), heads=heads,
        starts=torch.tensor([0] + list(q_lens)).cumsum(0), firsts=torch.tensor(firsts),
        words=torch.full((rows,), -1, dtype=torch.int64), io_dtype=io_dtype)


def _run(c, kv=None, rows=None, threads=None, span=None):
    """The kernel over rows `rows` (default all) of c, its keys cut at multiples of `span`
    (default `KEY_SPAN`): (out [rows, H D], the cache after)."""
    kv = (c["kv"] if kv is None else kv).clone()
    sel = torch.arange(len(c["idx"])) if rows is None else torch.tensor(rows)
    seq = c["seq"][sel]
    reqs, counts = torch.unique_consecutive(seq, return_counts=True)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    lens = (c["idx"][sel] + 1).numpy()
    plan = RowsAttention(starts.numpy(), lens, c["words"][sel].numpy(),
                         c["tables"][seq].numpy(), c["heads"], kv.shape[3], kv.shape[4], span)
    out = torch.empty(len(sel), c["heads"] * kv.shape[4], dtype=c["io_dtype"])
    if threads is not None:
        import numba
        before = numba.get_num_threads()
        numba.set_num_threads(threads)
    try:
        plan(as_numpy(c["qkv"][sel].contiguous()), c["cos_sin"].numpy(), c["pos"][sel].numpy(),
             as_numpy(kv), c["slots"][sel].numpy(), c["norms"][0].numpy(), c["norms"][1].numpy(),
             1e-6, as_numpy(out), kv.shape[4] ** -0.5)
    finally:
        if threads is not None:
            numba.set_num_threads(before)
    return out, kv


def _reference(c, mask=None):
    """q/k norm, rotary, KV write, then paged attention of every row as the references compute
    it (causal rows, or `mask` [rows, rows of its request] of the keys at the step's rows)."""
    heads, (_, _, bs, kvh, dim) = c["heads"], c["kv"].shape
    kv = c["kv"].clone()
    q, k, v = c["qkv"].float().split([heads * dim, kvh * dim, kvh * dim], -1)
    q, k = q.reshape(-1, heads, dim).clone(), k.reshape(-1, kvh, dim).clone()
    if c["norms"].numel():
        q, k = rms_norm_ref(q, c["norms"][0], 1e-6), rms_norm_ref(k, c["norms"][1], 1e-6)
    q, k = q.contiguous(), k.contiguous()
    rotary_ref(c["pos"], q, k, c["cos_sin"])
    write_kv_ref(k, v.reshape(-1, kvh, dim), kv[0], kv[1], c["slots"])
    outs = []
    for r in range(len(c["idx"])):  # one query each, its own keys
        req, first = int(c["seq"][r]), int(c["firsts"][c["seq"][r]])
        keys = list(range(first)) + [first + j for j in range(int(c["idx"][r]) - first + 1)
                                     if mask is None or mask[r][j]]
        key_idx = torch.tensor(keys)
        blocks = c["tables"][req, key_idx // bs].long()
        kk, vv = kv[0, blocks, key_idx % bs], kv[1, blocks, key_idx % bs]  # [n, kvh, dim]
        lone = torch.zeros(2, len(keys), 1, kvh, dim)
        lone[0, :, 0], lone[1, :, 0] = kk, vv
        table = torch.arange(len(keys), dtype=torch.int32)[None]
        outs.append(paged_attention_ref(q[r:r + 1], lone[0], lone[1], table,
                                        torch.tensor([len(keys)], dtype=torch.int32),
                                        torch.tensor([0, 1], dtype=torch.int32), 1, len(keys),
                                        dim ** -0.5).reshape(1, -1))
    return torch.cat(outs), kv


@pytest.mark.parametrize("heads,kv_heads,dim,block_size,qk_norm", [
    (14, 2, 64, 16, False),   # the 0.5B's group of 7: a row in one chunk of 8 lanes
    (9, 3, 32, 5, True),      # blocks of 5 keys: value passes of 8 cut by blocks
    (16, 2, 24, 16, False),   # group 8; head dim 24: one vector of 16, then one by one
    (4, 4, 16, 16, False),    # multi-head: a lane a row
])
@pytest.mark.parametrize("io_dtype,kv_dtype,span", [(torch.float32, torch.float32, None),
                                                    (torch.bfloat16, torch.float32, None),
                                                    (torch.float32, torch.bfloat16, None),
                                                    (torch.float32, torch.float32, 24)])
def test_rows_equal_references(heads, kv_heads, dim, block_size, qk_norm, io_dtype, kv_dtype,
                               span):
    """fp32 or bf16 activations; an fp32 or a bf16 cache (keys and values written rounded
    to nearest even, read widened: the reference reads the same cache); keys cut into work
    items of 24 (their softmaxes merged)."""
    c = _setup(heads, kv_heads, dim, block_size, [37, 3, 90], [5, 1, 9], seed=1,
               qk_norm=qk_norm, io_dtype=io_dtype, kv_dtype=kv_dtype)
    out, kv = _run(c, span=span)
    want, want_kv = _reference(c)
    if kv_dtype == torch.bfloat16:  # fp32 k / v rounded to bf16: at most one rounding flip
        assert (kv.float() - want_kv.float()).abs().max() <= \
            2 ** -8 * want_kv.float().abs().max()
        kv = want_kv  # attention over the reference's cache is compared below
        out, _ = _run(c, kv=want_kv, span=span)
    torch.testing.assert_close(kv, want_kv, rtol=1e-6, atol=1e-6)
    rtol, atol = (1e-5, 1e-6) if io_dtype == torch.float32 else (2 ** -7, 1e-5)
    torch.testing.assert_close(out.float(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("heads,kv_heads,dim,block_size,kv_dtype,span", [
    (14, 2, 64, 16, torch.float32, None), (9, 3, 32, 5, torch.float32, None),
    (24, 2, 16, 16, torch.float32, None), (14, 2, 64, 16, torch.bfloat16, None),
    (14, 2, 64, 16, torch.float32, 40), (9, 3, 32, 5, torch.bfloat16, 7)])
def test_verify_row_equals_decode_step_bitwise(heads, kv_heads, dim, block_size, kv_dtype, span):
    """Every row of a verify step (chains of 1-17 rows over 0-300 cached keys, several
    requests, lanes across chunks) equals, bit for bit, the decode step of its position alone
    on one thread, and a step of two threads; an fp32 or a bf16 cache; keys in work items of
    `KEY_SPAN` or of 40 and 7 (cut inside the chains: a row's items and their merge are its
    decode step's)."""
    c = _setup(heads, kv_heads, dim, block_size, [300, 0, 41, 7], [9, 1, 17, 3], seed=3,
               num_blocks=128, kv_dtype=kv_dtype)
    out, kv = _run(c, threads=2, span=span)
    for r in range(len(c["idx"])):
        alone, _ = _run(c, kv=kv, rows=[r], threads=1, span=span)  # its K and V: in kv
        assert torch.equal(alone[0], out[r]), r
    again, _ = _run(c, threads=1, span=span)
    assert torch.equal(again, out)


@pytest.mark.parametrize("span", [None, 72, 73, 32])
def test_tree_rows_see_their_ancestors_and_equal_their_paths_decode(span):
    """Tree rows (root -> a, b; a -> c, d; b -> e; c -> f) see the context and their
    ancestors: equal to the reference with the tree mask, and each row bit for bit equal to
    the decode step of its path with the path's K and V moved to consecutive cache indices
    (as the commit of an accepted path leaves them); work items cut inside the tree's rows
    (indices 70-76) at 72 and 73: a row's ancestors go to items by their ordinals (the
    indices they take on its path), as its path's decode step cuts them."""
    parents = [-1, 0, 0, 1, 1, 2, 3]  # rows: root, a, b, c, d, e, f
    depth = [0, 1, 1, 2, 2, 2, 3]
    heads, kvh, dim, bs = 14, 2, 64, 16
    c = _setup(heads, kvh, dim, bs, [70, 20], [7, 2], seed=5)
    paths = []
    for r in range(7):
        path, p = [], r
        while p >= 0:
            path.insert(0, p)
            p = parents[p]
        paths.append(path)
    mask = [[j in paths[r] for j in range(7)] for r in range(7)] + [[True] * 2] * 2
    words = [sum(1 << j for j in range(7) if mask[r][j]) for r in range(7)]
    c["words"][:7] = torch.tensor(words)
    c["pos"][:7] = 70 + torch.tensor(depth)
    out, kv = _run(c, span=span)
    want, _ = _reference(c, mask=mask)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    first, table = 70, c["tables"][0]
    for r in range(1, 7):
        moved = kv.clone()  # the path's rows at cache indices first .. first + depth
        for d, node in enumerate(paths[r]):
            src, dst = first + node, first + d
            moved[:, table[dst // bs], dst % bs] = kv[:, table[src // bs], src % bs]
        one = dict(c, idx=torch.tensor([first + depth[r]]), seq=torch.tensor([0]),
                   pos=torch.tensor([70 + depth[r]]), qkv=c["qkv"][r:r + 1],
                   words=torch.tensor([-1]))
        one["slots"] = table[one["idx"] // bs].long() * bs + one["idx"] % bs
        alone, _ = _run(one, kv=moved, span=span)
        assert torch.equal(alone[0], out[r]), r


def test_padding_lanes_and_empty_context():
    """A request whose rows start at cache index 0 (no context) and a group of lanes that
    leaves most of its chunk as padding (3 heads a KV head) are handled: finite, equal to the
    reference."""
    c = _setup(3, 1, 16, 16, [0, 2], [4, 1], seed=7)
    out, _ = _run(c)
    want, _ = _reference(c)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # 4 rows x 3 heads: 12 lanes, chunks of 16 for the step; the other request's 3 in one
    plan = RowsAttention(np.array([0, 4, 5]), np.array([1, 2, 3, 4, 3]), np.full(5, -1),
                         np.zeros((5, 1), np.int32), 3, 1, 16)
    assert plan.work_items == 2 and plan.qT.shape[2] == 16
    plan = RowsAttention(np.array([0, 2, 3]), np.array([1, 2, 3]), np.full(3, -1),
                         np.zeros((3, 1), np.int32), 9, 1, 16)  # 18 lanes: two chunks
    assert plan.work_items == 3
