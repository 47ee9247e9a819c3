"""Weights interleaved by 4 rows (`qdot_cpu.interleave`): the layout, the kernels that read it
(matvec with int16 and int8 activations, 1-7 rows; dequantize_rows) against the row-major
layout and the oracle, and an engine that loads a GGUF into it (a tied LM head whose table the
embedding then reads from the head's copy).

Tolerances as tests/test_qdot_cpu.py's: `dequantize_rows` equal bit for bit to
`quant.dequantize`; `matvec` within the int16 rounding bound (`matvec_bound`). Both layouts
compute the same sums in the same order per weight row except for fp32 reassociation under
fastmath: equal to 1e-5 of the output's magnitude.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from luceio.kernels.quant import QTYPES, dequantize, random_quant_weight

qd = pytest.importorskip("luceio.kernels.qdot_cpu")
if not qd.available():
    pytest.skip("numba is not installed", allow_module_level=True)

from test_qdot_cpu import ACTIVATIONS, matvec_bound, reference  # noqa: E402


def shape(qtype: str) -> tuple[int, int]:
    """Rows in fours; K whole 256-blocks (two of them: blocks follow blocks)."""
    return (12, 768) if qtype.endswith("_k") else (8, 512)


def test_interleave_is_its_definition():
    """Field row j holds rows 4j .. 4j + 3's 256-blocks in turn, each field on its own."""
    rng = np.random.default_rng(0)
    n, k = 8, 768
    arrays = (rng.integers(0, 255, (n, k // 2), dtype=np.uint8),  # 128 bytes a block
              rng.integers(0, 65535, (n, k // 256), dtype=np.uint16),  # one a block
              np.empty((n, 0), np.uint8))
    out = qd.interleave(arrays, k)
    for a, b in zip(arrays, out):
        per = a.shape[1] // 3
        assert b.shape == (n // 4, 4 * a.shape[1]) and b.dtype == a.dtype
        for j in range(n // 4):
            for c in range(3):
                for r in range(4):
                    at = (4 * c + r) * per
                    assert np.array_equal(b[j, at:at + per], a[4 * j + r, c * per:(c + 1) * per])


def test_prepare_interleaves_whole_blocks_of_four_rows():
    assert qd.interleaves((8, 256)) and qd.interleaves((151936, 1536))
    assert not qd.interleaves((7, 256)) and not qd.interleaves((8, 896))
    assert not qd.interleaves((8, 96)) and not qd.interleaves((0, 256))
    w = random_quant_weight("q4_k", 8, 512)
    views = qd.prepare(w, interleaved=False)
    assert not views.interleaved and np.shares_memory(views.arrays[0], w.qs.numpy())
    copy = qd.prepare(w)
    assert copy.interleaved and copy.nbytes == views.nbytes
    assert not np.shares_memory(copy.arrays[0], w.qs.numpy())
    assert not qd.prepare(random_quant_weight("q4_0", 7, 512)).interleaved  # rows not in fours


def test_int8_long_rows_of_some_types_stay_row_major():
    """With int8 activations, from `ROW_MAJOR_MIN_K` on a type stays row-major (its one-row
    kernel streams as fast); q4_k interleaves at any K; int16 at any K."""
    for qtype, k in qd.ROW_MAJOR_MIN_K.items():
        if k > 1 << 20:
            assert qtype == "q4_k" and qd.interleaves((8, 14336), qtype, "int8")
            continue
        long = -(-k // 256) * 256
        assert not qd.interleaves((8, long), qtype, "int8"), qtype
        assert qd.interleaves((8, long), qtype, "int16"), qtype
        if long > 256:
            assert qd.interleaves((8, long - 256), qtype, "int8"), qtype
        if qtype == "q8_0" and qd.SLOW_ONE_ROW_Q8_0:  # AVX2: 4 rows up to K = 3,072, as fast
            assert k < qd.ONE_ROW_MIN_K[qtype]  # as interleaved there (`ONE_ROW_MIN_K`)
            continue
        assert k >= qd.ONE_ROW_MIN_K[qtype], qtype  # rows it keeps row-major go one at a time
    if qd.int8_available():
        w = random_quant_weight("q8_0", 8, 1024)
        assert not qd.prepare(w, activations="int8").interleaved
        assert qd.prepare(w, activations="int16").interleaved


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_rows_is_the_oracle_bit_for_bit(qtype):
    n, k = shape(qtype)
    w = random_quant_weight(qtype, n, k, generator=torch.Generator().manual_seed(1))
    cw = qd.prepare(w)
    assert cw.interleaved
    want = dequantize(w)
    out = np.empty((n - 3, k), np.float32)
    qd.dequantize_rows(cw, 3, out)  # from the middle of a group of 4
    assert torch.equal(torch.from_numpy(out), want[3:])
    bf16 = torch.empty(n - 3, k, dtype=torch.bfloat16)
    qd.dequantize_rows(cw, 3, bf16.view(torch.uint16).numpy())
    assert torch.equal(bf16, want[3:].to(torch.bfloat16))
    ids = torch.tensor([5, 0, n - 1, 6, 5])
    assert torch.equal(qd.dequantize_ids(cw, ids), want[ids])


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7])
def test_matvec_within_rounding_bound_and_equal_to_row_major(qtype, m):
    n, k = shape(qtype)
    w = random_quant_weight(qtype, n, k, generator=torch.Generator().manual_seed(m))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    for acts in ACTIVATIONS:
        cw, plain = qd.prepare(w, activations=acts), qd.prepare(w, activations=acts,
                                                                interleaved=False)
        assert cw.interleaved and not plain.interleaved
        buf = np.full((m, n + 5), np.nan, np.float32)  # a column slice, as fused parts are
        qd.matvec(x.numpy(), cw, buf[:, 2:2 + n])
        assert np.isnan(buf[:, :2]).all() and np.isnan(buf[:, -3:]).all()
        y = buf[:, 2:2 + n]
        want = np.empty((m, n), np.float32)
        qd.matvec(x.numpy(), plain, want)
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), (acts, qtype, m)
        if acts == "int16":  # int8's own bound: tests/test_qdot8_cpu.py (its shapes interleave)
            err = (torch.from_numpy(y).double() - reference(x, dequantize(w))).abs()
            assert bool((err <= matvec_bound(x, w)).all())


@pytest.mark.parametrize("qtype", ["q4_0", "q4_k", "q6_k"])
def test_negative_control_interleaved_arrays_read_as_row_major(qtype):
    """The same bytes read without the flag (as N rows of one row's width each) fail the
    bound: the layout is not the row-major one by accident."""
    n, k = shape(qtype)
    w = random_quant_weight(qtype, n, k, generator=torch.Generator().manual_seed(3))
    cw = qd.prepare(w)
    bad = qd.CpuQuant(qtype, cw.shape, tuple(a.reshape(n, -1) for a in cw.arrays),
                      cw.out_dtype, cw.activations, False)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4))
    y = np.empty((1, n), np.float32)
    qd.matvec(x.numpy(), bad, y)
    err = (torch.from_numpy(y).double() - reference(x, dequantize(w))).abs()
    assert not bool((err <= matvec_bound(x, w)).all())


def test_tied_table_bytes_count_each_copy_once(monkeypatch):
    """A tied quantized table's bytes: the table plus whatever its CPU head form does not
    share with it (none for views; the interleaved copy replaces the table; q6_k's regrouped
    high bits are a copy of their own)."""
    from luceio.kernels.quant import nbytes
    from luceio.models.linear import Embedding

    def loaded(w):
        emb = Embedding(*w.shape)
        emb.load(w, torch.float32, torch.device("cpu"), tied=True)
        return emb
    w = random_quant_weight("q4_0", 7, 512)  # rows not in fours: views
    assert loaded(w).weight_bytes() == nbytes(w)
    w = random_quant_weight("q8_0", 8, 512)
    emb = loaded(w)
    assert emb.table_in_head and emb.weight_bytes() == nbytes(w)
    ids = torch.tensor([7, 1, 4])  # rows read from the head's interleaved copy
    assert torch.equal(emb(ids), dequantize(w)[ids])
    w = random_quant_weight("q6_k", 7, 512)  # views but for the regrouped high bits
    emb = loaded(w)
    assert not emb.table_in_head and emb.weight_bytes() == nbytes(w) + w.qh.numel()


def test_engine_on_interleaved_weights_equals_row_major(tmp_path, monkeypatch):
    """A llama GGUF (tied embeddings) whose every matrix has whole 256-blocks and rows in
    fours loads interleaved: the tied LM head keeps the one copy of the table, which the
    embedding and the CPU decode step read rows from; greedy tokens and prompt logprobs equal
    the same engine loaded row-major (int16 activations: the same sums to fp32 rounding)."""
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as T
    from conftest import engine_kwargs
    from test_gguf import _write_gguf

    from luceio import LLM, SamplingParams
    path = tmp_path / "q.gguf"
    _write_gguf(path, "llama", {"attn_q": T.Q4_0, "attn_k": T.Q4_0, "attn_v": T.Q8_0,
                                "attn_output": T.Q5_0, "ffn_gate": T.Q4_1, "ffn_up": T.Q4_1,
                                "ffn_down": T.Q5_1, "token_embd": T.Q8_0},
                hidden=256, ffn=512, pad_tokens=1)  # vocab 260
    outs, sizes = {}, {}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    for interleaved in (False, True):
        monkeypatch.setattr(qd, "INTERLEAVED", [interleaved])
        llm = LLM(str(path), quantization="auto", **engine_kwargs(max_model_len=128))
        model = llm.engine.runner.model
        emb, down = model.embed_tokens, model.layers[1].mlp.down_proj.parts[0]
        assert down.interleaved is interleaved and emb.table_in_head is interleaved
        if interleaved:
            assert emb.qweight is None and emb.head_part.interleaved
            assert model.lm_head.parts == [emb.head_part]
            decoder = llm.engine.runner.cpu_decoder
            assert decoder is None or decoder.embed_rows is emb.head_part
        sizes[interleaved] = model.weight_bytes()
        outs[interleaved] = llm.generate([{"prompt_token_ids": [5, 77, 200, 259, 3]}, "hi"],
                                         params)
        del llm
    assert sizes[True] == sizes[False]
    for a, b in zip(outs[False], outs[True]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            for tok, lp in pa.items():
                assert abs(lp.logprob - pb[tok].logprob) < 1e-4
