"""Qwen3-MoE against HF transformers (tiny random models, fp32, CPU): the routing and expert
reference against transformers' sparse block, greedy output token for token, batching and
chunked prefill against requests run alone."""
import pytest
import torch

from conftest import MOE_CONFIGS, assert_greedy_matches_transformers, engine_kwargs, make_tiny_moe, \
    gguf_hparams, moe_hf_config, random_prompts
from luceio import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)

CONFIGS = MOE_CONFIGS


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    return {name: make_tiny_moe(str(tmp_path_factory.mktemp(name)), name, seed)
            for seed, name in enumerate(CONFIGS)}


def _prompts(n: int, seed: int) -> list[list[int]]:
    return random_prompts(n, seed, max_len=40)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_reference_matches_transformers_sparse_block(norm_topk_prob):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from luceio.kernels.moe import fused_moe_ref, route_topk_ref
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(moe_hf_config("e6k3", norm_topk_prob=norm_topk_prob))
    for p in block.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5)
    x = torch.randn(1, 37, 48)
    weights, expert_ids = route_topk_ref(x[0] @ block.gate.weight.T, 3, norm_topk_prob)
    got = fused_moe_ref(x[0], block.experts.gate_up_proj, block.experts.down_proj, weights,
                        expert_ids)
    torch.testing.assert_close(got, block(x)[0], rtol=1e-5, atol=1e-5)
    assert len(set(expert_ids.flatten().tolist())) == 6  # every expert ran on some token


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(moe_models, name):
    from transformers import AutoModelForCausalLM
    path = moe_models[name]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, **engine_kwargs())
    layers = llm.engine.runner.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == \
        [type(layer.mlp).__name__.removeprefix("Qwen3Moe") for layer in hf.model.layers]
    # the logprobs too: a routing slip that leaves the argmax alone shows there
    assert_greedy_matches_transformers(path, _prompts(3, seed=1), max_tokens=16)


def test_batched_and_chunked_prefill_equal_alone(moe_models):
    path = moe_models["e6k3"]
    prompts = _prompts(5, seed=2)
    params = SamplingParams(max_tokens=12, **GREEDY)
    llm = LLM(path, **engine_kwargs())
    alone = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids
             for p in prompts]
    for kw in ({}, {"max_num_batched_tokens": 16}):  # the second chunks the prefills
        batched = LLM(path, **engine_kwargs(**kw)).generate(
            [{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in batched] == alone


def test_refuses_what_it_does_not_run(moe_models, tmp_path):
    import json
    import shutil
    with pytest.raises(ValueError, match="mixture-of-experts models load dense"):
        LLM(moe_models["e4k2"], **engine_kwargs(quantization="int8"))
    folder = shutil.copytree(moe_models["e4k2"], tmp_path / "gelu")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        LLM(str(folder), **engine_kwargs())


def _stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF per-expert tensors -> `...mlp.experts.gate_proj.weight` [num_experts, ...] stacks,
    as llama.cpp's converter stacks them before naming."""
    import re
    out, stacks = {}, {}
    for name, tensor in state.items():
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+\.weight)", name)
        if match is None:
            out[name] = tensor
        else:
            stacks.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = tensor
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def _write_gguf(folder: str, path: str, quant=None, quant_down=None) -> None:
    """The HF checkpoint in F32 under the names of gguf's own tensor map (qwen3moe; qwen3's for
    a dense layer's MLP, which llama.cpp's qwen3moe has no name for). `quant`: a
    GGMLQuantizationType for the gate/up expert stacks, `quant_down` for the down stacks."""
    import json
    import os

    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    layers = c["num_hidden_layers"]
    maps = [gguf.get_tensor_name_map(arch, layers)
            for arch in (gguf.MODEL_ARCH.QWEN3MOE, gguf.MODEL_ARCH.QWEN3)]
    writer = gguf.GGUFWriter(path, "qwen3moe")
    gguf_hparams(writer, c)
    writer.add_rope_freq_base(10000.0)
    writer.add_expert_count(c["num_local_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_expert_weights_norm(c["norm_topk_prob"])
    for name, tensor in _stack_experts(load_file(os.path.join(folder, "model.safetensors"))).items():
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{maps[0].get_name(base) or maps[1].get_name(base)}.{suffix}"
        kind = gguf_name.split(".")[-2]
        q = quant if kind in ("ffn_gate_exps", "ffn_up_exps") else \
            quant_down if kind == "ffn_down_exps" else None
        if q is not None:
            writer.add_tensor(gguf_name, quantize(tensor.numpy(), q), raw_dtype=q)
        else:
            writer.add_tensor(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gguf_round_trip_equals_safetensors(moe_models, tmp_path, name):
    pytest.importorskip("gguf")
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(moe_models[name], path)
    prompts = _prompts(3, seed=3)
    params = SamplingParams(max_tokens=12, logprobs=1, **GREEDY)
    outs = [LLM(p, **engine_kwargs()).generate([{"prompt_token_ids": t} for t in prompts], params)
            for p in (moe_models[name], path)]
    for hf_out, gguf_out in zip(*outs):
        assert gguf_out.outputs[0].token_ids == hf_out.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in gguf_out.outputs[0].logprobs] == \
            [{t: lp.logprob for t, lp in d.items()} for d in hf_out.outputs[0].logprobs]


def test_gguf_quantized_experts_stay_quantized(moe_models, tmp_path):
    """A GGUF with Q8_0 gate/up expert stacks (down in F32): those experts load as QuantWeights
    (repacked losslessly: dequantized they are gguf's own dequantization), run through the
    quantized matmuls expert by expert, and decode the tokens of the same file loaded with every
    expert dequantized (`--quantization none`), logprobs close (their prompts' few rows take the
    quantized kernels' int8 / int16 activations as decode rows do, not bf16 tiles: measured
    within 2.1e-3). CUDA graphs are off for it."""
    import gguf
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file

    from luceio.kernels.quant import QuantWeight, dequantize as dequantize_qw
    from luceio.loader import load_checkpoint
    folder, path = moe_models["e4k2"], str(tmp_path / "q8.gguf")
    _write_gguf(folder, path, quant=gguf.GGMLQuantizationType.Q8_0)
    expected = load_file(f"{folder}/model.safetensors")
    weights = dict(load_checkpoint(path).weights(keep_quantized=True))
    assert weights.keys() == expected.keys()
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    q8 = gguf.GGMLQuantizationType.Q8_0
    oracle = dequantize(quantize(expected[name].numpy(), q8), q8)
    assert isinstance(weights[name], QuantWeight)
    assert torch.equal(dequantize_qw(weights[name]).float(), torch.from_numpy(oracle))
    assert not torch.equal(torch.from_numpy(oracle), expected[name])  # it was quantized
    down = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert torch.equal(weights[down], expected[down])  # F32 stays dense
    llm = LLM(path, **engine_kwargs())
    model = llm.engine.runner.model
    assert model.weight_types() == ["float32", "q8_0"]
    block = model.layers[1].mlp
    assert block.q_experts is not None and block.quantized_bytes() > 0
    dense = LLM(path, **engine_kwargs(quantization="none"))
    assert dense.engine.runner.model.layers[1].mlp.q_experts is None
    assert model.weight_bytes() < dense.engine.runner.model.weight_bytes()
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, seed=5)]
    params = SamplingParams(max_tokens=10, logprobs=1, **GREEDY)
    got, want = llm.generate(prompts, params), dense.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for gl, wl in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert all(abs(gl[t].logprob - wl[t].logprob) < 5e-3 for t in wl)
    with pytest.raises(ValueError, match="quantized experts"):
        LLM(path, **engine_kwargs(expert_memory="0.5"))
