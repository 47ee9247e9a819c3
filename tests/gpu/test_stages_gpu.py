"""Pipeline stages on two GPUs (cuda:0, cuda:1): two stages joined by NCCL (what auto chooses)
and by the forced host path give greedy output token for token equal to one process on cuda:0
(fp32, chunked prefill, preemption and an abort; the staged runs are eager, so the reference is
too: the same kernels); a stage killed on the NCCL path fails the next step at once."""
import pytest
import torch

from conftest import engine_kwargs
from luceio import LLM, SamplingParams
from test_stages import (GREEDY, killed_stage_fails_at_once, no_stage_left, prompts,
                         run_with_abort, stage_kwargs)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

SCHED = dict(max_num_batched_tokens=32, num_kv_blocks=12)  # chunked prefill and preemption


@pytest.fixture(scope="module")
def one_gpu(tiny_llama):
    """The reference: one process on cuda:0, eager (staged runs capture no CUDA graphs)."""
    llm = LLM(tiny_llama, **engine_kwargs(device="cuda:0", enforce_eager=True, **SCHED))
    out = run_with_abort(llm, prompts(6), SamplingParams(max_tokens=20, **GREEDY))
    assert out[1][1] == "abort" and len(out[1][0]) < 20
    assert llm.engine.scheduler.num_preemptions > 0
    return out


@pytest.mark.parametrize("transport, chosen", [("auto", "nccl"), ("nccl", "nccl"),
                                               ("host", "host")])
def test_two_gpu_stages_equal_one_gpu(tiny_llama, one_gpu, transport, chosen):
    llm = LLM(tiny_llama, **stage_kwargs("cuda:0,cuda:1", stage_transport=transport, **SCHED))
    try:
        eng = llm.engine
        assert eng.stages.transport == chosen
        got = run_with_abort(llm, prompts(6), SamplingParams(max_tokens=20, **GREEDY))
        assert got == one_gpu
        assert eng.scheduler.num_preemptions > 0
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
        assert eng.runner.graphs is None
        assert eng.runner.kv_pool.device == torch.device("cuda:0") and len(eng.runner.kv_pool) == 1
    finally:
        llm.shutdown()
    assert no_stage_left()


def test_a_killed_stage_fails_the_nccl_step_at_once(tiny_llama):
    killed_stage_fails_at_once(LLM(tiny_llama, **stage_kwargs("cuda:0,cuda:1",
                                                              stage_transport="nccl")))
