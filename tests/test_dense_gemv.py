"""The dense GEMV of decode steps (kernels/dense_gemv.py) against its torch reference, on CPU
under TRITON_INTERPRET=1 (natively on a GPU when there is one): split and unsplit K, bias, the
SiLU-and-mul input, rows computed as alone, and its dispatch from `kernels.linear` and the MLP.
Inputs are random, drawn from a seed fixed per test (`conftest.seed_for`: LUCEIO_TEST_RANDOM=1
draws fresh ones); messages carry the seed (LUCEIO_TEST_SEED replays one)."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
pytest.importorskip("triton")

from conftest import seed_for  # noqa: E402
from luceio import kernels  # noqa: E402
from luceio.kernels import configs, dense_gemv as dg  # noqa: E402
from luceio.kernels.configs import KernelConfig  # noqa: E402

INTERPRETED = type(dg._dense_gemv_kernel).__name__ == "InterpretedFunction"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set and there is no GPU",
                allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"
# tiles small enough that the shapes below cross row blocks, K tiles and splits
SMALL = KernelConfig(dense_gemv_max_m=8, dense_gemv_block_n=4, dense_gemv_block_k=32,
                     dense_gemv_num_warps=1, dense_gemv_split_min_programs=0,
                     dense_gemv_min_tiles_per_split=1, source="test")
SPLIT = dataclasses.replace(SMALL, dense_gemv_split_min_programs=1000)
# matrices of N >= 16 and K <= 96 take the wide tile (others the small one)
WIDE = dataclasses.replace(SPLIT, dense_gemv_wide_min_n=16, dense_gemv_wide_max_k=96,
                           dense_gemv_wide_block_n=2, dense_gemv_wide_block_k=64,
                           dense_gemv_wide_num_warps=2)
# matrices of K >= 4N and N * K <= 4096 (N = 9, K = 160 below) take the deep tile, split apart
DEEP = dataclasses.replace(SMALL, dense_gemv_deep_min_ratio=4, dense_gemv_deep_max_elems=4096,
                           dense_gemv_deep_block_n=2, dense_gemv_deep_block_k=16,
                           dense_gemv_deep_num_warps=1, dense_gemv_deep_split_min_programs=12)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture
def seed(request):
    value = seed_for(request)
    torch.manual_seed(value)
    return value


def rand(*shape, dtype):
    return torch.randn(*shape).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("glu", [False, True])
def test_matches_reference(seed, dtype, glu):
    for n, k, m, cfg, bias in [(13, 70, 1, SMALL, True), (33, 96, 3, SPLIT, False),
                               (9, 160, 2, SPLIT, True), (40, 32, 1, SMALL, False),
                               (33, 96, 2, WIDE, True), (40, 70, 1, WIDE, False),
                               (9, 160, 1, DEEP, True), (13, 70, 2, DEEP, False)]:
        x = rand(m, 2 * k if glu else k, dtype=dtype)
        w = rand(n, k, dtype=dtype) / k ** 0.5
        b = rand(n, dtype=dtype) if bias else None
        with configs.use_config(cfg):
            out = dg.dense_gemv(x, w, b, glu=glu)
        ref = dg.dense_gemv_ref(x, w, b, glu=glu)
        assert out.shape == (m, n) and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype],
                                   msg=lambda e: f"seed {seed} n={n} k={k} m={m}: {e}")


def test_deep_tile_choice():
    """The deep tile and its split rule take K >= ratio * N matrices up to the element bound."""
    assert dg._launch_shape(DEEP, 9, 160)[:5] == (2, 16, 1, 5, 3)  # 5 programs, 12 wanted
    assert dg._launch_shape(DEEP, 13, 50)[:3] == (4, 32, 1)  # K < 4N: the general tile
    assert dg._launch_shape(DEEP, 40, 200)[:3] == (4, 32, 1)  # over the element bound
    sm90 = configs.TABLE["sm_90"]
    assert dg._launch_shape(sm90, 896, 4864)[:3] == (8, 512, 4)  # Qwen2.5-0.5B down
    assert dg._launch_shape(sm90, 4096, 14336)[:3] == (8, 1024, 4)  # Llama-3.1-8B down


@pytest.mark.parametrize("split", [False, True])
def test_rows_equal_each_row_alone(seed, split):
    """A verify step's rows give the bits of the decode steps they replace."""
    x = rand(5, 2 * 96, dtype=torch.float16)
    w = rand(21, 96, dtype=torch.float16)
    b = rand(21, dtype=torch.float16)
    with configs.use_config(SPLIT if split else SMALL):
        for glu in (False, True):
            together = dg.dense_gemv(x if glu else x[:, :96], w, b, glu=glu)
            for i in range(5):
                alone = dg.dense_gemv(x[i:i + 1] if glu else x[i:i + 1, :96], w, b, glu=glu)
                assert torch.equal(together[i:i + 1], alone), f"seed {seed} row {i} glu={glu}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_matches_reference(seed, dtype, with_residual, monkeypatch):
    """The RMSNorm done in the GEMV's loads (`norm=`): y as linear(rms_norm_ref(...)), and the
    residual handed on exactly the norm kernel's (x + residual, or x itself; the interpreter
    rounds to bf16 by truncation, so the kernel's, not torch's, on the CPU)."""
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    for n, k, m, cfg, bias in [(13, 70, 1, SMALL, True), (33, 96, 3, SPLIT, False),
                               (9, 160, 2, SPLIT, True), (33, 96, 2, WIDE, True)]:
        x = rand(m, k, dtype=dtype) * 2
        res = rand(m, k, dtype=dtype) if with_residual else None
        nw = rand(k, dtype=dtype)
        w = rand(n, k, dtype=dtype) / k ** 0.5
        b = rand(n, dtype=dtype) if bias else None
        with configs.use_config(cfg):
            y, r = dg.dense_gemv(x, w, b, norm=(nw, 1e-6, res))
        ref_y, ref_r = dg.dense_gemv_ref(x, w, b, norm=(nw, 1e-6, res))
        assert y.shape == (m, n) and y.dtype == dtype and r.shape == x.shape
        kernel_r = kernels.rms_norm(x, nw, 1e-6, res)[1] if res is not None else x
        assert torch.equal(r, kernel_r), f"seed {seed} n={n} k={k} m={m}"
        torch.testing.assert_close(r, ref_r, **TOL[dtype])
        torch.testing.assert_close(y.float(), ref_y.float(), **TOL[dtype],
                                   msg=lambda e: f"seed {seed} n={n} k={k} m={m}: {e}")
        if res is not None:  # inputs untouched
            assert not torch.equal(r, x)


@pytest.mark.parametrize("split", [False, True])
def test_norm_rows_equal_each_row_alone(seed, split):
    x, res = rand(4, 96, dtype=torch.bfloat16), rand(4, 96, dtype=torch.bfloat16)
    nw, w = rand(96, dtype=torch.bfloat16), rand(21, 96, dtype=torch.bfloat16)
    with configs.use_config(SPLIT if split else SMALL):
        together, _ = dg.dense_gemv(x, w, norm=(nw, 1e-5, res))
        for i in range(4):
            alone, _ = dg.dense_gemv(x[i:i + 1], w, norm=(nw, 1e-5, res[i:i + 1]))
            assert torch.equal(together[i:i + 1], alone), f"seed {seed} row {i}"


def test_rms_norm_linear_dispatch(seed, monkeypatch):
    """`kernels.rms_norm_linear` fuses where the dense GEMV runs and `dense_gemv_norm` is on,
    and is the norm then the linear otherwise, with the same residual either way."""
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    calls = []
    real = dg.dense_gemv
    monkeypatch.setattr(dg, "dense_gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    x, res = rand(2, 64, dtype=torch.bfloat16), rand(2, 64, dtype=torch.bfloat16)
    nw, w = rand(64, dtype=torch.bfloat16), rand(16, 64, dtype=torch.bfloat16) / 8
    outs = []
    for cfg in (SMALL, dataclasses.replace(SMALL, dense_gemv_norm=False),
                dataclasses.replace(SMALL, dense_gemv_max_m=0)):
        with configs.use_config(cfg):
            outs.append(kernels.rms_norm_linear(x, nw, 1e-6, res, w))
            y0, r0 = kernels.rms_norm_linear(x, nw, 1e-6, None, w)
            assert r0 is x
    assert [("norm" in c) for c in calls] == [True, True, False, False]  # norm off: plain GEMV
    for y, r in outs[1:]:
        assert torch.equal(r, outs[0][1])
        torch.testing.assert_close(y.float(), outs[0][0].float(), **TOL[torch.bfloat16],
                                   msg=lambda e: f"seed {seed}: {e}")


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_rope_epilogue_equals_the_rope_kernel(seed, split, bias, monkeypatch):
    """QKV projection + RoPE + KV write in one launch (`rope=`, with the input norm): q and
    both caches bit for bit those of the GEMV followed by `qkv_rope_cache`'s kernel, a row
    with slot -1 writing nothing; through `kernels.rms_norm_qkv_rope_cache` too."""
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    nq, nkv, hd, page, k, m = 4, 2, 16, 4, 48, 3
    x, res = rand(m, k, dtype=torch.bfloat16), rand(m, k, dtype=torch.bfloat16)
    nw = rand(k, dtype=torch.bfloat16)
    w = rand((nq + 2 * nkv) * hd, k, dtype=torch.bfloat16) / k ** 0.5
    b = rand(w.shape[0], dtype=torch.bfloat16) if bias else None
    cos_sin = kernels.build_cos_sin_cache(hd, 64, 10000.0, None).to(DEVICE)
    positions = torch.tensor([5, 17, 40], device=DEVICE)
    slots = torch.tensor([2, -1, 9], device=DEVICE)
    caches = [[torch.zeros(4, page, nkv, hd, dtype=torch.bfloat16, device=DEVICE)
               for _ in range(2)] for _ in range(4)]
    rope = (positions, cos_sin, *caches[0], slots, nq, nkv)
    cfg = dataclasses.replace(SPLIT if split else SMALL, dense_gemv_block_n=8)
    with configs.use_config(cfg):
        assert dg.rope_fits(w, caches[0][0], nq, nkv)
        q, r = dg.dense_gemv(x, w, b, norm=(nw, 1e-6, res), rope=rope)
        qkv, r_ref = dg.dense_gemv(x, w, b, norm=(nw, 1e-6, res))
        q_ref = kernels.qkv_rope_cache(qkv, positions, cos_sin, *caches[1], slots, nq, nkv)
        q2, r2 = kernels.rms_norm_qkv_rope_cache(x, nw, 1e-6, res, w, b, positions, cos_sin,
                                                 *caches[2], slots, nq, nkv)
    calls = []
    real = dg.dense_gemv
    monkeypatch.setattr(dg, "dense_gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    with configs.use_config(dataclasses.replace(cfg, dense_gemv_norm_max_programs=0)):
        # the norm its own launch, RoPE still in the GEMV
        q3, r3 = kernels.rms_norm_qkv_rope_cache(x, nw, 1e-6, res, w, b, positions, cos_sin,
                                                 *caches[3], slots, nq, nkv)
    assert [sorted(c) for c in calls] == [["rope"]]
    torch.testing.assert_close(q3, q_ref, **TOL[torch.bfloat16])
    for a, e in zip(caches[3], caches[1]):  # the norm's sum taken in another order
        torch.testing.assert_close(a, e, **TOL[torch.bfloat16])
    assert torch.equal(r3, r_ref)
    assert q.shape == (m, nq, hd)
    for got in ((q, r, *caches[0]), (q2, r2, *caches[2])):
        for a, e in zip(got, (q_ref, r_ref, *caches[1])):
            assert torch.equal(a, e), f"seed {seed}"
    assert caches[0][0].abs().sum() > 0 and caches[0][1].abs().sum() > 0
    assert caches[0][0].flatten(0, 1)[[0, 1, 3, 4, 5, 6, 7, 8]].abs().sum() == 0  # only 2, 9


@pytest.mark.parametrize("cfg", [SMALL, SPLIT, WIDE], ids=["small", "split", "wide"])
@pytest.mark.parametrize("glu", [False, True])
def test_add_epilogue_and_the_norm_after_it(seed, cfg, glu, monkeypatch):
    """`add=`: the projection + residual as the norm kernel's add rounds it (bit for bit the
    residual `rms_norm` hands on), with per-program sums of squares that add up to the row's;
    the GEMV after it (`norm=, ss=`) equals the reference norm + projection of that sum, and
    `kernels.linear_add` / `rms_norm_linear` / `rms_norm_qkv_rope_cache` chain them."""
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    m, k, n, n2 = 3, 48, 40, 24
    dt = torch.bfloat16
    x = rand(m, 2 * k if glu else k, dtype=dt)
    w, res = rand(n, k, dtype=dt) / k ** 0.5, rand(m, n, dtype=dt)
    nw, w2 = rand(n, dtype=dt), rand(n2, n, dtype=dt) / n ** 0.5
    with configs.use_config(cfg):
        h, ss = dg.dense_gemv(x, w, glu=glu, add=res)
        y = dg.dense_gemv(x, w, glu=glu)
        assert torch.equal(h, kernels.rms_norm(y, nw, 1e-6, res)[1]), f"seed {seed}"
        assert ss.dtype == torch.float32 and ss.shape[0] == m and ss.shape[1] > 1
        torch.testing.assert_close(ss.sum(-1), h.float().pow(2).sum(-1), rtol=1e-5, atol=1e-5)
        z, r = dg.dense_gemv(h, w2, norm=(nw, 1e-6, None), ss=ss)
        assert r is h
        torch.testing.assert_close(z.float(), dg.dense_gemv_ref(h, w2, norm=(nw, 1e-6, None))[0]
                                   .float(), **TOL[dt], msg=lambda e: f"seed {seed}: {e}")
        # through the dispatch: linear_add -> Summed -> rms_norm_linear
        summed, none = kernels.linear_add(x, w, None, res, glu=glu)
        assert none is None and torch.equal(summed.h, h) and torch.equal(summed.ss, ss)
        z2, r2 = kernels.rms_norm_linear(summed, nw, 1e-6, None, w2)
        assert torch.equal(z2, z) and r2 is summed.h
        with configs.use_config(dataclasses.replace(cfg, dense_gemv_sum_ahead=False)):
            y3, r3 = kernels.linear_add(x, w, None, res, glu=glu)
        assert torch.equal(y3, y) and r3 is res
    # off the GEMV (torch): a Summed is normed as its h with no residual
    monkeypatch.setenv("LUCEIO_KERNELS", "torch")
    z4, r4 = kernels.rms_norm_linear(summed, nw, 1e-6, None, w2)
    assert r4 is summed.h
    torch.testing.assert_close(z4.float(), z.float(), **TOL[dt])


def test_presummed_norm_with_rope(seed, monkeypatch):
    """A Summed into the fused QKV + RoPE launch: q and the caches as the reference norm,
    projection and `qkv_rope_cache` make them (the norm's sum taken in another order)."""
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    nq, nkv, hd, page, k, m = 2, 1, 16, 4, 32, 2
    dt = torch.bfloat16
    x, res = rand(m, 24, dtype=dt), rand(m, k, dtype=dt)
    w0 = rand(k, 24, dtype=dt) / 5
    nw, w = rand(k, dtype=dt), rand((nq + 2 * nkv) * hd, k, dtype=dt) / k ** 0.5
    cos_sin = kernels.build_cos_sin_cache(hd, 64, 10000.0, None).to(DEVICE)
    positions, slots = torch.tensor([3, 9], device=DEVICE), torch.tensor([1, 6], device=DEVICE)
    caches = [[torch.zeros(2, page, nkv, hd, dtype=dt, device=DEVICE) for _ in range(2)]
              for _ in range(2)]
    with configs.use_config(dataclasses.replace(SMALL, dense_gemv_block_n=8)):
        summed, _ = kernels.linear_add(x, w0, None, res)
        q, r = kernels.rms_norm_qkv_rope_cache(summed, nw, 1e-6, None, w, None, positions,
                                               cos_sin, *caches[0], slots, nq, nkv)
    assert r is summed.h
    monkeypatch.setenv("LUCEIO_KERNELS", "torch")
    normed, _ = kernels.rms_norm(x @ w0.T, nw, 1e-6, res)
    q_ref = kernels.qkv_rope_cache(normed @ w.T, positions, cos_sin, *caches[1], slots, nq, nkv)
    # normed inputs differing by an ulp (the sum's order) move a 32-term bf16 dot product by up
    # to ~0.028 (measured over 62 seeds; 2 of them exceeded TOL's 0.02)
    tol = dict(atol=4e-2, rtol=2e-2)
    torch.testing.assert_close(q.float(), q_ref.float(), **tol, msg=lambda e: f"seed {seed}: {e}")
    for a, e in zip(caches[0], caches[1]):
        torch.testing.assert_close(a.float(), e.float(), **tol, msg=lambda e: f"seed {seed}: {e}")
    assert caches[0][0].abs().sum() > 0


def test_glu_input_is_the_silu_kernels_output(seed, monkeypatch):
    """The SiLU done in the GEMV's loads rounds as the SiLU kernel does: the fused down
    projection equals the GEMV of `kernels.silu_and_mul`'s output bit for bit."""
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    gate_up = rand(2, 2 * 64, dtype=torch.bfloat16) * 3
    w = rand(24, 64, dtype=torch.bfloat16)
    with configs.use_config(SMALL):
        fused = dg.dense_gemv(gate_up, w, glu=True)
        unfused = dg.dense_gemv(kernels.silu_and_mul(gate_up), w)
    assert torch.equal(fused, unfused), f"seed {seed}"


def test_dispatch(seed, monkeypatch):
    """`kernels.linear` and `silu_and_mul_linear` take the GEMV up to `dense_gemv_max_m` rows
    of a dense weight, and torch's linear otherwise (more rows, the GEMV off)."""
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    calls = []
    real = dg.dense_gemv
    monkeypatch.setattr(dg, "dense_gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    w = rand(16, 64, dtype=torch.float32)
    few, many = rand(2, 64, dtype=torch.float32), rand(9, 64, dtype=torch.float32)
    with configs.use_config(SMALL):
        kernels.linear(few, w)
        assert len(calls) == 1
        kernels.linear(many, w)
        assert len(calls) == 1
        out = kernels.silu_and_mul_linear(torch.cat([few, few], -1), w)
        assert calls[-1] == {"glu": True}
        torch.testing.assert_close(out, dg.dense_gemv_ref(torch.cat([few, few], -1), w, glu=True),
                                   **TOL[torch.float32], msg=lambda e: f"seed {seed}: {e}")
    with configs.use_config(dataclasses.replace(SMALL, dense_gemv_max_m=0)):
        kernels.linear(few, w)
        kernels.silu_and_mul_linear(torch.cat([few, few], -1), w)
    with configs.use_config(dataclasses.replace(SMALL, dense_gemv_max_n=15)):  # N = 16: cuBLAS
        kernels.linear(few, w)
    assert len(calls) == 2
    with configs.use_config(dataclasses.replace(SMALL, dense_gemv_max_n=16)):
        kernels.linear(few, w)
    assert len(calls) == 3


def test_engine_with_the_dense_gemv_equals_reference(tiny_models, monkeypatch):
    """A whole engine whose decode steps' projections (and fused down projections) run on the
    dense GEMV gives the torch path's greedy tokens."""
    if not INTERPRETED:
        pytest.skip("a CPU engine on the Triton kernels needs the interpreter")
    from conftest import engine_kwargs
    from luceio import LLM, SamplingParams
    calls = []
    real = dg.dense_gemv
    monkeypatch.setattr(dg, "dense_gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    prompts = [{"prompt_token_ids": [5 + i, 9, 33, 70 + i] * (2 + i)} for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    kw = engine_kwargs(max_num_batched_tokens=16)
    monkeypatch.setenv("LUCEIO_KERNELS", "torch")
    ref = [o.outputs[0].token_ids for o in LLM(tiny_models["llama"], **kw).generate(prompts, params)]
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    for sum_ahead in (True, False):
        calls.clear()
        cfg = dataclasses.replace(SMALL, dense_gemv_max_m=2, dense_gemv_sum_ahead=sum_ahead)
        with configs.use_config(cfg):
            got = [o.outputs[0].token_ids
                   for o in LLM(tiny_models["llama"], **kw).generate(prompts, params)]
        assert got == ref, f"sum_ahead={sum_ahead}"
        kinds = {frozenset(k for k, v in c.items() if v is not None and v is not False)
                 for c in calls}
        assert frozenset() in kinds and any("rope" in c for c in kinds)  # LM head; QKV + RoPE
        if sum_ahead:  # o and down add the residual; the norms after them take the sums
            assert {frozenset({"add"}), frozenset({"glu", "add"})} <= kinds
            assert any("ss" in c for c in kinds) and frozenset({"glu"}) not in kinds
        else:
            assert frozenset({"glu"}) in kinds and any("norm" in c for c in kinds)
            assert not any("add" in c or "ss" in c for c in kinds)
