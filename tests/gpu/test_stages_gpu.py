"""Pipeline stages on GPUs. Two GPUs (cuda:0, cuda:1): two stages joined by NCCL (what auto
chooses) and by the forced host path give greedy output token for token equal to one process on
cuda:0 (fp32, chunked prefill, preemption and an abort; the staged runs are eager, so the
reference is too: the same kernels); a stage killed on the NCCL path fails the next step at
once. One GPU (cuda:0 twice: two processes, one GPU; auto takes the host path, as two ranks on
one GPU cannot join one NCCL group): the same equality, with micro-batches too, and a killed
stage on the host path."""
import pytest
import torch

from conftest import engine_kwargs
from luceio import LLM, SamplingParams
from test_stages import (GREEDY, killed_stage_fails_at_once, no_stage_left, prompts,
                         run_with_abort, stage_kwargs)

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

SCHED = dict(max_num_batched_tokens=32, num_kv_blocks=12)  # chunked prefill and preemption


@pytest.fixture(scope="module")
def one_gpu_graphs(tiny_llama):
    """The reference of staged runs with CUDA graphs: one process on cuda:0 with graphs."""
    llm = LLM(tiny_llama, **engine_kwargs(device="cuda:0", **SCHED))
    assert llm.engine.runner.graphs is not None
    out = run_with_abort(llm, prompts(6), SamplingParams(max_tokens=20, **GREEDY))
    assert out[1][1] == "abort" and len(out[1][0]) < 20
    return out


def graphed_stages_equal(tiny_llama, devices, reference, **kw):
    """Staged with CUDA graphs (stages/graphs.py): stage 0 replays its graphs for the decode
    steps, and the output equals one GPU with graphs token for token."""
    llm = LLM(tiny_llama, **stage_kwargs(devices, **kw, **SCHED))
    try:
        eng = llm.engine
        graphs = eng.runner.stage_graphs
        assert graphs is not None and graphs.graphs
        replays = []
        run_first = graphs.run_first
        graphs.run_first = lambda *a: replays.append(1) or run_first(*a)
        got = run_with_abort(llm, prompts(6), SamplingParams(max_tokens=20, **GREEDY))
        assert got == reference
        assert len(replays) > 20 and eng.scheduler.num_preemptions > 0
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
    finally:
        llm.shutdown()
    assert no_stage_left()


@pytest.fixture(scope="module")
def one_gpu(tiny_llama):
    """The reference: one process on cuda:0, eager (staged runs capture no CUDA graphs)."""
    llm = LLM(tiny_llama, **engine_kwargs(device="cuda:0", enforce_eager=True, **SCHED))
    out = run_with_abort(llm, prompts(6), SamplingParams(max_tokens=20, **GREEDY))
    assert out[1][1] == "abort" and len(out[1][0]) < 20
    assert llm.engine.scheduler.num_preemptions > 0
    return out


@two_gpus
@pytest.mark.parametrize("transport, chosen", [("auto", "nccl"), ("nccl", "nccl"),
                                               ("host", "host")])
def test_two_gpu_stages_equal_one_gpu(tiny_llama, one_gpu, transport, chosen):
    llm = LLM(tiny_llama, **stage_kwargs("cuda:0,cuda:1", stage_transport=transport,
                                         enforce_eager=True, **SCHED))
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


@two_gpus
def test_a_killed_stage_fails_the_nccl_step_at_once(tiny_llama):
    killed_stage_fails_at_once(LLM(tiny_llama, **stage_kwargs("cuda:0,cuda:1",
                                                              stage_transport="nccl")))


@pytest.mark.parametrize("transport, micro", [("auto", 1), ("host", 1), ("host", 2)])
def test_two_stages_on_one_gpu_equal_one_process(tiny_llama, one_gpu, transport, micro):
    llm = LLM(tiny_llama, **stage_kwargs("cuda:0,cuda:0", stage_transport=transport,
                                         stage_micro_batches=micro, enforce_eager=True, **SCHED))
    try:
        eng = llm.engine
        assert eng.stages.transport == "host"
        got = run_with_abort(llm, prompts(6), SamplingParams(max_tokens=20, **GREEDY))
        assert got == one_gpu
        assert eng.scheduler.num_preemptions > 0
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
        assert eng.runner.kv_pool.device == torch.device("cuda:0")
    finally:
        llm.shutdown()
    assert no_stage_left()


def test_graphed_stages_on_one_gpu_equal_one_gpu_with_graphs(tiny_llama, one_gpu_graphs):
    graphed_stages_equal(tiny_llama, "cuda:0,cuda:0", one_gpu_graphs)


@two_gpus
def test_graphed_stages_on_two_gpus_equal_one_gpu_with_graphs(tiny_llama, one_gpu_graphs):
    graphed_stages_equal(tiny_llama, "cuda:0,cuda:1", one_gpu_graphs)


def test_nccl_on_one_gpu_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="CUDA device of its own .* repeats one"):
        LLM(tiny_llama, **stage_kwargs("cuda:0,cuda:0", stage_transport="nccl"))
    assert no_stage_left()


def test_a_killed_stage_fails_the_host_step_on_a_gpu_at_once(tiny_llama):
    killed_stage_fails_at_once(LLM(tiny_llama, **stage_kwargs("cuda:0,cuda:0",
                                                              stage_transport="host")))
