"""bench/torch_floor.py, the plain-torch one-graph floor of the GPU benchmark, computes the
same model as luceio: fed the prompt one token a step and then its own argmax, it gives the
engine's greedy tokens (tiny checkpoints, fp32, CPU; the benchmark times it on the GPU)."""
import os
import sys

import pytest

from conftest import engine_kwargs
from luceio import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from torch_floor import FloorModel  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_floor_decodes_the_engines_greedy_tokens(tiny_models, arch):
    llm = LLM(tiny_models[arch], **engine_kwargs())
    prompt = [5, 9, 33, 70, 12, 8, 100]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    fm = FloorModel(llm.engine.runner.model, 64)
    for i, t in enumerate(prompt):
        fm.token.fill_(t)
        fm.pos.fill_(i)
        fm.step()
    got = [fm.token.item()]
    for _ in range(len(expected) - 1):
        fm.step()
        got.append(fm.token.item())
    assert int(fm.pos.item()) == len(prompt) + len(expected) - 1
    assert got == expected
