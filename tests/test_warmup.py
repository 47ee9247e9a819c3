"""The eager warm-up (luceio/warmup.py) that compiles the prefill and mixed steps' Triton
kernel variants at start-up: its steps stay within the engine's limits and write nothing."""
import torch

from conftest import engine_kwargs
from luceio import LLM
from luceio.warmup import eager_shapes, step_inputs, warm_eager, warm_runner


def test_shapes_stay_within_the_engine_limits():
    for seqs, mml, budget in ((1, 32, 32), (4, 300, 2048), (256, 40960, 8192), (64, 2048, 512),
                              (8, 100000, 16)):
        shapes = eager_shapes(seqs, mml, budget)
        assert len(shapes) == len(set(shapes))
        for n, q, ctx in shapes:
            assert 1 <= n <= seqs and 1 <= q <= ctx <= mml and n * q <= budget
        # the widest steps: one chunk of the whole budget, and the most requests filling it
        assert (1, min(budget, mml), min(budget, mml)) in shapes
        n = min(64, seqs)
        assert (n, min(budget // n, mml), min(budget // n, mml)) in shapes
        # a few tokens over contexts doubling up to 16K: each key-split count's merge width
        few = sorted(ctx for n, q, ctx in shapes if (n, q) == (1, 3))
        assert few[-1] == min(mml, 16384)
        assert all(b <= 2 * a for a, b in zip(few, few[1:]))


def test_step_inputs_describe_a_varlen_step():
    ids, pos, meta = step_inputs(3, 4, 10, 4, torch.device("cpu"))
    assert ids.shape == (12,) and pos.tolist() == [6, 7, 8, 9] * 3
    assert meta.query_start_loc.tolist() == [0, 4, 8, 12]
    assert meta.seq_lens.tolist() == [10] * 3 and meta.block_tables.shape == (3, 3)
    assert (meta.slot_mapping == -1).all() and meta.max_query_len == 4 and meta.max_seq_len == 10


def test_warm_up_leaves_the_kv_cache_as_it_was(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs(max_model_len=128, max_num_seqs=4))
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(3)
    for kv in runner.kv_caches:
        kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.dtype))
    before = [kv.clone() for kv in runner.kv_caches]
    took = warm_eager(runner.model, runner.kv_caches, runner.device, 4, runner.max_model_len,
                      runner.block_size, 64)
    assert took > 0
    for a, b in zip(before, runner.kv_caches):
        assert torch.equal(a, b)
    # engines warm up only where CUDA graphs run (the eager kernels are Triton's there)
    assert runner.graphs is None and warm_runner(runner, 4, 64) is None


def test_staged_arrays_start_16_byte_aligned():
    """Triton specialises kernels on pointer alignment: each staged array starts 16-byte
    aligned in the packed copy, whatever the sizes before it."""
    import numpy as np
    from luceio.memory import Staging
    staging = Staging(torch.device("cpu"))
    arrays = [np.arange(5).reshape(1, 5), np.arange(3), np.zeros((2, 7)), np.arange(1)]
    for dtype in (np.int32, np.int64):
        out = staging.to_device(dtype, arrays)
        assert [t.numel() for t in out] == [a.size for a in arrays]
        for a, t in zip(arrays, out):
            assert (t.data_ptr() - out[0].data_ptr()) % 16 == 0
            assert t.numpy().tolist() == a.reshape(-1).astype(dtype).tolist()
