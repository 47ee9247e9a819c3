"""Batch invariance of the CPU quantized kernels (qdot_cpu.py): a row of activations gets the
same output bits from `matvec` alone or beside any other rows, whichever form of the dot
intrinsics took it (one weight row at a time, 4 against 1, 2 or any number of rows, the last
1-3 weight rows, interleaved or row-major weights, XN_MAX rows a call). Every form rounds a
(weight row, activation row) sum through the same operations in the same order: explicit
FMAs, no fast-math flags, the offset terms in an accumulator of their own.

So a speculative verify step's rows equal plain decode steps, and a request's tokens do not
depend on which requests share its steps (measured before: 5-row and 1-row outputs differed
in the last bits for every type with offsets, and in all types with int8 activations). The
decoder test checks it end to end: a chain verify's rows, on quantized weights, bit for bit
the decode step of each position alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from luceio.kernels.quant import QTYPES, random_quant_weight

qd = pytest.importorskip("luceio.kernels.qdot_cpu")
if not qd.available():
    pytest.skip("numba is not installed", allow_module_level=True)
from luceio.kernels.qdot_ir_cpu import XN_MAX  # noqa: E402
from test_qdot8_cpu import activations  # noqa: E402

KINDS = ["int16", pytest.param("int8", marks=pytest.mark.skipif(
    not qd.int8_available(), reason="the CPU has neither AVX-512 VNNI nor AVX2"))]


def _shapes(qtype: str) -> list[tuple[int, int]]:
    """(N, K): interleaved rows (N a multiple of 4, whole 256-blocks), row-major with 1-3 last
    rows, a K with half a block and a tail (32-element types), and a K past `ONE_ROW_MIN_K`
    (int8: one weight row at a time for one activation row)."""
    long_k = qd.ONE_ROW_MIN_K[qtype] + 256
    if qtype.endswith("_k"):
        return [(12, 512), (7, 768), (5, long_k)]
    return [(12, 512), (7, 32 * 14), (5, long_k)]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)  # -0.0 and 0.0 apart


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_equal_one_row_bit_for_bit(kind, qtype):
    g = torch.Generator().manual_seed(QTYPES.index(qtype))
    rng = np.random.default_rng(7)
    with activations(kind):
        for n, k in _shapes(qtype):
            w = qd.prepare(random_quant_weight(qtype, n, k, generator=g))
            x = rng.standard_normal((XN_MAX + 2, k)).astype(np.float32)
            x[3] *= 1e-3  # rows of other magnitudes beside each other
            x[4, :64] = 0.0  # and groups of zeros
            alone = np.zeros((len(x), n), np.float32)
            for i in range(len(x)):
                qd.matvec(x[i:i + 1].copy(), w, alone[i:i + 1])
            for m in (2, 3, 5, 9, len(x)):  # forms 4x2, any rows, and two calls of XN_MAX
                out = np.zeros((m, n), np.float32)
                qd.matvec(x[:m].copy(), w, out)
                same = _bits(out) == _bits(alone[:m])
                assert same.all(), (qtype, kind, n, k, w.interleaved, m,
                                    float(np.abs(out - alone[:m]).max()))
            # the same row beside others in a different order: its bits again
            out = np.zeros((5, n), np.float32)
            qd.matvec(x[[4, 0, 3, 1, 2]].copy(), w, out)
            assert (_bits(out) == _bits(alone[[4, 0, 3, 1, 2]])).all()
            y = x[:5].astype(np.float64) @ qd.dequantize_ids(w, torch.arange(n)).double().numpy().T
            assert np.abs(out - y[[4, 0, 3, 1, 2]]).max() < 0.05 * np.abs(y).max()  # not garbage


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("span", [1024, 8])
def test_verify_rows_equal_decode_steps_on_quantized_weights(tmp_path, monkeypatch, kind, span):
    """A chain verify step (two requests of 5 and 3 rows) on the CPU decoder with GGUF weights
    of mixed types: each row's hidden state is the bits of the decode step of its position
    alone, from the cache the verify left (its keys at that position the decode's too); the
    attention's keys in work items of `KEY_SPAN` (1,024: one), or of 8 (several, merged)."""
    from luceio.kernels import rows_attention_cpu
    monkeypatch.setattr(rows_attention_cpu, "KEY_SPAN", span)
    pytest.importorskip("gguf")
    from conftest import engine_kwargs
    from test_cpu_verify import _verify_batch
    from test_gguf import _write_gguf
    from test_quant_engine import MIXED
    from luceio import LLM
    from luceio.models import AttnMetadata
    path = tmp_path / "q.gguf"
    _write_gguf(path, "qwen2", MIXED)
    runner = LLM(str(path), quantization="auto",
                 **engine_kwargs(max_model_len=256, cpu_activations=kind)).engine.runner
    assert runner.cpu_decoder.layers[0].qkv.parts  # the quantized kernels
    seq_lens, q_lens = [37, 20], [5, 3]
    ids, pos, meta = _verify_batch(runner, seq_lens, q_lens, seed=3)
    with torch.inference_mode():
        rows = runner.cpu_decoder(ids, pos, meta).clone()
        after = [kv.clone() for kv in runner.kv_caches]
        r = 0
        for i, (n, q) in enumerate(zip(seq_lens, q_lens)):
            for j in range(q):
                one = AttnMetadata(meta.slot_mapping[r:r + 1], meta.block_tables[i:i + 1],
                                   torch.tensor([n - q + j + 1], dtype=torch.int32),
                                   torch.tensor([0, 1], dtype=torch.int32), 1, n - q + j + 1)
                got = runner.cpu_decoder(ids[r:r + 1], pos[r:r + 1], one)
                assert torch.equal(got[0], rows[r]), (i, j, float((got[0] - rows[r]).abs().max()))
                r += 1
        assert all(torch.equal(a, b) for a, b in zip(runner.kv_caches, after))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_gives_plain_decodings_logprobs_bit_for_bit(tmp_path, monkeypatch, method):
    """End to end on GGUF weights of mixed types: greedy speculative decoding (n-gram drafts
    from a repetitive prompt, or the model drafting for itself: every draft accepted) emits
    plain decoding's tokens with the same log-probabilities, bit for bit (the attention's keys
    in work items of 8, so several are merged)."""
    pytest.importorskip("gguf")
    from conftest import engine_kwargs
    from test_gguf import _write_gguf
    from test_quant_engine import MIXED
    from luceio import LLM, SamplingParams
    from luceio.kernels import rows_attention_cpu
    monkeypatch.setattr(rows_attention_cpu, "KEY_SPAN", 8)
    path = str(tmp_path / "q.gguf")
    _write_gguf(path, "qwen2", MIXED)
    kw = dict(quantization="auto", max_model_len=256)
    spec_kw = dict(speculative_method=method, num_speculative_tokens=4)
    if method == "draft":
        spec_kw["draft_model"] = path
    prompts = [list(range(40, 52)) * 4, [7, 8, 9, 10] * 6 + [3]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = []
    for extra in ({}, spec_kw):
        llm = LLM(path, **engine_kwargs(**kw, **extra))
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        outs.append([(o.outputs[0].token_ids, [lp[t].logprob for lp, t in
                                               zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                     for o in res])
    stats = llm.engine.spec.stats
    assert stats.num_draft_tokens > 0 and (method == "ngram" or stats.num_accepted_tokens > 0)
    assert outs[1] == outs[0]
