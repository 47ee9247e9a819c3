"""Gemma 4 GGUF files (`gemma4`; luceio/loader/gguf_gemma4.py): tiny random checkpoints written
the way llama.cpp's converter writes them (`conversion/gemma.py`: `Gemma4Model` on
`Gemma3Model` and `TextModel`; norms stored as w, no Q/K permutation, the layer scalar as
`layer_output_scale.weight`, the global head size in `key_length` and the local one in
`key_length_swa`, KV head counts and MLP widths per layer, the window pattern one bool a layer,
and `rope_freqs` 1.0 for the rotated frequency pairs, 1e30 for the others) load to the same
model as the safetensors they came from: the same config, greedy tokens equal and logprobs
within 1e-5. Negative controls: a `rope_freqs` of another rotated share changes the output,
one not of the converter's form is refused, and so are metadata the converter does not write."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import GEMMA4_CONFIGS, assert_same_model, engine_kwargs, make_tiny_gemma4, \
    random_prompts
from luceio import LLM, SamplingParams

gguf = pytest.importorskip("gguf")

PROMPTS = random_prompts(2, seed=5) + [list(range(3, 25))]  # one well past the windows


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return {name: make_tiny_gemma4(str(tmp_path_factory.mktemp(name)), name, seed)
            for seed, name in enumerate(GEMMA4_CONFIGS)}


def converter_rope_freqs(hp: dict) -> np.ndarray:
    """`Gemma4Model.generate_extra_tensors`: 1.0 for the rotated pairs, 1e30 for the rest."""
    full = hp["rope_parameters"]["full_attention"]
    assert full["rope_type"] == "proportional"  # the converter asserts it too
    n_rot = int(hp["global_head_dim"] * full["partial_rotary_factor"] / 2)
    return np.array([1.0] * n_rot + [1e30] * (hp["global_head_dim"] // 2 - n_rot), np.float32)


def write_gguf(folder: str, path: str, base: str, rope_freqs=None, qtype=None) -> str:
    """The checkpoint in `folder` as llama.cpp's converter writes it, in F32. `base`: its
    GEMMA4_CONFIGS entry, for the released-style `global_head_dim` and
    `num_global_key_value_heads` the converter reads (transformers saves them folded into
    `per_layer_config`). Each key is written once, with the value the converter's last write
    leaves (TextModel, then Gemma3Model, then Gemma4Model `set_gguf_parameters`). No tokenizer:
    the converter's `tokenizer.ggml.model` "gemma4" vocabulary is tested on its own
    (tests/test_gguf_tokenizer_gemma4.py).
    `qtype`: a GGMLQuantizationType for the 2-D tensors whose rows it divides (as
    llama-quantize would leave the others)."""
    from safetensors.torch import load_file
    with open(os.path.join(folder, "config.json")) as f:
        hp = json.load(f)
    hp.update({k: GEMMA4_CONFIGS[base].get(k)
               for k in ("global_head_dim", "num_global_key_value_heads")})
    layers, rope = hp["num_hidden_layers"], hp["rope_parameters"]
    swa = [t == "sliding_attention" for t in hp["layer_types"]]
    first_shared = layers - hp["num_kv_shared_layers"]
    w = gguf.GGUFWriter(path, "gemma4")
    w.add_block_count(layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("num_experts"):
        w.add_expert_count(hp["num_experts"])
        w.add_expert_used_count(hp["top_k_experts"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])
    w.add_shared_kv_layers(hp["num_kv_shared_layers"])
    w.add_embedding_length_per_layer_input(hp.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    w.add_key_length(hp["global_head_dim"])
    w.add_value_length(hp["global_head_dim"])
    w.add_key_length_swa(hp["head_dim"])
    w.add_value_length_swa(hp["head_dim"])
    n_ff = hp["intermediate_size"]
    w.add_feed_forward_length([n_ff if i < first_shared else 2 * n_ff for i in range(layers)]
                              if hp.get("use_double_wide_mlp") else n_ff)
    global_kv = hp["num_global_key_value_heads"]
    w.add_head_count_kv(hp["num_key_value_heads"] if global_kv is None else
                        [hp["num_key_value_heads"] if s else global_kv for s in swa])
    w.add_rope_dimension_count(hp["global_head_dim"])
    w.add_rope_dimension_count_swa(hp["head_dim"])  # times the (absent) top-level partial 1.0
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    # (the converter also cuts token_embd to the tokenizer's size: all 384 rows here)
    for name, t in load_file(os.path.join(folder, "model.safetensors")).items():
        if name.endswith("layer_scalar") or (".experts." in name and
                                             not name.endswith(".weight")):
            name += ".weight"  # `filter_tensors`
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("router.scale"):  # `modify_tensors`
            name = f"blk.{layer}.ffn_gate_inp.scale"
        elif name.endswith(".per_expert_scale"):
            name = f"blk.{layer}.ffn_down_exps.scale"
        else:  # norms as they are (`norm_shift` 0.0), nothing permuted
            base_name, suffix = name.rsplit(".", 1)
            name = f"{names.get_name(base_name)}.{suffix}"
        t = t.numpy()
        if qtype is not None and t.ndim == 2 and t.shape[1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.add_tensor("rope_freqs.weight", converter_rope_freqs(hp) if rope_freqs is None
                 else np.asarray(rope_freqs, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _config(path: str):
    from luceio.loader import load_checkpoint
    from luceio.models import model_config
    return model_config(load_checkpoint(path).config)


def _run(path: str, llm=None):
    """Greedy tokens and their logprobs on PROMPTS."""
    params = SamplingParams(max_tokens=10, logprobs=1, temperature=0.0, ignore_eos=True)
    outs = (llm or LLM(path, **engine_kwargs())).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in
                                      zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


@pytest.mark.parametrize("name", ["gqa_ple_shared", "global_wide_keqv"])
def test_gguf_equals_safetensors(models, tmp_path, name):
    """Per-layer inputs, two KV-shared layers with double-wide MLPs (gqa_ple_shared); global
    layers of head size 32 with one KV head, keys as values and no attn_v (global_wide_keqv)."""
    path = write_gguf(models[name], str(tmp_path / "tiny.gguf"), name)
    assert _config(path) == _config(models[name])
    assert_same_model((models[name], path), PROMPTS)


def test_the_converter_drops_the_rope_factor(models, tmp_path):
    """MHA, odd widths, untied, soft-capped, keys as values (a per-layer KV head list of one
    value), and HF's proportional `factor` 2.0, which the converter does not write: its file
    runs at factor 1, as llama.cpp runs it, equal to the safetensors without the factor; with
    2.0 in the rotated `rope_freqs` entries (llama.cpp divides their frequencies by it, as
    transformers does by `factor`) equal to the safetensors as they are."""
    src = models["mha_odd_keqv_untied"]
    unscaled = shutil.copytree(src, tmp_path / "unscaled")
    config = json.loads((unscaled / "config.json").read_text())
    del config["rope_parameters"]["full_attention"]["factor"]
    (unscaled / "config.json").write_text(json.dumps(config))
    path = write_gguf(src, str(tmp_path / "converted.gguf"), "mha_odd_keqv_untied")
    assert _config(path).rope_factor == 1.0 and _config(path).rope_partial_factor == 0.5
    assert_same_model((str(unscaled), path), PROMPTS)
    assert _run(path) != _run(src)  # the factor matters
    scaled = write_gguf(src, str(tmp_path / "scaled.gguf"), "mha_odd_keqv_untied",
                        [2.0] * 5 + [1e30] * 5)
    assert _config(scaled) == _config(src)
    assert_same_model((src, scaled), PROMPTS)


def test_rope_freqs_matter_and_others_are_refused(models, tmp_path):
    """Negative controls: half the pairs rotating instead of a quarter changes the output; a
    rope_freqs not of the converter's form (a stopped pair before a rotated one, two rotated
    values, the wrong length, no rope_freqs) is refused."""
    from luceio.loader import load_checkpoint
    from luceio.loader.gguf import gguf_config
    src = models["gqa_ple_shared"]  # global heads of 16: 2 of 8 pairs rotate
    half = write_gguf(src, str(tmp_path / "half.gguf"), "gqa_ple_shared", [1.0] * 4 + [1e30] * 4)
    assert _config(half).rope_partial_factor == 0.5
    assert _run(half) != _run(src)
    for i, freqs in enumerate(([1e30] + [1.0] * 2 + [1e30] * 5, [1.0, 0.5] + [1e30] * 6,
                               [1.0] * 2 + [1e30] * 4)):
        path = write_gguf(src, str(tmp_path / f"bad{i}.gguf"), "gqa_ple_shared", freqs)
        with pytest.raises(ValueError, match="rope_freqs"):
            load_checkpoint(path)
    meta, shapes, _ = _read(half)
    del shapes["rope_freqs.weight"]
    with pytest.raises(ValueError, match="without a rope_freqs"):
        gguf_config(meta, shapes, None)


def _read(path: str):
    """(metadata, shapes, rope_freqs values) of a GGUF, as `load_gguf` hands them on."""
    from luceio.loader.gguf import open_gguf
    reader = open_gguf(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    return meta, shapes, next(np.array(t.data) for t in reader.tensors
                              if t.name == "rope_freqs.weight")


@pytest.mark.parametrize("name,change,match", [
    ("gqa_ple_shared", lambda m, s, f: m.update({"gemma4.attention.sliding_window_pattern":
                                                 [True] * 5}), "last layer"),
    ("gqa_ple_shared", lambda m, s, f: m.update({"gemma4.attention.sliding_window_pattern": 2}),
     "one bool per layer"),
    ("gqa_ple_shared", lambda m, s, f: m.update({"gemma4.rope.scaling.type": "linear"}),
     "rope.scaling"),
    ("gqa_ple_shared", lambda m, s, f: m.update({"gemma4.rope.dimension_count": 8}), "rotat"),
    ("gqa_ple_shared", lambda m, s, f: m.update({"gemma4.feed_forward_length": [96] * 4 + [192]}),
     "MLP widths"),
    ("gqa_ple_shared", lambda m, s, f: s.pop("blk.0.attn_v.weight"), "attn_v"),
    ("global_wide_keqv", lambda m, s, f: s.update({"blk.1.attn_v.weight": (32, 64)}), "attn_v"),
    ("global_wide_keqv", lambda m, s, f: m.update({"gemma4.attention.head_count_kv":
                                                   [2, 1, 2, 1, 1]}), "local KV heads"),
])
def test_refuses_what_the_converter_does_not_write(models, tmp_path, name, change, match):
    from luceio.loader.gguf import gguf_config
    meta, shapes, freqs = _read(write_gguf(models[name], str(tmp_path / "t.gguf"), name))
    gguf_config(meta, shapes, freqs)  # as written: accepted
    change(meta, shapes, freqs)
    with pytest.raises(ValueError, match=match):
        gguf_config(meta, shapes, freqs)


def test_mixture_of_experts_gguf_equals_safetensors(tmp_path):
    """The experts stay stacked (`ffn_gate_up_exps`, `ffn_down_exps`), the router's scale and
    per-expert scale come from `ffn_gate_inp.scale` and `ffn_down_exps.scale`, the extra norms
    from `pre_ffw_norm_2`, `post_ffw_norm_1`, `post_ffw_norm_2` (5 experts, top 2, on the
    per-layer-input, KV-sharing config)."""
    from test_gemma4_moe import CONFIGS, make_tiny_gemma4_moe
    src = make_tiny_gemma4_moe(str(tmp_path / "moe"), "ple_e5k2", 0)
    path = write_gguf(src, str(tmp_path / "moe.gguf"), CONFIGS["ple_e5k2"][0])
    assert _config(path) == _config(src)
    assert_same_model((src, path), PROMPTS)


def test_quantized_gguf_kept_quantized_equals_dequantized(tmp_path, monkeypatch):
    """A Q8_0 file (per-layer inputs 32 wide, so that the per-layer table quantizes too): with
    `quantization=auto` its projections and token table stay quantized and the per-layer table
    loads dense (a plain embedding); on the torch reference kernels (which dequantize exactly)
    the same tokens and logprobs as the file dequantized at load."""
    monkeypatch.setenv("LUCEIO_KERNELS", "torch")
    src = make_tiny_gemma4(str(tmp_path / "ple32"), "gqa_ple_shared", 0,
                           hidden_size_per_layer_input=32)
    path = write_gguf(src, str(tmp_path / "q8.gguf"), "gqa_ple_shared",
                      qtype=gguf.GGMLQuantizationType.Q8_0)
    kept = LLM(path, **engine_kwargs(quantization="auto"))
    model = kept.engine.runner.model
    assert model.embed_tokens.qweight is not None and model.layers[0].mlp.down_proj.quantized
    assert model.embed_tokens_per_layer.weight.dtype == torch.float32
    dense = LLM(path, **engine_kwargs(quantization="none"))
    for (tokens, logprobs), (want_tokens, want) in zip(_run(path, kept), _run(path, dense)):
        assert tokens == want_tokens and logprobs == pytest.approx(want, abs=1e-5)
