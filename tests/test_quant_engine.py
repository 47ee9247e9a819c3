"""The engine on quantized weights. A GGUF's quantized tensors stay quantized (`--quantization
auto`): fused projections whose shards differ in type, llama's permuted Q/K rows and a tied
quantized embedding included, and the logits equal those of the same file dequantized at load
(`--quantization none`) up to the kernels' rounding. `--quantization int8|int4` quantizes an HF
checkpoint's layer weights at load."""
from __future__ import annotations

import pytest
import torch

from conftest import engine_kwargs
from luceio import LLM, SamplingParams
from luceio.kernels import weight_kind

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
MIXED = {"attn_q": T.Q4_0, "attn_k": T.Q4_0, "attn_v": T.Q8_0, "attn_output": T.Q5_0,
         "ffn_gate": T.Q4_1, "ffn_up": T.Q4_1, "ffn_down": T.Q5_1, "token_embd": T.Q8_0,
         "output": T.Q8_0}
PROMPT = list(range(40, 90, 2)) + [7, 300 % 259, 12]


def _prompt_logprobs(llm: LLM, ids: list[int]) -> list[dict[int, float]]:
    """Teacher-forced top-20 log-probabilities of every next token."""
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20))[0]
    return [{t: lp.logprob for t, lp in d.items() if lp.rank <= 20} for d in out.prompt_logprobs[1:]]


def _compare(got: list[dict], want: list[dict]) -> tuple[bool, float]:
    """(top-1 identical everywhere, largest |difference| over the tokens both report)."""
    same = all(max(g, key=g.get) == max(w, key=w.get) for g, w in zip(got, want))
    err = max(abs(g[t] - w[t]) for g, w in zip(got, want) for t in g.keys() & w.keys())
    return same, err


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_quantized_tensors_stay_quantized_and_match_the_dequantized_model(tmp_path, arch,
                                                                             monkeypatch):
    """Loading is exact: with the torch reference kernels (dequantize, then the fp32 matmul)
    the quantized model's logprobs equal the dequantized model's. The CPU's packed kernel is
    measured against the same reference in test_quant_cpu.py and on real weights in
    test_quant_quality.py (this model's N(0, 1) weights make its logits too sharp for bf16)."""
    from test_gguf import _write_gguf
    path = tmp_path / "q.gguf"
    _write_gguf(path, arch, MIXED)
    kw = engine_kwargs(max_model_len=256)
    monkeypatch.setenv("LUCEIO_KERNELS", "torch")
    quant, exact = LLM(str(path), quantization="auto", **kw), LLM(str(path), quantization="none", **kw)
    model = quant.engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert [weight_kind(p) for p in qkv.parts] == ["q4_0", "q8_0"]  # q+k, then v
    assert model.layers[1].mlp.down_proj.quantized and model.embed_tokens.qweight is not None
    assert model.lm_head.quantized  # tied (llama) or its own Q8_0 output (qwen2)
    assert not exact.engine.runner.model.layers[0].mlp.down_proj.quantized
    assert model.weight_bytes() < 0.5 * exact.engine.runner.model.weight_bytes()

    same, err = _compare(_prompt_logprobs(quant, PROMPT), _prompt_logprobs(exact, PROMPT))
    assert same and err < 1e-4


@pytest.mark.parametrize("mode, tol, agree", [("int8", 0.1, 1.0), ("int4", 2.0, 0.6)])
def test_hf_checkpoint_quantized_at_load(tiny_llama, mode, tol, agree):
    """int8 (0.5% RMS weight error) keeps the tiny model's logprobs within 0.1; int4 (7.8%)
    moves them visibly, and still keeps most top-1 tokens."""
    kw = engine_kwargs(max_model_len=256)
    quant, dense = LLM(tiny_llama, quantization=mode, **kw), LLM(tiny_llama, **kw)
    model = quant.engine.runner.model
    assert all(layer.mlp.gate_up_proj.quantized and layer.self_attn.o_proj.quantized
               for layer in model.layers)
    assert not model.lm_head.quantized  # the LM head and the embedding stay dense
    got, want = _prompt_logprobs(quant, PROMPT), _prompt_logprobs(dense, PROMPT)
    _, err = _compare(got, want)
    top1 = sum(max(g, key=g.get) == max(w, key=w.get) for g, w in zip(got, want)) / len(got)
    assert 0 < err < tol and top1 >= agree  # quantized (not silently dense), and close


def test_gguf_refuses_requantization(tmp_path):
    from test_gguf import _write_gguf
    path = tmp_path / "f16.gguf"
    _write_gguf(path, "qwen2")
    with pytest.raises(ValueError, match="GGUF"):
        LLM(str(path), quantization="int8", **engine_kwargs(max_model_len=256))


@pytest.mark.parametrize("heads", [4, 2])
def test_fused_gemv_inputs_change_nothing(tmp_path, monkeypatch, heads):
    """On the Triton kernels (interpreted here), the norms, SiLU and (head_dim 32: heads=2, one
    row) the decode attention writing the quantized GEMV's int8 input themselves
    (`Linear.int8_input`) give the same logits, bit for bit, as the GEMV quantizing it in its
    own launch: the decode steps of a mixed-type GGUF (a q4_0 + q8_0 fused QKV, so both int8
    layouts), two requests decoding together (two-row steps) and then one alone, produce
    identical greedy tokens and log-probabilities (the GEMVs' tails off). With the tails on
    (`quant_gemv_tail`: the SiLU after gate/up, the residual add and norm after o and down,
    which need the int8 buffers) the tokens are the same and the log-probabilities within
    rounding: the norm's sum of squares runs in partial sums, one a GEMV program."""
    from dataclasses import replace

    import luceio.kernels as K
    from luceio.kernels import configs, quant_gemv, triton_ops
    from test_gguf import _write_gguf
    path = tmp_path / "q.gguf"
    _write_gguf(path, "qwen2", MIXED, heads=heads)
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    # the interpreter's time goes by programs: 32 columns a GEMV program instead of 4 (both
    # runs alike; the producers' int8 layouts do not depend on the tile)
    cfg = replace(configs.get_config(torch.device("cpu")), gemv_block_n=32, gemv_tails=False)
    monkeypatch.setattr(configs, "_override", cfg)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    made, attention_xqs = [], []
    buffers, attention = K.gemv_input_buffers, triton_ops.paged_attention
    made_rows = set()  # the rows of the inputs whose producers quantized them

    def recorded(*a):
        made.append(buffers(*a))
        if made[-1]:
            made_rows.add(a[1])
        return made[-1]
    monkeypatch.setattr(K, "gemv_input_buffers", recorded)
    tails, launch = [], quant_gemv.tail_launch

    def recorded_tail(t, *a):
        got = launch(t, *a)
        if t is not None:
            tails.append((type(t).__name__, got is not None))
        return got
    monkeypatch.setattr(quant_gemv, "tail_launch", recorded_tail)
    monkeypatch.setattr(triton_ops, "paged_attention",
                        lambda *a, **kw: attention_xqs.append(bool(kw.get("xqs"))) or
                        attention(*a, **kw))
    prompts = [{"prompt_token_ids": PROMPT[:9]}, {"prompt_token_ids": PROMPT[2:9]}]
    both = [params, SamplingParams(max_tokens=2, temperature=0, logprobs=3, ignore_eos=True)]
    llm = LLM(str(path), quantization="auto", **engine_kwargs(max_model_len=128))
    fused = [o.outputs[0] for o in llm.generate(prompts, both)]
    assert any(len(m) == 2 for m in made)  # the q4_0 + q8_0 QKV asked for both layouts
    assert made_rows == {1, 2}, made_rows  # two-row decode steps, then one-row ones
    assert any(attention_xqs) == (heads == 2)  # head_dim 16 is no whole 32-group
    assert not any(t[1] for t in tails)  # the tails are off
    monkeypatch.setattr(configs, "_override", replace(cfg, gemv_tails=True))
    llm = LLM(str(path), quantization="auto", **engine_kwargs(max_model_len=128))
    tailed = [o.outputs[0] for o in llm.generate(prompts, both)]
    assert {t for t in tails if t[1]} == {("GluTail", True), ("NormTail", True)}, set(tails)
    tails.clear()
    monkeypatch.setattr(K, "gemv_input_buffers", lambda *a: {})
    llm = LLM(str(path), quantization="auto", **engine_kwargs(max_model_len=128))
    plain = [o.outputs[0] for o in llm.generate(prompts, both)]
    assert not tails  # no int8 buffers, no tails
    for f, tl_, p in zip(fused, tailed, plain):
        assert f.token_ids == tl_.token_ids == p.token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in f.logprobs] == \
            [{t: lp.logprob for t, lp in d.items()} for d in p.logprobs]
        for dt, dp in zip(tl_.logprobs, p.logprobs):
            assert dt.keys() == dp.keys()
            assert all(abs(dt[k].logprob - dp[k].logprob) < 2e-2 for k in dt), (dt, dp)


def test_gemv_tails_in_verify_rows_equal_decode(tiny_llama, monkeypatch):
    """On the Triton kernels (interpreted here), the quantized GEMVs' tails (`quant_gemv_tail`)
    run in a decode step's one row and in a 5-row chain verify step alike, so greedy draft
    speculation equals plain decoding token for token (int4 weights, bf16)."""
    from dataclasses import replace

    from luceio.kernels import configs, quant_gemv
    from luceio.spec import decoding
    monkeypatch.setenv("LUCEIO_KERNELS", "triton")
    cfg = replace(configs.get_config(torch.device("cpu")), gemv_block_n=32)
    monkeypatch.setattr(configs, "_override", cfg)
    tails, launch = [], quant_gemv.tail_launch

    def recorded(t, *a):
        got = launch(t, *a)
        if got is not None:
            tails.append((type(t).__name__, a[2]))  # (kind, rows)
        return got
    monkeypatch.setattr(quant_gemv, "tail_launch", recorded)
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: "chain")
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
    kw = dict(quantization="int4", dtype="bfloat16", max_model_len=128)
    prompt = [{"prompt_token_ids": PROMPT[:12]}]
    plain = LLM(tiny_llama, **engine_kwargs(**kw)).generate(prompt, greedy)[0].outputs[0]
    spec_llm = LLM(tiny_llama, **engine_kwargs(speculative_method="draft",
                                               draft_model=tiny_llama, num_speculative_tokens=4,
                                               **kw))
    spec = spec_llm.generate(prompt, greedy)[0].outputs[0]
    assert spec.token_ids == plain.token_ids
    assert spec_llm.engine.spec.stats.num_accepted_tokens > 0
    kinds = {kind for kind, rows in tails if rows > 1}  # verify steps took both tails
    assert kinds == {"GluTail", "NormTail"}, set(tails)
