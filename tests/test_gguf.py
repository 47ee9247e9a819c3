"""GGUF loading and model-name resolution.

Offline: the resolver fetches a tiny two-part "model" from wheels built in tmp_path, and a
synthetic GGUF written with gguf's own writer must load back to the HF tensors it was made from.
`registry`: real GGUFs fetched through the resolver (cached in the default cache folder) are
compared tensor by tensor, config and tokenizer with transformers' GGUF loader, and tokenizers
built from llama.cpp's vocab-only GGUFs with the reference tokenizations shipped beside them.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

import numpy as np
import pytest
import torch

from luceio.loader import resolve
from luceio.loader.gguf import gguf_tokenizer, open_gguf, unpermute_rotary_rows
from luceio.loader.resolve import ModelDownloadError, ModelResolveError, resolve_model

PARTS = [b"GGUF" + bytes(range(256)) * 40, b"second part" * 333]


def _build_wheel(folder, dist: str, version: str, member: str, payload: bytes) -> str:
    stem = f"{dist.replace('-', '_')}-{version}"
    path = os.path.join(folder, f"{stem}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(member, payload)
        wheel.writestr(f"{stem}.dist-info/METADATA",
                       f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        wheel.writestr(f"{stem}.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{stem}.dist-info/RECORD", "")
    return path


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A short name `tiny` made of two wheels in tmp_path/wheels, with the cache in tmp_path."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    entry = {"packages": [], "members": [], "filename": "tiny.gguf", "license": "test",
             "size": sum(map(len, PARTS)),
             "sha256": hashlib.sha256(b"".join(PARTS)).hexdigest()}
    for i, payload in enumerate(PARTS, 1):
        member = f"tiny_part{i}/data/part{i:02d}.bin"
        _build_wheel(wheels, f"tiny-part{i}", "1.0", member, payload)
        entry["packages"].append(f"tiny-part{i}==1.0")
        entry["members"].append(member)
    monkeypatch.setitem(resolve.MODELS, "tiny", entry)
    monkeypatch.setenv("LUCEIO_CACHE", str(tmp_path / "cache"))
    return entry, wheels, tmp_path / "cache" / "models" / "tiny"


@pytest.fixture
def fake_pip(tiny, monkeypatch):
    """Replaces `pip download` with a copy from the local wheel folder; records the calls."""
    _, wheels, _ = tiny
    calls = []

    def download(requirement, dest):
        calls.append(requirement)
        dist, version = requirement.split("==")
        name = f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
        return shutil.copy(wheels / name, dest)

    monkeypatch.setattr(resolve, "_pip_download", download)
    return calls


def test_unknown_short_name_lists_known_ones():
    with pytest.raises(ModelResolveError) as error:
        resolve_model("no-such-model-xyz")
    for short in resolve.MODELS:
        assert short in str(error.value)


def test_local_paths_pass_through(tmp_path):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model(str(gguf_file)) == str(gguf_file)
    other = tmp_path / "m.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelResolveError, match="not a .gguf"):
        resolve_model(str(other))


def test_fetch_joins_parts_in_order_and_then_uses_the_cache(tiny, fake_pip):
    entry, _, folder = tiny
    path = resolve_model("tiny")
    assert path == str(folder / "tiny.gguf")
    with open(path, "rb") as f:
        assert f.read() == b"".join(PARTS)
    assert fake_pip == entry["packages"]
    assert sorted(os.listdir(folder)) == ["tiny.gguf", "tiny.gguf.sha256-ok"]

    fake_pip.clear()
    assert resolve_model("TINY") == path
    assert fake_pip == []


def test_cache_hit_trusts_the_marker_without_rehashing(tiny, fake_pip, monkeypatch):
    path = resolve_model("tiny")
    monkeypatch.setattr(resolve, "_sha256", lambda p: pytest.fail("rehashed a verified file"))
    assert resolve_model("tiny") == path


@pytest.mark.parametrize("keep_marker", [True, False])
def test_corrupted_cache_file_is_detected_and_refetched(tiny, fake_pip, keep_marker):
    entry, _, folder = tiny
    path = resolve_model("tiny")
    with open(path, "r+b") as f:  # same size, one byte changed
        f.seek(100)
        f.write(b"\xff")
    if not keep_marker:
        os.remove(path + ".sha256-ok")
    fake_pip.clear()
    assert resolve_model("tiny") == path
    assert fake_pip == entry["packages"]
    with open(path, "rb") as f:
        assert f.read() == b"".join(PARTS)


def test_hash_mismatch_raises_and_leaves_nothing(tiny, fake_pip, monkeypatch):
    entry, _, folder = tiny
    monkeypatch.setitem(entry, "sha256", "0" * 64)
    with pytest.raises(ModelResolveError, match="sha256") as error:
        resolve_model("tiny")
    assert not isinstance(error.value, ModelDownloadError)
    assert os.listdir(folder) == []


def test_missing_member_raises_and_leaves_nothing(tiny, fake_pip, monkeypatch):
    entry, _, folder = tiny
    monkeypatch.setitem(entry, "members", [entry["members"][0], "tiny_part2/data/other.bin"])
    with pytest.raises(ModelResolveError, match="does not hold"):
        resolve_model("tiny")
    assert os.listdir(folder) == []


def test_real_pip_download_from_a_local_index(tiny, monkeypatch):
    """The real `pip download` subprocess, pointed at the wheel folder instead of PyPI."""
    _, wheels, folder = tiny
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    with open(resolve_model("tiny"), "rb") as f:
        assert f.read() == b"".join(PARTS)

    shutil.rmtree(folder)
    os.remove(wheels / "tiny_part2-1.0-py3-none-any.whl")
    with pytest.raises(ModelDownloadError, match="tiny-part2==1.0"):
        resolve_model("tiny")
    assert os.listdir(folder) == []


def test_stale_work_folders_of_killed_fetches_are_removed(tiny, fake_pip):
    _, _, folder = tiny
    stale = folder / ".fetch-killed"
    stale.mkdir(parents=True)
    (stale / "tiny.gguf").write_bytes(b"half")
    os.utime(stale, (0, 0))
    resolve_model("tiny")
    assert sorted(os.listdir(folder)) == ["tiny.gguf", "tiny.gguf.sha256-ok"]


def test_hub_repo_id_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ModelResolveError, match="huggingface_hub is not installed"):
        resolve_model("some-org/some-model")


def test_hub_repo_id_offline(monkeypatch):
    hub = pytest.importorskip("huggingface_hub")

    def offline(*args, **kwargs):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(hub, "snapshot_download", offline)
    with pytest.raises(ModelResolveError, match="offline"):
        resolve_model("some-org/some-model")


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, the transform being undone."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@pytest.mark.parametrize("shape", [(9 * 64, 576), (3 * 64,)])
def test_unpermute_inverts_llama_cpp_permute(shape):
    num_heads = shape[0] // 64
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    assert np.array_equal(unpermute_rotary_rows(_llama_cpp_permute(w, num_heads), num_heads), w)


def test_luceio_loader_imports_without_gguf():
    code = ("import sys; sys.modules['gguf'] = None\n"
            "import luceio.loader, luceio.loader.gguf, luceio.loader.resolve")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- real models from the package registry, against transformers ----------------------------

TEXTS = [
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "\tindented\twith tabs\n\n\n   trailing spaces   ",
    "x  2 + 2024 = 2026; pi=3.14159, ¹²³ ٣",
    "Steps:\n\n1. fetch\n\n2. verify",
    "naïve café — 日本語のテキスト, emoji 🤖🚀, Ελληνικά, русский",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat's up?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "I'm sure they'll've DONE it, HAVEN'T they?",
    "",
    "\u00a0non-breaking\u200bzero-width\r\nwindows",
    "a" * 50 + " " * 20 + "b",
]


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def real(request):
    """(our checkpoint, transformers model, transformers tokenizer) for one short name."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    try:
        path = resolve_model(request.param)
    except ModelDownloadError as error:
        pytest.skip(f"package registry unreachable: {error}")
    from luceio.loader.gguf import load_gguf

    folder, name = os.path.split(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # else the tokenizer asks the Hub about its name
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                                  dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return load_gguf(path), model, tokenizer


@pytest.mark.registry
def test_every_tensor_matches_transformers(real):
    ckpt, model, _ = real
    expected = model.state_dict()
    if ckpt.config["tie_word_embeddings"]:
        expected.pop("lm_head.weight", None)
    seen = set()
    for name, tensor in ckpt.weights():
        assert name in expected, f"{name} is not a transformers parameter"
        assert tensor.dtype == torch.float32 and tensor.shape == expected[name].shape, name
        assert torch.allclose(tensor, expected[name], rtol=0, atol=1e-6), name
        seen.add(name)
    assert seen == set(expected)


@pytest.mark.registry
def test_config_matches_transformers(real):
    ckpt, model, _ = real
    ours, theirs = ckpt.config, model.config
    assert ours["architectures"] == [type(model).__name__]
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "vocab_size",
                "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert ours[key] == getattr(theirs, key), key
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert ours["head_dim"] == head_dim
    rope = getattr(theirs, "rope_parameters", None) or {}
    assert ours["rope_theta"] == pytest.approx(rope.get("rope_theta", getattr(theirs, "rope_theta", None)))
    assert ours["rms_norm_eps"] == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    assert ours["rope_scaling"] is None and rope.get("rope_type", "default") == "default"


# Whitespace runs before a digit: where transformers' GGUF converter, having no entry for
# SmolLM's "smollm" pre-tokenizer, splits like GPT-2 instead of digits-first as llama.cpp does.
_SMOLLM_DIVERGES = re.compile(r"\s\s\d")


def _reference_backend(ckpt, tokenizer):
    """transformers' backend tokenizer, with llama.cpp's digit split where its GGUF converter
    has no entry for the file's pre-tokenizer (SmolLM: "smollm")."""
    from tokenizers import Tokenizer, pre_tokenizers

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    if ckpt.config["model_type"] == "llama":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return backend


@pytest.mark.registry
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(real, text):
    ckpt, _, tokenizer = real
    ours = ckpt.tokenizer
    ids = ours.encode(text).ids
    reference = _reference_backend(ckpt, tokenizer)
    assert ids == reference.encode(text).ids
    if not (ckpt.config["model_type"] == "llama" and _SMOLLM_DIVERGES.search(text)):
        assert ids == tokenizer(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids, skip_special_tokens=False) == tokenizer.decode(ids)


@pytest.mark.registry
def test_tokenizer_special_tokens_and_template(real):
    ckpt, _, tokenizer = real
    cfg = ckpt.tokenizer_config
    assert cfg["bos_token"] == tokenizer.bos_token and cfg["eos_token"] == tokenizer.eos_token
    assert cfg["add_bos_token"] == tokenizer.add_bos_token
    assert cfg["chat_template"] == tokenizer.chat_template
    assert ckpt.generation_config["eos_token_id"] == tokenizer.eos_token_id
    assert ckpt.tokenizer.get_vocab_size() == len(tokenizer)
    ours = {i: (t.content, t.special) for i, t in ckpt.tokenizer.get_added_tokens_decoder().items()}
    theirs = {i: (t.content, t.special) for i, t in tokenizer.added_tokens_decoder.items()}
    assert ours == theirs


# llama.cpp's vocab-only GGUFs, with reference tokenizations that its update script made with each
# model's own HF tokenizer.json: an independent check of the tokenizer built from metadata,
# including SentencePiece vocabularies and the digit-first split SmolLM's "smollm" shares with
# starcoder/refact/command-r.
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
VOCABS = ["llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2", "starcoder", "refact", "command-r"]


@pytest.fixture(scope="module")
def llama_cpp_vocabs():
    folder = os.path.join(resolve.cache_dir(), "test-data", LLAMA_CPP_SDIST.replace("==", "-"))
    if os.path.isdir(folder):
        return folder
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(folder)) as tmp:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                                 "--no-binary=:all:", "-q", "-d", tmp, LLAMA_CPP_SDIST],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"package registry unreachable: {result.stderr.strip()[-300:]}")
        wanted = re.compile(r"/vendor/llama\.cpp/models/(ggml-vocab-(%s)\.gguf(\.inp|\.out)?)$"
                            % "|".join(map(re.escape, VOCABS)))
        out = os.path.join(tmp, "vocabs")
        os.mkdir(out)
        [sdist] = [f for f in os.listdir(tmp) if f.endswith(".tar.gz")]
        with tarfile.open(os.path.join(tmp, sdist)) as tar:
            for member in tar:
                if match := wanted.search(member.name):
                    with open(os.path.join(out, match[1]), "wb") as f:
                        f.write(tar.extractfile(member).read())
        os.replace(out, folder)
    return folder


@pytest.mark.registry
@pytest.mark.parametrize("vocab", VOCABS)
def test_tokenizer_matches_llama_cpp_reference(llama_cpp_vocabs, vocab):
    pytest.importorskip("gguf")
    path = os.path.join(llama_cpp_vocabs, f"ggml-vocab-{vocab}.gguf")
    meta = {name: field.contents() for name, field in open_gguf(path).fields.items()}
    tokenizer, _ = gguf_tokenizer(meta)
    with open(path + ".inp", encoding="utf-8") as f:
        texts = f.read().split("\n__ggml_vocab_test__\n")
    with open(path + ".out", encoding="utf-8") as f:
        expected = [[int(i) for i in line.split()] for line in f.read().split("\n")]
    assert len(texts) == len(expected) > 40
    for text, ids in zip(texts, expected):
        assert tokenizer.encode(text, add_special_tokens=False).ids == ids, repr(text)


# ---- a synthetic GGUF written with gguf's own writer (offline) -------------------------------

def _write_gguf(path, arch: str, quant: dict | None = None, heads: int = 4, hidden: int = 64,
                ffn: int = 96, pad_tokens: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer model with known HF-layout weights, stored the way llama.cpp's converter
    stores them (llama: Q/K rows permuted, tied embeddings; qwen2: q/k/v bias, untied output).
    Returns the HF state dict that loading must give back. `quant` maps GGUF tensor kinds
    (`attn_q`, `ffn_down`, `token_embd`, ...) to a GGMLQuantizationType to store them in
    (quantized with gguf's own quantizer) instead of F16; the state dict returned is then the
    unquantized one. `heads` query heads share `hidden` (head_dim hidden / heads), over
    heads / 2 KV heads. The vocabulary: 256 bytes, 3 special tokens, `pad_tokens` more."""
    from gguf import GGUFWriter

    kv_heads, vocab = heads // 2, 259 + pad_tokens
    head_dim = hidden // heads
    rng = np.random.default_rng(1)

    def tensor(*shape):  # f16-representable, so the F16 tensors round-trip exactly
        return rng.standard_normal(shape).astype(np.float16).astype(np.float32)

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<|endoftext|>", "<|im_start|>",
                                                            "<|im_end|>"]
    tokens += [f"<|pad_{i}|>" for i in range(pad_tokens)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * (3 + pad_tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(258)
    writer.add_chat_template("{{ messages }}")

    hf = {"model.embed_tokens.weight": tensor(vocab, hidden), "model.norm.weight": tensor(hidden)}
    stored = {"token_embd.weight": hf["model.embed_tokens.weight"],
              "output_norm.weight": hf["model.norm.weight"]}
    if arch == "qwen2":
        hf["lm_head.weight"] = stored["output.weight"] = tensor(vocab, hidden)
    for i in range(2):
        p = f"model.layers.{i}."
        layer = {"input_layernorm.weight": ("attn_norm", tensor(hidden)),
                 "post_attention_layernorm.weight": ("ffn_norm", tensor(hidden)),
                 "self_attn.q_proj.weight": ("attn_q", tensor(heads * head_dim, hidden)),
                 "self_attn.k_proj.weight": ("attn_k", tensor(kv_heads * head_dim, hidden)),
                 "self_attn.v_proj.weight": ("attn_v", tensor(kv_heads * head_dim, hidden)),
                 "self_attn.o_proj.weight": ("attn_output", tensor(hidden, heads * head_dim)),
                 "mlp.gate_proj.weight": ("ffn_gate", tensor(ffn, hidden)),
                 "mlp.up_proj.weight": ("ffn_up", tensor(ffn, hidden)),
                 "mlp.down_proj.weight": ("ffn_down", tensor(hidden, ffn))}
        if arch == "qwen2":
            for proj, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                layer[f"self_attn.{proj}_proj.bias"] = (f"attn_{proj}", tensor(n * head_dim))
        for hf_name, (gguf_part, value) in layer.items():
            hf[p + hf_name] = value
            if arch == "llama" and gguf_part in ("attn_q", "attn_k"):
                value = _llama_cpp_permute(value, heads if gguf_part == "attn_q" else kv_heads)
            suffix = hf_name.rsplit(".", 1)[1]
            stored[f"blk.{i}.{gguf_part}.{suffix}"] = value
    for name, value in stored.items():
        kind = name.split(".")[-2]
        if quant and value.ndim == 2 and kind in quant:
            from gguf.quants import quantize
            writer.add_tensor(name, quantize(value, quant[kind]), raw_dtype=quant[kind])
        else:
            writer.add_tensor(name, value.astype(np.float16) if value.ndim == 2 else value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_load_synthetic_gguf(tmp_path, arch):
    pytest.importorskip("gguf")
    from luceio.loader import load_checkpoint

    path = tmp_path / "tiny.gguf"
    expected = _write_gguf(path, arch)
    ckpt = load_checkpoint(str(path))
    weights = dict(ckpt.weights())
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], torch.from_numpy(value)), name
    config = ckpt.config
    assert config["architectures"] == [{"llama": "LlamaForCausalLM",
                                        "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
            config["vocab_size"]) == (64, 2, 4, 2, 16, 96, 259)
    assert config["tie_word_embeddings"] == (arch == "llama")
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 10000.0
    assert ckpt.generation_config == {"bos_token_id": 256, "eos_token_id": 258}
    assert ckpt.tokenizer_config["eos_token"] == "<|im_end|>"
    assert ckpt.tokenizer_config["chat_template"] == "{{ messages }}"
    ids = ckpt.tokenizer.encode("<|im_start|>hi é").ids
    assert ids[0] == 257 and len(ids) == 1 + len("hi é".encode())
    assert ckpt.tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi é"


# ---- the engine on real weights, against transformers ------------------------------------------

ENGINE_PROMPTS = [
    "def is_prime(n):",
    "The capital of France is",
    "Write a haiku about the sea.\n",
    "import numpy as np\n\nx = np.",
    "Q: What is 12 * 7?\nA:",
]


@pytest.fixture(scope="module")
def real_llm(real):
    from luceio import LLM
    ckpt = real[0]
    return LLM(ckpt.source, dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=2048,
               quantization="none")  # the exact comparison: transformers dequantizes too


@pytest.mark.registry
def test_engine_greedy_and_logits_match_transformers(real, real_llm):
    from luceio import SamplingParams
    _, model, tokenizer = real
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ENGINE_PROMPTS]
    outs = real_llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0, max_tokens=40, logprobs=5))
    for ids, out in zip(prompts, outs):
        with torch.inference_mode():  # both stop at the model's eos (and keep it)
            ref = model.generate(torch.tensor([ids]), max_new_tokens=40,
                                 do_sample=False)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref
    # logits of the first prompt: the engine's top-5 logprobs equal transformers' log-softmax
    seq = prompts[0] + outs[0].outputs[0].token_ids
    with torch.inference_mode():
        ref_lp = model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
    for i, step in enumerate(outs[0].outputs[0].logprobs):
        row = ref_lp[len(prompts[0]) - 1 + i]
        for tok, lp in step.items():
            assert lp.logprob == pytest.approx(row[tok].item(), abs=2e-3)


@pytest.mark.registry
def test_engine_chat_template_matches_transformers(real, real_llm):
    _, _, tokenizer = real
    conv = [{"role": "system", "content": "You are a careful coding assistant."},
            {"role": "user", "content": "Reverse a list in Python."},
            {"role": "assistant", "content": "Use `xs[::-1]`."},
            {"role": "user", "content": "And in place?"}]
    ours = real_llm.get_tokenizer().apply_chat_template(conv, add_generation_prompt=True)
    assert ours == tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
