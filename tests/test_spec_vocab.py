"""A draft model whose embedding has fewer padding rows than the target's (Qwen2.5: 151,936
rows up to 3B, 152,064 from 7B, one tokenizer): speculation stays exact, the target's ids past
the draft's rows reach the draft as id 0, and the draft's distributions cover the target's
ids with zero mass on the rows it lacks (tiny random models, fp32, CPU)."""
import pytest
import torch

from conftest import VOCAB, engine_kwargs, make_tiny_model
from luceio import LLM, SamplingParams
from luceio.request import Request
from luceio.spec.proposer import ProposalInput

PAD = 64
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def padded_target(tmp_path_factory):
    """A tiny llama with PAD rows past the tests' tokenizer, as a larger Qwen2.5 has."""
    return make_tiny_model(str(tmp_path_factory.mktemp("padded") / "m"), "llama", seed=7,
                           vocab_size=VOCAB + PAD)


def prompts(n):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def generate(path, params, **kw):
    llm = LLM(path, **engine_kwargs(**kw))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(8)], params)
    return [o.outputs[0].token_ids for o in outs], llm.engine


@pytest.mark.parametrize("spec", [dict(num_speculative_tokens=4),
                                  dict(num_speculative_tokens=3, spec_tree_budget=6)],
                         ids=["chain", "tree"])
@pytest.mark.parametrize("sched", [{}, {"max_num_batched_tokens": 32, "num_kv_blocks": 10}],
                         ids=["plain", "chunked+preempt"])
def test_greedy_with_a_shorter_draft_vocabulary_is_exact(padded_target, tiny_llama, spec,
                                                         sched):
    expected, _ = generate(padded_target, GREEDY)
    # the target does emit ids the draft has no row for, so the mapping is exercised
    assert any(t >= VOCAB for out in expected for t in out)
    got, eng = generate(padded_target, GREEDY, speculative_method="draft",
                        draft_model=tiny_llama, **spec, **sched)
    assert got == expected
    assert eng.spec.stats.num_draft_tokens > 0
    assert all(max(s.all_token_ids, default=0) < VOCAB
               for s in eng.spec.proposer.seqs.values())
    if sched:
        assert eng.scheduler.num_preemptions > 0


def test_sampled_drafts_have_the_targets_width(padded_target, tiny_llama):
    """The proposer's distributions are [drafts, target vocab], zero past the draft's rows, and
    a request whose tokens include such ids drafts from id 0 in their place."""
    llm = LLM(padded_target, **engine_kwargs(speculative_method="draft", draft_model=tiny_llama,
                                             num_speculative_tokens=3))
    proposer = llm.engine.spec.proposer
    params = SamplingParams(temperature=0.9, seed=4, max_tokens=8)
    tokens = [5, 9, VOCAB + 3, 17, VOCAB + PAD - 1, 22]
    req = Request("r0", tokens, params, set(), 512)
    prop = proposer.propose([ProposalInput(list(tokens), 3, req)])
    assert len(prop.drafts[0]) == 3 and all(0 <= t < VOCAB for t in prop.drafts[0])
    assert prop.probs.shape == (3, VOCAB + PAD)
    assert torch.all(prop.probs[:, VOCAB:] == 0)
    assert torch.allclose(prop.probs.sum(-1), torch.ones(3), atol=1e-5)
    fed = proposer.seqs["r0"].all_token_ids
    assert fed[:6] == [5, 9, 0, 17, 0, 22]
    # the whole engine with sampled requests: every token a target id
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(4)],
                        SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 24 and
               max(o.outputs[0].token_ids) < VOCAB + PAD for o in outs)
    assert llm.engine.spec.stats.num_draft_tokens > 0


def test_draft_vocabularies_that_do_not_fit_are_refused(padded_target, tiny_llama):
    with pytest.raises(ValueError, match="must share a tokenizer"):  # larger than the target's
        LLM(tiny_llama, **engine_kwargs(speculative_method="draft", draft_model=padded_target))
    with pytest.raises(ValueError, match="vocabulary size"):  # the prompt's ids reach the draft
        LLM(padded_target, **engine_kwargs(draft_model=tiny_llama, spec_prefill_keep=0.3))
