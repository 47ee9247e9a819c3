"""The CPU decode path on verify steps (luceio/models/cpu_decode.py, `VERIFY_ROWS`): a
request's rows of a chain attend causally, each as a one-token request ending at its own cache
index; rows of a draft tree attend to their ancestors (kernels/rows_attention_cpu.py). The step equals
the module forward (hidden states and KV cache), and the engine sends chain and tree verifies
down this path, not prompt chunks (nor trees in pipeline stages or on Gemma's step)."""
from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, engine_kwargs, make_tiny_gemma
from test_cpu_decode import decoder_vs_module_forward
from luceio import LLM, SamplingParams
from luceio.models import AttnMetadata
from luceio.models.cpu_decode import VERIFY_ROWS, CpuDecoder

pytest.importorskip("numba")


def _verify_batch(runner, seq_lens: list[int], q_lens: list[int], seed: int, trees=None):
    """Requests whose last q_lens[i] of seq_lens[i] cached tokens are this step's rows;
    `trees`: per request a `DraftTree` of q_lens[i] - 1 nodes, or None (a chain)."""
    g = torch.Generator().manual_seed(seed)
    bs = runner.block_size
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g))
    counts = [-(-n // bs) for n in seq_lens]
    blocks = torch.randperm(runner.num_blocks, generator=g)[:sum(counts)].split(counts)
    tables = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32)
    for i, b in enumerate(blocks):
        tables[i, :len(b)] = b
    idx = torch.cat([torch.arange(n - q, n) for n, q in zip(seq_lens, q_lens)])
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(q_lens))
    slots = tables[seq, idx // bs].long() * bs + idx % bs
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttnMetadata(slots, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl,
                        max(q_lens), max(seq_lens))
    ids = torch.randint(0, runner.cfg.vocab_size, (len(idx),), generator=g)
    pos = idx.long()
    if trees is not None:  # rows at root + depth, words of their ancestors
        from luceio.spec.tree import masks_tensor
        words, pos = [], []
        for n, q, tree in zip(seq_lens, q_lens, trees):
            root = n - q
            if tree is None:
                words += [-1] * q
                pos += range(root, n)
            else:
                words += masks_tensor(tree.ancestor_masks()).tolist()
                pos += [root] + [root + d for d in tree.depths()]
        meta.tree_mask = torch.tensor(words, dtype=torch.int64)
        pos = torch.tensor(pos, dtype=torch.int64)
    return ids, pos, meta


def _against_module(runner, seq_lens, q_lens, seed=0, trees=None):
    ids, pos, meta = _verify_batch(runner, seq_lens, q_lens, seed, trees)
    return decoder_vs_module_forward(runner, ids, pos, meta)


@torch.inference_mode()
def _rows_changed(runner, ids, pos, meta, row: int) -> list[bool]:
    """Which rows' hidden states change when row `row`'s token does (same KV cache)."""
    base = [kv.clone() for kv in runner.kv_caches]
    a = runner.cpu_decoder(ids, pos, meta).clone()
    for kv, b in zip(runner.kv_caches, base):
        kv.copy_(b)
    ids2 = ids.clone()
    ids2[row] = (ids2[row] + 1) % runner.cfg.vocab_size
    b = runner.cpu_decoder(ids2, pos, meta)
    return [not torch.equal(a[r], b[r]) for r in range(len(ids))]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_chain_verify_equals_module_forward(tiny_models, arch):
    runner = LLM(tiny_models[arch], **engine_kwargs()).engine.runner
    for seq_lens, q_lens in (([37], [5]), ([5, 37, 20, 16], [3, 1, 5, 2]), ([40, 9], [16, 4])):
        hidden_err, kv_err = _against_module(runner, seq_lens, q_lens)
        assert hidden_err < 1e-5 and kv_err < 1e-6


def test_chain_verify_rows_see_only_their_causal_prefix(tiny_llama):
    """Changing a later row's token changes no earlier row's hidden state, and does change
    its own and the rows after it."""
    runner = LLM(tiny_llama, **engine_kwargs()).engine.runner
    assert _rows_changed(runner, *_verify_batch(runner, [30], [5], seed=1), 3) == \
        [False, False, False, True, True]


def test_gemma3_chain_verify_with_sliding_windows(tmp_path):
    runner = LLM(make_tiny_gemma(str(tmp_path / "g"), "gqa_tied", seed=3),
                 **engine_kwargs()).engine.runner
    assert any(layer.window for layer in runner.cpu_decoder.layers)
    hidden_err, kv_err = _against_module(runner, [37, 12], [4, 3])  # longer than the windows
    assert hidden_err < 1e-5 and kv_err < 1e-6


def _tree():
    from luceio.spec.tree import DraftTree
    # root -> a, b; a -> c, d; b -> e; c -> f
    return DraftTree([11, 12, 13, 14, 15, 16], [-1, -1, 0, 0, 1, 2])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tree_verify_equals_module_forward(tiny_models, arch):
    runner = LLM(tiny_models[arch], **engine_kwargs()).engine.runner
    assert runner.cpu_decoder.trees
    hidden_err, kv_err = _against_module(runner, [37, 20, 9], [7, 3, 7],
                                         trees=[_tree(), None, _tree()])
    assert hidden_err < 1e-5 and kv_err < 1e-6


def test_tree_rows_see_only_their_ancestors(tiny_llama):
    """A node's token changes its own row and its descendants' rows, no other."""
    runner = LLM(tiny_llama, **engine_kwargs()).engine.runner
    batch = _verify_batch(runner, [30], [7], seed=2, trees=[_tree()])
    assert _rows_changed(runner, *batch, 1) == \
        [False, True, False, True, True, False, True]  # node a (row 1): a, c, d, f


def test_gemma_step_takes_no_trees(tmp_path):
    runner = LLM(make_tiny_gemma(str(tmp_path / "g"), "gqa_tied", seed=3),
                 **engine_kwargs()).engine.runner
    assert not runner.cpu_decoder.trees


def test_takes_verifies_not_prompts_nor_long_rows():
    assert CpuDecoder.takes(4, 4)
    assert not CpuDecoder.takes(12, 4, max_query_len=5)  # by default: prompt rows
    assert CpuDecoder.takes(12, 4, max_query_len=5, prefill=False)
    assert not CpuDecoder.takes(12, 4, max_query_len=5, prefill=False, tree=True)
    assert not CpuDecoder.takes(80, 1, max_query_len=VERIFY_ROWS + 1, prefill=False)


def test_engine_sends_chain_and_tree_verifies(tiny_llama):
    """A speculating engine: its chain and tree verify steps go down this path (rows beyond
    one a request; a tree's with its mask); greedy output equals plain decoding either way."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(10, 40)) * 2]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in
           LLM(tiny_llama, **engine_kwargs()).generate([{"prompt_token_ids": p} for p in prompts],
                                                       params)]
    for tree_budget in (0, 6):
        llm = LLM(tiny_llama, **engine_kwargs(speculative_method="draft", draft_model=tiny_llama,
                                              num_speculative_tokens=3,
                                              spec_tree_budget=tree_budget))
        spec = llm.engine.spec
        spec.mode = lambda batch_size, step=None: "tree" if tree_budget else "chain"
        runner = llm.engine.runner
        calls = []
        decoder = runner.cpu_decoder

        class Spy:
            trees = decoder.trees

            def __call__(self, ids, pos, meta, *a):
                calls.append((len(ids), meta.max_query_len, meta.tree_mask is not None))
                return decoder(ids, pos, meta, *a)
        runner.cpu_decoder = Spy()
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in out] == ref
        assert spec.stats.num_verify_steps > 0
        multi = [c for c in calls if c[1] > 1]
        assert multi and all(c[2] == bool(tree_budget) for c in multi), calls
