"""Qwen3.5 GGUF files (`qwen35`, `qwen35moe`; luceio/loader/gguf_qwen35.py): a tiny checkpoint
written the way llama.cpp's converter writes it (llama.cpp `conversion/qwen.py`, read in the
llama.cpp that llama-cpp-python 0.3.36 vendors: -exp(A_log), 1 + w norms except the gated one,
the squeezed conv, `ssm_dt.bias`, v heads reordered from grouped to tiled, experts stacked)
loads to the same model as the safetensors: greedy tokens equal and logprobs within 1e-5."""
import json
import os

import numpy as np
import pytest
import torch

from conftest import QWEN3_NEXT, VOCAB, assert_same_model, engine_kwargs, gguf_hparams, \
    make_tiny_qwen35, random_prompts, save_tiny, spread_qwen35_norms
from luceio import LLM, SamplingParams

gguf = pytest.importorskip("gguf")


def _tiled(t: torch.Tensor, dim: int, k_heads: int, per_k: int, head_dim: int) -> torch.Tensor:
    """llama.cpp's `_reorder_v_heads`: grouped [k, per_k, d] -> tiled [per_k, k, d] on `dim`."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, per_k, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _converted(name: str, t: torch.Tensor, c: dict):
    """(HF name, value) as the converter's modify_tensors hands them to its name map."""
    k, v = c["linear_num_key_heads"], c["linear_num_value_heads"]
    kd, vd = c["linear_key_head_dim"], c["linear_value_head_dim"]
    if k != v and "linear_attn." in name:
        per_k = v // k
        if ".in_proj_qkv." in name:
            t = torch.cat([t[:2 * k * kd], _tiled(t[2 * k * kd:], 0, k, per_k, vd)])
        elif ".in_proj_z." in name:
            t = _tiled(t, 0, k, per_k, vd)
        elif ".in_proj_b." in name or ".in_proj_a." in name:
            t = _tiled(t, 0, k, per_k, 1)
        elif name.endswith((".A_log", ".dt_bias")):
            t = _tiled(t[:, None], 0, k, per_k, 1)[:, 0]
        elif ".conv1d." in name:
            t = torch.cat([t[:2 * k * kd], _tiled(t[2 * k * kd:], 0, k, per_k, vd)])
        elif ".out_proj." in name:
            t = _tiled(t, 1, k, per_k, vd)
    if name.endswith(".A_log"):
        return name, -torch.exp(t)
    if name.endswith(".dt_bias"):
        return name.removesuffix(".dt_bias") + ".dt_proj.bias", t
    if ".conv1d." in name:
        return name, t.squeeze()
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return name, t + 1
    return name, t


def write_gguf(folder: str, path: str, fuse_gate_up: bool = False, expert_type=None) -> None:
    """`expert_type`: a GGMLQuantizationType for the expert stacks (F32 otherwise)."""
    from safetensors.torch import load_file
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    moe = "num_experts" in c
    arch = gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35
    arch_name = "qwen35moe" if moe else "qwen35"
    layers = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, layers)
    w = gguf.GGUFWriter(path, arch_name)
    gguf_hparams(w, c, feed_forward=not moe)
    rope = c["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(c["head_dim"] * rope["partial_rotary_factor"]))
    w.add_uint32(f"{arch_name}.ssm.conv_kernel", c["linear_conv_kernel_dim"])
    w.add_uint32(f"{arch_name}.ssm.state_size", c["linear_key_head_dim"])
    w.add_uint32(f"{arch_name}.ssm.group_count", c["linear_num_key_heads"])
    w.add_uint32(f"{arch_name}.ssm.time_step_rank", c["linear_num_value_heads"])
    w.add_uint32(f"{arch_name}.ssm.inner_size",
                 c["linear_value_head_dim"] * c["linear_num_value_heads"])
    w.add_full_attention_interval(4)
    w.add_array(f"{arch_name}.attention.recurrent_layers",
                [t == "linear_attention" for t in c["layer_types"]])
    if moe:
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    experts: dict = {}
    for name, t in load_file(os.path.join(folder, "model.safetensors")).items():
        if ".mlp.experts." in name:  # stacked per layer and projection, as the converter does
            layer = int(name.split(".")[2])
            proj = name.split(".")[-2]
            experts.setdefault((layer, proj), {})[int(name.split(".")[5])] = t
            continue
        name, t = _converted(name, t, c)
        base, _, suffix = name.rpartition(".")
        if name.endswith(".A_log"):
            w.add_tensor(names.get_name(name), t.numpy())
        else:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", t.numpy())
    for layer in range(layers if moe else 0):
        stacks = {p: torch.stack([experts[(layer, p)][e] for e in range(c["num_experts"])])
                  for p in ("gate_proj", "up_proj", "down_proj")}
        out = {"down": stacks["down_proj"]}
        if fuse_gate_up:
            out["gate_up"] = torch.cat([stacks["gate_proj"], stacks["up_proj"]], 1)
        else:
            out["gate"], out["up"] = stacks["gate_proj"], stacks["up_proj"]
        for part, t in out.items():
            if expert_type is None:
                w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", t.numpy())
            else:
                w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight",
                             gguf.quants.quantize(t.numpy(), expert_type), raw_dtype=expert_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _assert_same_model(hf_path: str, gguf_path: str) -> None:
    assert_same_model((hf_path, gguf_path), random_prompts(3, seed=23, max_len=26),
                      max_num_batched_tokens=9)


@pytest.mark.parametrize("name", ["gqa_tied", "mha_untied"])
def test_qwen35_gguf_equals_safetensors(tmp_path, name):
    """gqa_tied has 2 k heads for 4 v heads (the tiled order runs), mha_untied one v head per
    k head and layer types off the default pattern (read from recurrent_layers)."""
    folder = make_tiny_qwen35(str(tmp_path / name), name, seed=2)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(folder, path)
    _assert_same_model(folder, path)
    if name == "gqa_tied":
        llm = LLM(path, **engine_kwargs())
        assert llm.engine.runner.model.cfg.linear_v_tiled


def _tiny_qwen35moe(tmp_path) -> str:
    from test_qwen3_5 import QWEN35_MOE
    from transformers import Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    torch.manual_seed(7)
    cfg = Qwen3_5MoeTextConfig(vocab_size=VOCAB, max_position_embeddings=512,
                               initializer_range=0.1, eos_token_id=None, bos_token_id=None,
                               pad_token_id=None, tie_word_embeddings=False, **QWEN35_MOE)
    model = spread_qwen35_norms(Qwen3_5MoeForCausalLM(cfg).float())
    return save_tiny(model, str(tmp_path / "moe"))


@pytest.mark.parametrize("fuse_gate_up", [False, True])
def test_qwen35moe_gguf_equals_safetensors(tmp_path, fuse_gate_up):
    folder = _tiny_qwen35moe(tmp_path)
    path = str(tmp_path / "tiny_moe.gguf")
    write_gguf(folder, path, fuse_gate_up)
    _assert_same_model(folder, path)


@pytest.mark.parametrize("fuse_gate_up", [False, True])
def test_qwen35moe_quantized_experts_stay_quantized(tmp_path, fuse_gate_up):
    """Q8_0 expert stacks (fused gate/up too) load quantized, expert by expert, and decode the
    tokens of the same file with its experts dequantized at load."""
    folder = _tiny_qwen35moe(tmp_path)
    path = str(tmp_path / "q8_moe.gguf")
    write_gguf(folder, path, fuse_gate_up, expert_type=gguf.GGMLQuantizationType.Q8_0)
    prompts = [{"prompt_token_ids": t} for t in random_prompts(3, seed=19, max_len=24)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(path, **engine_kwargs())
    assert "q8_0" in llm.engine.runner.model.weight_types()
    assert all(layer.mlp.q_experts is not None for layer in llm.engine.runner.model.layers)
    dense = LLM(path, **engine_kwargs(quantization="none"))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in dense.generate(prompts, params)]


def test_negative_control_grouped_order_on_a_tiled_file_differs(tmp_path):
    """Reading the tiled file in HF's grouped order changes the logprobs: the order is tested."""
    folder = make_tiny_qwen35(str(tmp_path / "g"), "gqa_tied", seed=2)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(folder, path)
    params = SamplingParams(max_tokens=4, logprobs=1, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": random_prompts(1, seed=1)[0]}]
    good = LLM(folder, **engine_kwargs()).generate(prompt, params)[0].outputs[0]
    llm = LLM(path, **engine_kwargs())
    for layer in llm.engine.runner.model.layers:
        if layer.linear:
            layer.linear_attn.tiled = False
    bad = llm.generate(prompt, params)[0].outputs[0]
    chosen = [[lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)] for o in (good, bad)]
    assert bad.token_ids != good.token_ids or not np.allclose(*chosen, atol=1e-5)


def test_qwen35_pre_tokenizer_keeps_combining_marks_with_their_letters():
    """A qwen35 GGUF's `tokenizer.ggml.pre` splits as Qwen3.5's tokenizer.json does: a
    combining accent stays with its letter, where Qwen2's split cuts it off."""
    from tokenizers import Regex, pre_tokenizers

    from luceio.loader.gguf_tokenizer import PRE_TOKENIZER_SPLITS

    def pieces(pre):
        split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated")
        return [p for p, _ in split.pre_tokenize_str("cafe\u0301 x=1")]
    assert pieces("qwen35") == ["cafe\u0301", " x", "=", "1"]
    assert pieces("qwen2") == ["cafe", "\u0301", " x", "=", "1"]


def _qwen3next_converted(name: str, t: torch.Tensor, c: dict):
    """The converter's Qwen3NextModel.modify_tensors: in_proj_qkvz regrouped into attn_qkv
    (q, k, v of all heads) and attn_gate (z); the rest as `_converted` without a v reorder."""
    if name.endswith("in_proj_qkvz.weight"):
        k, kd, vd = c["linear_num_key_heads"], c["linear_key_head_dim"], \
            c["linear_value_head_dim"]
        per_k = c["linear_num_value_heads"] // k
        g = t.reshape(k, 2 * kd + 2 * per_k * vd, -1)
        q, key, v, z = (x.reshape(-1, t.shape[-1]) for x in
                        g.split([kd, kd, per_k * vd, per_k * vd], dim=1))
        return [("qkv", torch.cat([q, key, v])), ("gate", z)]
    return [_converted(name, t, {**c, "linear_num_key_heads": 1, "linear_num_value_heads": 1})]


def test_qwen3next_gguf_equals_safetensors(tmp_path):
    """A qwen3next file as llama.cpp's converter writes it (2 key heads for 4 value heads, a
    dense layer among sparse ones, the shared expert) loads to the safetensors' model."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from safetensors.torch import load_file
    torch.manual_seed(12)
    model = spread_qwen35_norms(Qwen3NextForCausalLM(Qwen3NextConfig(**QWEN3_NEXT)).float())
    folder = save_tiny(model, str(tmp_path / "next"))
    c = json.load(open(os.path.join(folder, "config.json")))
    path = str(tmp_path / "next.gguf")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, 4)
    dense_mlp = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    w = gguf.GGUFWriter(path, "qwen3next")
    gguf_hparams(w, c)
    for fn, value in [(w.add_rope_freq_base, c["rope_parameters"]["rope_theta"]),
                      (w.add_rope_dimension_count, 4), (w.add_expert_count, 6),
                      (w.add_expert_used_count, 2), (w.add_expert_feed_forward_length, 32),
                      (w.add_expert_shared_feed_forward_length, 48),
                      (w.add_full_attention_interval, 2)]:
        fn(value)
    for key, value in [("conv_kernel", 4), ("state_size", 16), ("group_count", 2),
                       ("time_step_rank", 4), ("inner_size", 32)]:
        w.add_uint32(f"qwen3next.ssm.{key}", value)
    experts: dict = {}
    for name, t in load_file(os.path.join(folder, "model.safetensors")).items():
        parts = name.split(".")
        if ".mlp.experts." in name:
            experts.setdefault((int(parts[2]), parts[-2]), {})[int(parts[5])] = t
            continue
        if name.startswith("model.layers.1.mlp.") and parts[-2] in dense_mlp:
            w.add_tensor(f"blk.1.{dense_mlp[parts[-2]]}.weight", t.numpy())
            continue
        for out_name, value in _qwen3next_converted(name, t, c):
            if out_name in ("qkv", "gate"):
                w.add_tensor(f"blk.{parts[2]}.attn_{out_name}.weight", value.numpy())
            elif out_name.endswith(".A_log"):
                w.add_tensor(names.get_name(out_name), value.numpy())
            else:
                base, _, suffix = out_name.rpartition(".")
                w.add_tensor(f"{names.get_name(base)}.{suffix}", value.numpy())
    for (layer, proj), by_expert in sorted(experts.items()):
        stack = torch.stack([by_expert[e] for e in range(6)])
        w.add_tensor(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", stack.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_same_model(folder, path)
