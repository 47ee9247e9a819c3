"""The CPU decode path on verify steps of draft chains (luceio/models/cpu_decode.py,
`VERIFY_ROWS`): a request's rows attend causally, each as a one-token request ending at its
own cache index; the step equals the module forward (hidden states and KV cache), and the
engine sends chain verifies down this path, not trees nor prompt chunks."""
from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, engine_kwargs, make_tiny_gemma
from luceio import LLM, SamplingParams
from luceio.models import AttnMetadata
from luceio.models.cpu_decode import VERIFY_ROWS, CpuDecoder

pytest.importorskip("numba")


def _verify_batch(runner, seq_lens: list[int], q_lens: list[int], seed: int):
    """Requests whose last q_lens[i] of seq_lens[i] cached tokens are this step's rows."""
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
    return ids, idx.long(), meta


@torch.inference_mode()
def _against_module(runner, seq_lens, q_lens, seed=0):
    ids, pos, meta = _verify_batch(runner, seq_lens, q_lens, seed)
    before = [kv.clone() for kv in runner.kv_caches]
    want = runner.model(ids, pos, runner.kv_caches, meta)
    want_kv = [kv.clone() for kv in runner.kv_caches]
    for kv, b in zip(runner.kv_caches, before):
        kv.copy_(b)
    got = runner.cpu_decoder(ids, pos, meta)
    assert got.shape == want.shape == (sum(q_lens), runner.cfg.hidden_size)
    kv_err = max(float((a - b).norm() / b.norm()) for a, b in zip(runner.kv_caches, want_kv))
    return float((got - want).norm() / want.norm()), kv_err


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
    ids, pos, meta = _verify_batch(runner, [30], [5], seed=1)
    base = [kv.clone() for kv in runner.kv_caches]
    with torch.inference_mode():
        a = runner.cpu_decoder(ids, pos, meta).clone()
        for kv, b in zip(runner.kv_caches, base):
            kv.copy_(b)
        ids2 = ids.clone()
        ids2[3] = (ids2[3] + 1) % runner.cfg.vocab_size
        b = runner.cpu_decoder(ids2, pos, meta)
    assert torch.equal(a[:3], b[:3])
    assert not torch.equal(a[3], b[3]) and not torch.equal(a[4], b[4])


def test_gemma3_chain_verify_with_sliding_windows(tmp_path):
    runner = LLM(make_tiny_gemma(str(tmp_path / "g"), "gqa_tied", seed=3),
                 **engine_kwargs()).engine.runner
    assert any(layer.window for layer in runner.cpu_decoder.layers)
    hidden_err, kv_err = _against_module(runner, [37, 12], [4, 3])  # longer than the windows
    assert hidden_err < 1e-5 and kv_err < 1e-6


def test_takes_chain_verifies_not_prompts_nor_long_rows():
    assert CpuDecoder.takes(4, 4)
    assert not CpuDecoder.takes(12, 4, max_query_len=5)  # by default: prompt rows
    assert CpuDecoder.takes(12, 4, max_query_len=5, prefill=False)
    assert not CpuDecoder.takes(12, 4, max_query_len=5, prefill=False, tree=True)
    assert not CpuDecoder.takes(40, 2, max_query_len=VERIFY_ROWS + 1, prefill=False)


def test_engine_sends_chain_verifies_not_trees(tiny_llama):
    """A speculating engine: its chain verify steps go down this path (rows beyond one a
    request), tree verifies do not; greedy output equals plain decoding either way."""
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
        runner.cpu_decoder = lambda ids, pos, meta, *a: calls.append(
            (len(ids), meta.max_query_len)) or decoder(ids, pos, meta, *a)
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in out] == ref
        assert spec.stats.num_verify_steps > 0
        multi = [c for c in calls if c[1] > 1]
        assert bool(multi) == (tree_budget == 0), calls
