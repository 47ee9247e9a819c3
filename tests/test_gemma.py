"""Gemma 3 against HF transformers (tiny random models, fp32, CPU): greedy output and logprobs
token for token, batching and chunked prefill against requests run alone, a tiny GGUF written
with gguf's writer against the safetensors it came from; and the sliding-window attention
(reference and Triton kernels under the interpreter) against its definition."""
import json
import os

import pytest
import torch

from conftest import GEMMA_CONFIGS as CONFIGS, assert_greedy_matches_transformers, \
    assert_same_model, assert_triton_engine_equals_reference, engine_kwargs, gguf_hparams, \
    make_tiny_gemma, random_prompts
from luceio import LLM, SamplingParams
from test_kernels import ATTN_TOL, DEVICE, SMALL, Rng, _random_tree_masks, check, make_batch

GREEDY = dict(temperature=0.0, ignore_eos=True)

@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory) -> dict[str, str]:
    return {name: make_tiny_gemma(str(tmp_path_factory.mktemp(name)), name, seed)
            for seed, name in enumerate(CONFIGS)}


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_config_reads_both_layer_type_forms(gemma_models):
    from luceio.loader import load_checkpoint
    from luceio.models import context_limit, model_config
    cfgs = {name: model_config(load_checkpoint(path).config)
            for name, path in gemma_models.items()}
    assert cfgs["gqa_tied"].layer_windows == (5, 5, 0)
    assert cfgs["gqa_tied"].rope_scaling["factor"] == 2.0
    assert cfgs["mha_odd_untied"].layer_windows == (7, 0, 7, 0)
    # the windows are masked, not a cut of the context
    assert context_limit(load_checkpoint(gemma_models["gqa_tied"]), None, None) == 512


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(gemma_models, name):
    # one prompt well past the windows
    assert_greedy_matches_transformers(gemma_models[name],
                                       random_prompts(3, seed=1) + [list(range(3, 30))])


def test_the_window_and_softcap_matter(gemma_models, tmp_path):
    """Negative controls: the same weights without the window generate other tokens, and
    without the soft-capping (monotonic: the same tokens) other logprobs, so the tests above
    exercise both."""
    import shutil
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, seed=1) + [list(range(3, 30))]]
    params = SamplingParams(max_tokens=14, logprobs=1, **GREEDY)

    def run(path):
        outs = LLM(path, **engine_kwargs()).generate(prompts, params)
        return _tokens(outs), [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                o.outputs[0].logprobs)]
                               for o in outs]
    for name, change, differ in (("gqa_tied", {"sliding_window": 512}, 0),
                                 ("mha_odd_untied", {"final_logit_softcapping": None}, 1)):
        folder = shutil.copytree(gemma_models[name], tmp_path / name)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        same, changed = run(gemma_models[name])[differ], run(str(folder))[differ]
        assert same != changed, change


def test_batched_and_chunked_prefill_equal_alone(gemma_models):
    path = gemma_models["gqa_tied"]
    prompts = random_prompts(5, seed=2)
    params = SamplingParams(max_tokens=10, **GREEDY)
    llm = LLM(path, **engine_kwargs())
    alone = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids
             for p in prompts]
    for kw in ({}, {"max_num_batched_tokens": 8, "block_size": 4}):  # chunks cross windows
        batched = LLM(path, **engine_kwargs(**kw)).generate(
            [{"prompt_token_ids": p} for p in prompts], params)
        assert _tokens(batched) == alone


def test_tree_speculation_is_lossless(gemma_models):
    """Draft trees (the model drafting for itself, two children a node) put a step's tokens at
    root + depth, not at their cache slots: the window must count positions (`attention.py`).
    A window counted in cache slots changes these tokens."""
    path = gemma_models["gqa_tied"]
    prompts = [{"prompt_token_ids": list(range(3, 23))}, {"prompt_token_ids": [5, 9, 33, 70, 41]}]
    params = SamplingParams(max_tokens=16, **GREEDY)
    plain = _tokens(LLM(path, **engine_kwargs()).generate(prompts, params))
    tree = LLM(path, **engine_kwargs(speculative_method="draft", draft_model=path,
                                     num_speculative_tokens=4, spec_tree_budget=8,
                                     spec_tree_topk=2))
    assert _tokens(tree.generate(prompts, params)) == plain
    assert tree.engine.stats().spec_accepted_tokens > 10


def test_refuses_what_it_does_not_run(gemma_models, tmp_path):
    import shutil
    path = gemma_models["gqa_tied"]
    with pytest.raises(ValueError, match="bounded KV residency"):
        LLM(path, **engine_kwargs(kv_resident_tokens=64))
    with pytest.raises(ValueError, match="speculative prefill"):
        LLM(path, **engine_kwargs(draft_model=path, spec_prefill_keep=0.5))
    folder = shutil.copytree(path, tmp_path / "capped")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 50.0}))
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        LLM(str(folder), **engine_kwargs())


def test_engine_on_triton_kernels_equals_reference(gemma_models, monkeypatch):
    """The engine (chunked prefill across the window, decode) on the Triton kernels
    (interpreted on CPU) gives the torch reference path's greedy tokens."""
    assert_triton_engine_equals_reference(gemma_models["gqa_tied"], monkeypatch)


# ------------------------------------------------------------------------------------- GGUF

def _write_gguf(folder: str, path: str) -> None:
    """The HF checkpoint in F32 under gguf's gemma3 tensor names and llama.cpp's metadata.
    As llama.cpp's converter does, every `*norm.weight` is stored as 1 + w (its RMSNorm
    multiplies by the stored weight), and no Q/K rows are permuted (Gemma's RoPE is NeoX)."""
    import gguf
    from safetensors.torch import load_file
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    layers = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, layers)
    writer = gguf.GGUFWriter(path, "gemma3")
    gguf_hparams(writer, c)
    writer.add_rope_freq_base(c["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_sliding_window(c["sliding_window"])
    # gguf keys luceio reads where llama.cpp assumes Gemma 3's release values (pattern 6,
    # local base 10000, scale from head_dim): the tiny configs differ from those
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])
    writer.add_rope_freq_base_swa(c["rope_parameters"]["sliding_attention"]["rope_theta"])
    writer.add_attention_scale(c["query_pre_attn_scalar"] ** -0.5)
    scaling = c["rope_parameters"]["full_attention"]
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if c.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(c["final_logit_softcapping"])
    for name, tensor in load_file(os.path.join(folder, "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        if name.endswith("norm.weight"):
            tensor = tensor + 1
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gguf_round_trip_equals_safetensors(gemma_models, tmp_path, name):
    pytest.importorskip("gguf")
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(gemma_models[name], path)
    assert_same_model((gemma_models[name], path), random_prompts(2, seed=3) + [list(range(3, 25))])


def test_gguf_without_luceio_keys_takes_llama_cpp_defaults(tmp_path):
    """A file as llama.cpp's converter writes it: pattern 6, local base 10000, the attention
    scalar from head_dim (hidden / heads for the 62-layer 27B)."""
    from luceio.loader.gguf import gguf_config
    meta = {"general.architecture": "gemma3", "gemma3.block_count": 62,
            "gemma3.embedding_length": 5376, "gemma3.feed_forward_length": 21504,
            "gemma3.attention.head_count": 32, "gemma3.attention.head_count_kv": 16,
            "gemma3.attention.key_length": 128, "gemma3.context_length": 131072,
            "gemma3.rope.freq_base": 1e6, "gemma3.attention.sliding_window": 1024,
            "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    c = gguf_config(meta, {"token_embd.weight": (262144, 5376)})
    assert c["query_pre_attn_scalar"] == 168 and c["rope_local_base_freq"] == 10000.0
    assert c["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert c["tie_word_embeddings"] and c["architectures"] == ["Gemma3ForCausalLM"]
    meta["gemma3.block_count"] = 26
    assert gguf_config(meta, {"token_embd.weight": (262144, 5376)})[
        "query_pre_attn_scalar"] == 128


# --------------------------------------------------------------------- sliding-window kernels

def _dense_attention(q, kc, vc, bt, seq_lens, qsl, scale, window, q_pos, k_pos, visible):
    """The definition, one query at a time in fp64: key n (cache index) of request b is seen by
    query t iff visible(b, t, n) and q_pos[t] - k_pos(b, n) < window."""
    out = torch.empty_like(q, dtype=torch.float64)
    block, group = kc.shape[1], q.shape[1] // kc.shape[2]
    for b in range(len(seq_lens)):
        for t in range(int(qsl[b]), int(qsl[b + 1])):
            keys = torch.tensor([n for n in range(int(seq_lens[b])) if visible(b, t, n) and
                                 q_pos[t] - k_pos(b, n) < window])
            k, v = kc[bt[b, keys // block].long(), keys % block].double(), \
                vc[bt[b, keys // block].long(), keys % block].double()
            for h in range(q.shape[1]):
                p = torch.softmax(k[:, h // group] @ q[t, h].double() * scale, 0)
                out[t, h] = p @ v[:, h // group]
    return out


def _run_both(args, **kw):
    from luceio.kernels import configs, triton_ops
    from luceio.kernels.attention import paged_attention_ref
    with configs.use_config(SMALL):
        out = triton_ops.paged_attention(*args, **kw)
    return out, paged_attention_ref(*args, **kw)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("q_lens,ctx", [([1, 1, 1, 1], [60, 9, 3, 33]),   # decode, splits
                                        ([5, 20, 1, 4], [0, 37, 20, 70])])  # varlen prefill
def test_window_kernels_match_reference_and_definition(window, q_lens, ctx):
    g = Rng()
    args = make_batch(g, q_lens, ctx, 2, 2, 32, torch.float32)
    out, ref = _run_both(args, window=window)
    check(out, ref, ATTN_TOL[torch.float32], g, f"window {window}, kernel vs reference")
    q, kc, vc, bt, seq_lens, qsl = (a.cpu() for a in args[:6])
    q_pos = [int(seq_lens[b]) - q_lens[b] + j for b in range(len(q_lens)) for j in range(q_lens[b])]
    dense = _dense_attention(q, kc, vc, bt, seq_lens, qsl, args[8], window, q_pos,
                             lambda b, n: n, lambda b, t, n: n <= q_pos[t])
    check(ref.double(), dense, ATTN_TOL[torch.float32], g, "reference vs definition")
    if window < max(s for s in seq_lens.tolist()):
        full = _run_both(args)[1]
        assert not torch.allclose(ref, full, atol=1e-3)  # the window masked something


def test_window_over_draft_trees():
    """Tree rows sit at root + depth: the window counts positions for them and for the step's
    keys, cache indices for the context; beside a plain prefill chunk (words -1)."""
    g = Rng()
    q_lens, ctx = [7, 12, 6], [20, 5, 16]
    args = make_batch(g, q_lens, ctx, 2, 2, 32, torch.float32)
    trees = [_random_tree_masks(g, 7), _random_tree_masks(g, 12)]
    words = trees[0] + trees[1] + [-1] * 6
    positions = []
    for b, tree in enumerate(trees):  # depth = set bits below the row's own
        positions += [ctx[b] + bin(w).count("1") - 1 for w in tree]
    positions += [ctx[2] + j for j in range(6)]
    tree_mask = torch.tensor(words, dtype=torch.int64, device=DEVICE)
    pos = torch.tensor(positions, dtype=torch.int64, device=DEVICE)
    out, ref = _run_both(args, tree_mask=tree_mask, window=3, positions=pos)
    check(out, ref, ATTN_TOL[torch.float32], g, "tree + window, kernel vs reference")
    q, kc, vc, bt, seq_lens, qsl = (a.cpu() for a in args[:6])

    def k_pos(b, n):
        step = n - ctx[b]
        return positions[int(qsl[b]) + step] if step >= 0 else n

    def visible(b, t, n):
        step, row = n - ctx[b], t - int(qsl[b])
        return n < ctx[b] or (step <= row and (words[t] >> step) & 1)
    dense = _dense_attention(q, kc, vc, bt, seq_lens, qsl, args[8], 3, positions, k_pos, visible)
    check(ref.double(), dense, ATTN_TOL[torch.float32], g, "tree + window, vs definition")
