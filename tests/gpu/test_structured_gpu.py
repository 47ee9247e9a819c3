"""Grammar-constrained decoding on the GPU: the masks are built on the host while the forward runs
and applied to logits on the device, with CUDA graphs, overlapped scheduling and speculation
(tests/test_structured.py has the CPU tests and says what the oracle is)."""
import pytest
import torch

from conftest import engine_kwargs
from structured_cases import SCHEMAS, _assert_all_valid, _json_params
from luceio import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
pytest.importorskip("xgrammar")

PROMPTS = ["Answer in JSON: " + "{\"a\": 1} " * 3] * len(SCHEMAS)


def _llm(path, **kw) -> LLM:
    return LLM(path, **engine_kwargs(device="cuda", **kw))


def test_every_schema_validates_with_graphs(tiny_llama):
    """Sampled (seeded) in one batch, with CUDA graphs: every document validates."""
    llm = _llm(tiny_llama)
    assert llm.engine.runner.graphs is not None
    outs = llm.generate(PROMPTS, [_json_params(s, temperature=1.0, seed=i)
                                  for i, s in enumerate(SCHEMAS)], use_tqdm=False)
    _assert_all_valid(outs, SCHEMAS)
    assert llm.engine.structured.num_active == 0
    stats = llm.engine.stats()  # constrained steps stay overlapped (pipeline.py)
    assert "structured output" not in stats.sync_steps and stats.overlapped_steps > 0


def test_greedy_with_graphs_equals_eager_and_the_unconstrained_requests_beside_them(tiny_llama):
    """Constrained and plain requests in one batch: the graphs' output equals eager's token for
    token, and the plain requests equal a run without any constrained request beside them."""
    params = [_json_params(s, temperature=0) for s in SCHEMAS[:8]]
    plain = SamplingParams(temperature=0, ignore_eos=True, max_tokens=32)
    mixed = PROMPTS[:8] + ["Say something."] * 4
    eager = _llm(tiny_llama, enforce_eager=True).generate(mixed, params + [plain] * 4,
                                                            use_tqdm=False)
    llm = _llm(tiny_llama)
    graphs = llm.generate(mixed, params + [plain] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]
    _assert_all_valid(graphs[:8], SCHEMAS[:8])
    alone = llm.generate(["Say something."] * 4, plain, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in graphs[8:]]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_drafts_are_checked_against_the_grammar(tiny_llama, method):
    """Verify graphs with grammar masks on the drafts: greedy output equals decoding without
    speculation, and sampled output validates."""
    params = [_json_params(s, temperature=0) for s in SCHEMAS[:8]]
    expected = _llm(tiny_llama).generate(PROMPTS[:8], params, use_tqdm=False)
    spec = dict(speculative_method=method, num_speculative_tokens=4)
    if method == "draft":
        spec["draft_model"] = tiny_llama
    llm = _llm(tiny_llama, **spec)
    got = llm.generate(PROMPTS[:8], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.engine.stats().spec_draft_tokens > 0
    sampled = llm.generate(PROMPTS[:8], [_json_params(s, temperature=1.0, seed=i)
                                         for i, s in enumerate(SCHEMAS[:8])], use_tqdm=False)
    _assert_all_valid(sampled, SCHEMAS[:8])
    assert llm.engine.structured.num_active == 0
