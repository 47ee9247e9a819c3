"""The padding that CUDA-graph replay applies (each request padded to q tokens, the batch to a
bucket) must not change any real token's hidden state. Checked on CPU with the reference
kernels by running the model on the padded batch exactly as a graph would."""
import numpy as np
import torch

from conftest import engine_kwargs
from luceio import LLM, SamplingParams
from luceio.cuda_graphs import StepGraphs
from luceio.models import AttnMetadata
from luceio.scheduler import ScheduledRequest, SchedulerOutput


def graph_tables(g, tables, num_blocks):
    """The graph's static block table as a replay sees it: `_fill` stages only the batch's
    columns, so the columns past them hold whatever block ids earlier steps left (random
    ones here: a kernel reading past a request's length would read another block's keys)."""
    gen = torch.Generator().manual_seed(7)
    static = torch.randint(0, num_blocks, (tables.shape[0], g.max_blocks), generator=gen,
                           dtype=torch.int32)
    static[:, :tables.shape[1]] = torch.from_numpy(tables.astype(np.int32))
    return static


def test_padded_batch_gives_the_same_hidden_states(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs(max_model_len=256))
    eng = llm.engine
    # three requests with cached prefixes of different lengths
    for i, n in enumerate([5, 21, 40]):
        eng.add_request(f"r{i}", {"prompt_token_ids": list(range(3 + i, 3 + i + n))},
                        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    reqs = list(eng.scheduler.running)
    # verify-like step: 1, 3 and 2 query tokens (drafts) per request
    for r, k in zip(reqs, [0, 2, 1]):
        r.spec_token_ids = [7] * k
    sched = SchedulerOutput([ScheduledRequest(r, 1 + len(r.spec_token_ids), list(r.spec_token_ids))
                             for r in reqs], [])
    for r in reqs:
        assert eng.kv.allocate_slots(r, 1 + len(r.spec_token_ids))
    h = eng.runner.prepare(sched, eng.kv).host
    runner, model = eng.runner, eng.runner.model
    t = torch.from_numpy
    meta = AttnMetadata(t(h.slot_mapping), t(h.block_tables), t(h.seq_lens), t(h.query_start_loc),
                        int(h.q_lens.max()), int(h.seq_lens.max()))
    snapshot = [kv.clone() for kv in runner.kv_caches]
    ref = model(t(h.input_ids), t(h.positions), runner.kv_caches, meta)

    for kv, s in zip(runner.kv_caches, snapshot):  # start from the same cache
        kv.copy_(s)
    g = StepGraphs(model, runner.kv_caches, max_num_seqs=8, max_model_len=256, block_size=16,
                   device=torch.device("cpu"), max_spec_tokens=3)
    bs, q, tree = g._bucket(h)
    assert (bs, q, tree) == (4, 3, False)
    tok, tables, lens = g._pad(h.input_ids, h.positions, h.slot_mapping, h.block_tables,
                               h.seq_lens, h.q_lens, bs, q)
    qsl = torch.arange(bs + 1, dtype=torch.int32) * q
    assert tables.shape == (bs, h.block_tables.shape[1])  # only the columns in use are staged
    pmeta = AttnMetadata(t(tok[2]), graph_tables(g, tables, runner.num_blocks),
                         t(lens.astype(np.int32)), qsl, q, 256)
    out = model(t(tok[0]), t(tok[1]), runner.kv_caches, pmeta)
    r = np.repeat(np.arange(len(h.q_lens)), h.q_lens)
    rows = r * q + (np.arange(len(r)) - np.repeat(h.query_start_loc[:-1], h.q_lens))
    torch.testing.assert_close(out[t(rows)], ref, rtol=1e-5, atol=1e-5)
    # padding wrote nothing: outside the real tokens' slots every cache entry is untouched,
    # and the real slots hold what the unpadded run wrote (up to GEMM batch-shape rounding)
    padded_caches = [kv.clone() for kv in runner.kv_caches]
    for kv, s in zip(runner.kv_caches, snapshot):
        kv.copy_(s)
    model(t(h.input_ids), t(h.positions), runner.kv_caches, meta)
    real = torch.zeros(padded_caches[0][0].shape[:2], dtype=torch.bool).view(-1)
    real[t(h.slot_mapping)] = True
    for a, b, s in zip(padded_caches, runner.kv_caches, snapshot):
        a, b, s = (x.flatten(1, 2) for x in (a, b, s))  # [2, slots, heads, dim]
        assert torch.equal(a[:, ~real], s[:, ~real])
        torch.testing.assert_close(a[:, real], b[:, real], rtol=1e-5, atol=1e-5)


def test_padded_tree_batch_gives_the_same_hidden_states(tiny_llama):
    """Tree speculation's graphs: each request's tree rows padded to the graph's rows, their
    mask words (-1 for padding) padded alike; the real rows' hidden states are the eager ones."""
    from luceio.spec.tree import DraftTree
    llm = LLM(tiny_llama, **engine_kwargs(max_model_len=256))
    eng = llm.engine
    for i, n in enumerate([5, 21, 40]):
        eng.add_request(f"r{i}", {"prompt_token_ids": list(range(3 + i, 3 + i + n))},
                        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    reqs = list(eng.scheduler.running)
    trees = [DraftTree([9, 4, 7, 8], [-1, -1, 0, 1]), DraftTree([5], [-1]),
             DraftTree([6, 2, 11, 12, 13], [-1, 0, 0, 1, 2])]
    for r, tr in zip(reqs, trees):
        r.spec_token_ids, r.spec_tree = list(tr.tokens), tr
    sched = SchedulerOutput([ScheduledRequest(r, 1 + tr.num_nodes, list(tr.tokens), tr)
                             for r, tr in zip(reqs, trees)], [])
    for r, tr in zip(reqs, trees):
        assert eng.kv.allocate_slots(r, 1 + tr.num_nodes)
    h = eng.runner.prepare(sched, eng.kv).host
    assert h.tree_mask is not None
    runner, model = eng.runner, eng.runner.model
    t = torch.from_numpy
    meta = AttnMetadata(t(h.slot_mapping), t(h.block_tables), t(h.seq_lens), t(h.query_start_loc),
                        int(h.q_lens.max()), int(h.seq_lens.max()), t(h.tree_mask))
    snapshot = [kv.clone() for kv in runner.kv_caches]
    ref = model(t(h.input_ids), t(h.positions), runner.kv_caches, meta)
    for kv, s in zip(runner.kv_caches, snapshot):
        kv.copy_(s)
    g = StepGraphs(model, runner.kv_caches, max_num_seqs=8, max_model_len=256, block_size=16,
                   device=torch.device("cpu"), max_spec_tokens=3, tree_rows=8)
    bs, q, tree = g._bucket(h)
    assert (bs, q, tree) == (4, 8, True)
    tok, tables, lens = g._pad(h.input_ids, h.positions, h.slot_mapping, h.block_tables,
                               h.seq_lens, h.q_lens, bs, q)
    r = np.repeat(np.arange(len(h.q_lens)), h.q_lens)
    rows = r * q + (np.arange(len(r)) - np.repeat(h.query_start_loc[:-1], h.q_lens))
    words = np.full(bs * q, -1, dtype=np.int64)  # as StepGraphs.run fills them
    words[rows] = h.tree_mask
    qsl = torch.arange(bs + 1, dtype=torch.int32) * q
    pmeta = AttnMetadata(t(tok[2]), graph_tables(g, tables, runner.num_blocks),
                         t(lens.astype(np.int32)), qsl, q, 256, t(words))
    out = model(t(tok[0]), t(tok[1]), runner.kv_caches, pmeta)
    torch.testing.assert_close(out[t(rows)], ref, rtol=1e-5, atol=1e-5)
    plain = AttnMetadata(*(getattr(pmeta, f) for f in ("slot_mapping", "block_tables", "seq_lens",
                                                         "query_start_loc", "max_query_len",
                                                         "max_seq_len")))
    out_causal = model(t(tok[0]), t(tok[1]), runner.kv_caches, plain)
    assert not torch.allclose(out_causal[t(rows)], ref, atol=1e-3)  # the masks mattered


def test_decode_padding_is_the_general_padding():
    """One token a request takes a shortcut in `_pad`: the same arrays as the general path
    (padding requests at position 0, slot -1, length q = 1)."""
    from types import SimpleNamespace
    ids, pos, slots = np.array([5, 6, 7]), np.array([9, 30, 2]), np.array([41, 87, 18])
    bt = np.array([[2, 0], [3, 5], [1, 0]], dtype=np.int32)
    seq_lens, q_lens = np.array([10, 31, 3], dtype=np.int32), np.ones(3, dtype=np.int32)
    tok, tables, lens = StepGraphs._pad(SimpleNamespace(max_blocks=4), ids, pos, slots, bt,
                                        seq_lens, q_lens, 4, 1)
    assert tok.tolist() == [[5, 6, 7, 0], [9, 30, 2, 0], [41, 87, 18, -1]]
    assert tables.tolist() == [[2, 0], [3, 5], [1, 0], [0, 0]]  # the batch's columns only
    assert lens.tolist() == [10, 31, 3, 1]
    # the general path (two tokens for one request) pads the same way around its rows
    ids2, pos2, slots2 = np.array([5, 6, 6, 7]), np.array([9, 29, 30, 2]), np.array([41, 86, 87, 18])
    tok2, _, lens2 = StepGraphs._pad(SimpleNamespace(max_blocks=4), ids2, pos2, slots2, bt,
                                     seq_lens, np.array([1, 2, 1], dtype=np.int32), 4, 2)
    assert tok2[:, [0, 2, 3, 4]].tolist() == [[5, 6, 6, 7], [9, 29, 30, 2], [41, 86, 87, 18]]
    assert lens2.tolist() == [11, 31, 4, 2]
