"""Logprobs of many rows (prompt logprobs) are computed on the CPU a slice of rows at a time
(`sampler.LOGPROB_CPU_SLICE_ELEMS`): the result is the whole-block computation's, bit for bit."""
from __future__ import annotations

import pytest
import torch

from conftest import engine_kwargs
from luceio import LLM, SamplingParams, sampler
from luceio.sampler import Sampler


def _whole_block(raw: torch.Tensor, tokens: torch.Tensor, k: int):
    lp = raw.float().log_softmax(-1)
    chosen = lp.gather(1, tokens[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    top_v, top_i = lp.topk(k, dim=-1)
    return chosen, ranks, top_v, top_i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 5])
def test_sliced_logprobs_equal_the_whole_block(monkeypatch, dtype, k):
    gen = torch.Generator().manual_seed(k)
    rows, vocab = 37, 301
    # integer logits: many ties, so ranks and top-k order are checked where they are fragile
    raw = torch.randint(-6, 6, (rows, vocab), generator=gen).to(dtype)
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    num = [k] * rows
    whole = Sampler.logprob_tensors(raw, tokens, num)  # 37 x 301 elements: one slice
    ref = _whole_block(raw, tokens, k)
    for got, want in zip((whole.chosen, whole.ranks, whole.top_values, whole.top_ids), ref):
        assert torch.equal(got, want)
    monkeypatch.setattr(sampler, "LOGPROB_CPU_SLICE_ELEMS", 4 * vocab)  # 4 rows a slice, 10 slices
    sliced = Sampler.logprob_tensors(raw, tokens, num)
    for got, want in zip((sliced.chosen, sliced.ranks, sliced.top_values, sliced.top_ids), ref):
        assert torch.equal(got, want)
    assert torch.equal(sliced.token_ids, tokens)
    assert sliced.to_dicts(num) == whole.to_dicts(num)
    # a vocabulary wider than the slice still goes one row at a time
    monkeypatch.setattr(sampler, "LOGPROB_CPU_SLICE_ELEMS", 7)
    one = Sampler.logprob_tensors(raw, tokens, num)
    assert one.to_dicts(num) == whole.to_dicts(num)


def test_prompt_logprobs_in_slices_equal_one_block(monkeypatch, tiny_llama):
    prompt = list(range(3, 70))
    params = SamplingParams(max_tokens=3, prompt_logprobs=3, logprobs=2, temperature=0.0,
                            ignore_eos=True)
    llm = LLM(tiny_llama, **engine_kwargs(enable_prefix_caching=False))
    vocab = llm.engine.runner.cfg.vocab_size
    whole = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    monkeypatch.setattr(sampler, "LOGPROB_CPU_SLICE_ELEMS", 5 * vocab)  # 5 rows a slice
    sliced = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert len(sliced.prompt_logprobs) == len(prompt) and sliced.prompt_logprobs[0] is None
    assert sliced.prompt_logprobs == whole.prompt_logprobs
    assert sliced.outputs[0].token_ids == whole.outputs[0].token_ids
    assert sliced.outputs[0].logprobs == whole.outputs[0].logprobs
