"""Gemma 4 GGUF vocabularies (`tokenizer.ggml.model` "gemma4"; luceio/loader/gguf_tokenizer.py).

A tiny Gemma-4-shaped tokenizer is made the way Hugging Face's is: transformers' `GemmaTokenizer`
(the `tokenizer_class` of google/gemma-4-*) over a BPE vocabulary with `<0xNN>` byte tokens and
merges, Gemma 4's special tokens (`<bos>`, `<eos>`, `<|turn>`, `<turn|>`, `<|channel>`, ...), one
special and one plain added token past the base vocabulary, and a chat template, saved as
`tokenizer.json`. That folder goes through what llama.cpp's converter runs for it
(`Gemma4Model.set_vocab`: gguf's `LlamaHfVocab` and `SpecialVocab`, its "visible" tokens made
USER_DEFINED, `add_space_prefix` False, `add_bos_token` True) into a GGUF file, whose metadata
`gguf_tokenizer` turns back into a tokenizer. It must give the ids transformers gives for the
same text (spaces leading, trailing and in runs, newlines, unicode and emoji through byte
fallback, special tokens inside text) and decode them to the same text. Negative controls: the
same file read with SentencePiece's dummy prefix (the `llama` kind), or split at newlines first
as llama.cpp does, gives other ids. transformers' own GGUF reader, where it can build the file,
agrees."""
import json

import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

# The converter's `visible_tokens`: always rendered, so written USER_DEFINED rather than CONTROL
VISIBLE = ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
           "<tool_response|>", '<|"|>']
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|tool>", "<tool|>", "<|turn>",
           "<turn|>", "<|think|>"] + VISIBLE
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] }}"
            "<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
CORPUS = ["Hello world! The quick brown fox jumps over the lazy dog.\n\nA second   paragraph",
          "\n\n\n  with  spaces, and    more spaces.  ", "def f(x):\n    return x + 1\n\n",
          "Café déjà vu — 123 naïve", "hello hello world world   \n\n", "Über straße 42\tabc"]
TEXTS = [
    "Hello world", " leading space", "trailing space ", "  two leading", "two  spaces   three",
    "    indented\n        deeper", " ", "   ", "", "\n", "a\n\nb\n\n\nc", "\n\n\n\n\n\n\n",
    " \n \n", "tab\there", "Café déjà vu — 123", "naïve Über straße", "emoji 😊 and 🫩!",
    "中文字符", "© ® ½", "hellohelloworld worldworld", "def f(x):\n    return x + 1\n",
    "<|turn>user\nHi there<turn|>\n<|turn>model\n", "<bos>text<eos>", "a<|channel>thought<channel|>b",
    '<|tool_call>call:f{x:<|"|>s<|"|>}<tool_call|>', "x <custom> y<|image|>z", "<|think|> ok",
    "<|turn >not special", "<unk> <mask> <pad>",
]


def _train_vocab(space_pieces: bool) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small BPE vocabulary in Gemma's spelling: "▁" for spaces, runs of "▁" and of newlines
    as pieces, then byte tokens; with `space_pieces`, also pieces with a literal space (which the
    normalizer never reaches), whose merges the converter writes with the space as "Ġ"."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+|▁+(?![^▁\n])|▁?[^▁\n]+"), "isolated")
    bpe.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=160, show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    # and one piece across a newline, which only a text not split at newlines can reach
    pieces = sorted(model["vocab"], key=model["vocab"].get) + [":\n"]
    merges = [(":", "\n")] + [tuple(m) for m in model["merges"]]
    if space_pieces:
        pieces += [" ", " z", "y z"]
        merges += [(" ", "z"), ("y", " z")]
    tokens = SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + pieces
    return {t: i for i, t in enumerate(tokens)}, merges


def make_hf_folder(folder, space_pieces: bool = True) -> str:
    from tokenizers import AddedToken
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    vocab, merges = _train_vocab(space_pieces)
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL[5:] + ["<|image|>"]})
    tokenizer.add_tokens([AddedToken("<custom>", special=False, normalized=False)])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    return make_hf_folder(tmp_path_factory.mktemp("gemma4_tokenizer"))


@pytest.fixture(scope="module")
def reference(hf_folder):
    """The tokenizer transformers loads from the folder, as from a Gemma 4 repository."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return transformers.AutoTokenizer.from_pretrained(hf_folder, local_files_only=True)


def write_converter_gguf(folder: str, path: str, add_bos: bool = True) -> None:
    """`Gemma4Model.set_vocab` (llama.cpp conversion/gemma.py), written alone to a GGUF file."""
    from pathlib import Path

    vocab = gguf.LlamaHfVocab(Path(folder))
    tokens, scores, types = [], [], []
    for text, score, token_type in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(gguf.TokenType.USER_DEFINED if text.decode() in VISIBLE else token_type)
    writer = gguf.GGUFWriter(path, "gemma4")
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(Path(folder), load_merges=True).add_to_gguf(writer)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def read_meta(path: str) -> dict:
    """The metadata as `load_gguf` reads it."""
    from luceio.loader.gguf import open_gguf

    return {name: field.contents() for name, field in open_gguf(path).fields.items()}


@pytest.fixture(scope="module")
def gguf_file(hf_folder, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gemma4_gguf") / "vocab.gguf")
    write_converter_gguf(hf_folder, path)
    return path


@pytest.fixture(scope="module")
def ours(gguf_file):
    from luceio.loader.gguf_tokenizer import gguf_tokenizer

    meta = read_meta(gguf_file)
    tokenizer, config = gguf_tokenizer(meta)
    assert tokenizer is not None
    return meta, tokenizer, config


def test_file_is_what_the_converter_writes(ours, reference):
    meta, _, _ = ours
    assert meta["tokenizer.ggml.model"] == "gemma4" and "tokenizer.ggml.pre" not in meta
    assert meta["tokenizer.ggml.add_space_prefix"] is False
    assert len(meta["tokenizer.ggml.tokens"]) == len(reference)
    types = dict(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]))
    assert types["<0x41>"] == gguf.TokenType.BYTE and types["<|turn>"] == gguf.TokenType.CONTROL
    assert types["<|channel>"] == types["<custom>"] == gguf.TokenType.USER_DEFINED
    # merges came from tokenizer.json, the pieces with a space in them escaped as "Ġ"
    merges = meta["tokenizer.ggml.merges"]
    assert len(merges) > 50 and "y Ġz" in merges and "\n \n" in merges


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours, reference, text):
    _, tokenizer, _ = ours
    expected = reference.encode(text, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == expected, repr(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == \
        reference.decode(ids, skip_special_tokens=False)


def test_texts_exercise_merges_bytes_and_specials(ours, reference):
    """The comparison above covers multi-character pieces, byte fallback and special tokens,
    and decoding gives every text back."""
    _, tokenizer, _ = ours
    vocab = reference.get_vocab()
    ids = [i for text in TEXTS for i in tokenizer.encode(text, add_special_tokens=False).ids]
    pieces = {reference.convert_ids_to_tokens(i) for i in ids}
    assert {"<0xF0>", "<0x9F>", "<0xE4>"} <= pieces  # emoji and CJK, as UTF-8 bytes
    assert {"<|turn>", "<turn|>", "<|channel>", "<custom>", "<|image|>", "<bos>"} <= pieces
    assert any(len(p) > 3 and not p.startswith("<") for p in pieces)
    assert any(p.startswith("▁") and len(p) > 2 for p in pieces)
    assert "\n\n" in pieces and ":\n" in pieces and "▁▁" in vocab
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text, repr(text)


def test_special_tokens_bos_and_template(ours, reference, hf_folder):
    _, tokenizer, config = ours
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert config[name] == getattr(reference, name)
    assert config["chat_template"] == reference.chat_template == TEMPLATE
    assert config["add_bos_token"] is True and config["add_eos_token"] is False
    text = "Hello world"
    assert tokenizer.encode(text).ids == [reference.bos_token_id] + reference.encode(
        text, add_special_tokens=False)
    assert tokenizer.get_vocab_size() == len(reference)
    theirs = {i: t.content for i, t in reference.added_tokens_decoder.items()}
    added = tokenizer.get_added_tokens_decoder()
    assert {i: t.content for i, t in added.items()} == theirs
    # special in transformers; the converter makes its "visible" tokens user-defined, so that
    # llama.cpp (and luceio) show them even when special tokens are skipped
    special = {t.content for t in added.values() if t.special}
    assert special == {t for t in theirs.values() if t not in VISIBLE + ["<custom>"]}
    ids = tokenizer.encode("<|channel>thought<channel|><turn|>", add_special_tokens=False).ids
    assert tokenizer.decode(ids) == "<|channel>thought<channel|>"


def test_bos_is_added_whatever_the_flag(hf_folder, tmp_path):
    """llama.cpp adds BOS to every Gemma 4 file, also to ones converted with the flag False."""
    from luceio.loader.gguf_tokenizer import gguf_tokenizer

    path = str(tmp_path / "old.gguf")
    write_converter_gguf(hf_folder, path, add_bos=False)
    meta = read_meta(path)
    assert meta["tokenizer.ggml.add_bos_token"] is False
    tokenizer, config = gguf_tokenizer(meta)
    assert config["add_bos_token"] is True
    assert tokenizer.encode("hi").ids[0] == tokenizer.token_to_id("<bos>")


def test_negative_control_dummy_prefix_changes_ids(ours, reference):
    """Read as a `llama` vocabulary (a "▁" before the text, as SentencePiece adds), the same
    file gives other ids, so the comparison can fail; so does llama.cpp's split at newlines."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    from luceio.loader.gguf_tokenizer import gguf_tokenizer

    meta, tokenizer, _ = ours
    wrong, _ = gguf_tokenizer({**meta, "tokenizer.ggml.model": "llama",
                               "tokenizer.ggml.add_space_prefix": True})
    differ = [t for t in TEXTS if wrong.encode(t, add_special_tokens=False).ids
              != reference.encode(t, add_special_tokens=False)]
    assert "Hello world" in differ and " leading space" in differ
    # llama.cpp splits the text at newline runs before its merges: that loses ":\n"
    split = Tokenizer.from_str(tokenizer.to_str())
    split.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), "isolated")
    text = "def f(x):\n    return x + 1\n"
    assert split.encode(text, add_special_tokens=False).ids != \
        reference.encode(text, add_special_tokens=False)


def test_transformers_gguf_loader_agrees(tmp_path):
    """transformers' own reading of a Gemma 4 GGUF file, where it has one, gives the same ids.
    (Its merges are split as written, so the vocabulary here has no piece with a space: with
    one, transformers cannot build it, "Token `Ġ` out of vocabulary".)"""
    from luceio.loader.gguf_tokenizer import gguf_tokenizer

    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    path = str(tmp_path / "vocab.gguf")
    write_converter_gguf(make_hf_folder(tmp_path / "hf", space_pieces=False), path)
    architecture, tokenizer_dict, _ = mapping.get_gguf_tokenizer(path)
    theirs, _ = mapping.convert_gguf_tokenizer(architecture, tokenizer_dict)
    tokenizer, _ = gguf_tokenizer(read_meta(path))
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False).ids == \
            theirs.encode(text, add_special_tokens=False).ids, repr(text)


def test_luceio_tokenizer_encodes_like_transformers(ours, reference):
    """Through luceio's `Tokenizer`: a long chat-style prompt, encoded piece by piece between
    added tokens (`segment_encoder`), and a plain one with BOS."""
    from luceio.tokenizer import Tokenizer

    _, backend, config = ours
    tokenizer = Tokenizer(backend, config, {"eos_token_id": backend.token_to_id("<eos>")}, {})
    long = "".join(TEXTS) * 40
    assert tokenizer._segments is not None and len(long) > 4096
    assert tokenizer.encode(long, add_special_tokens=False) == \
        reference.encode(long, add_special_tokens=False)
    assert tokenizer.encode("Hello world") == [reference.bos_token_id] + reference.encode(
        "Hello world", add_special_tokens=False)
