"""A GGUF file's vocabulary (`tokenizer.ggml.*` metadata) as a `tokenizers.Tokenizer`:
GPT-2-style byte-level BPE with the split its merges were learned with, or SentencePiece-style
BPE (`llama`, and Gemma 4's `gemma4`), plus its special tokens and post-processor, and the
tokenizer config (chat template, named special tokens, BOS/EOS flags)."""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

# `tokenizer.ggml.pre` -> the split regex its merges were learned with, applied before the
# byte-level mapping. Others get GPT-2's split, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: letters run on through combining marks (\p{M})
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "qwen35": _QWEN35_SPLIT,
}
# Llama 3 takes a pre-token that is itself in the vocabulary whole, before trying merges
# (`ignore_merges` in its tokenizer.json, and in llama.cpp).
_IGNORE_MERGES_PRE = {"llama3", "llama-v3", "llama-bpe"}
# Pre-tokenizers that isolate every digit before GPT-2's split: llama.cpp splits on "\p{N}" first
# for these, as SmolLM's and StarCoder's tokenizer.json do with `Digits(individual_digits=True)`.
# (transformers' GGUF converter knows none of them and applies GPT-2's split alone, which differs
# on whitespace runs before a digit: "x  2".)
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


def gguf_tokenizer(meta: dict):
    """`(tokenizers.Tokenizer | None, tokenizer_config)` from `tokenizer.ggml.*` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    if kind == "gemma4":
        # llama.cpp adds BOS to every Gemma 4 file, whatever its flag says (ggml-org/llama.cpp
        # #21500; converters before it wrote False): its base models need it. A chat prompt,
        # whose template writes `<bos>` itself, is encoded without special tokens.
        add_bos = True
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    named = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        named[name] = tokens[token_id] if token_id is not None and token_id < len(tokens) else None
    config = {"chat_template": meta.get("tokenizer.chat_template"), **named,
              "add_bos_token": bool(add_bos), "add_eos_token": bool(add_eos)}
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta, meta.get("tokenizer.ggml.add_space_prefix", True))
    elif kind == "gemma4":
        # Gemma 4's tokenizer.json, as llama.cpp's converter writes it (`Gemma4Model.set_vocab`:
        # its vocabulary, `<0xNN>` byte tokens, and merges): BPE with byte fallback over the text
        # with spaces as "▁", no dummy prefix, no split (transformers' `GemmaTokenizer`). llama.cpp
        # splits newline runs off first, and keeps one whole where the vocabulary has it.
        tokenizer = _sentencepiece_bpe(meta, space_prefix=False)
    else:
        logger.warning("GGUF tokenizer model %r is not supported; serving token ids only", kind)
        return None, config
    _add_special_tokens(tokenizer, meta, kind, [t for t in named.values() if t is not None])
    _set_post_processor(tokenizer, config)
    return tokenizer, config


def _byte_level_bpe(meta: dict):
    """GPT-2-style byte-level BPE (Llama 3, Qwen2/3, SmolLM, ...)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(meta["tokenizer.ggml.tokens"]):
        if not set(token) <= alphabet:  # a token the file spells in plain text, not bytes
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    merges = [tuple(merge.split(" ")) for merge in meta.get("tokenizer.ggml.merges") or []]
    pre = meta.get("tokenizer.ggml.pre", "default")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False,
                                     continuing_subword_prefix="", end_of_word_suffix="",
                                     ignore_merges=pre in _IGNORE_MERGES_PRE))
    if pre in PRE_TOKENIZER_SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        if pre not in ("default", "gpt-2", "gpt2"):
            logger.warning("GGUF pre-tokenizer %r is unknown to luceio; splitting like GPT-2", pre)
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict, space_prefix: bool):
    """A SentencePiece BPE vocabulary (Llama 1/2, Mistral, Phi-3, Gemma 4): `▁` for spaces, byte
    fallback, merges from the file or, when it has none, ranked by the pieces' scores. With
    `space_prefix`, like SentencePiece and llama.cpp, and unlike `Metaspace`, the dummy prefix is
    added even before a leading space (" hi" -> "▁▁hi"), and again after each special token."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = _file_merges(meta["tokenizer.ggml.merges"], vocab)
    else:
        merges = _merges_from_scores(vocab, dict(zip(tokens, meta["tokenizer.ggml.scores"])))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=True,
                                     byte_fallback=True,
                                     unk_token=tokens[unk_id] if unk_id is not None else None))
    steps = [normalizers.Replace(" ", "▁")]
    if space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        decode.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


def _file_merges(merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The file's "left right" merges as pairs. gguf's `SpecialVocab` writes a space inside a
    piece as "Ġ" (U+0120), so that the pair splits on its one space: a piece the vocabulary does
    not have that way gets its spaces back."""
    def piece(text: str) -> str:
        return text if text in vocab or "Ġ" not in text else text.replace("Ġ", " ")

    return [tuple(piece(part) for part in merge.split(" ")) for merge in merges]


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best-scoring piece first (what
    SentencePiece BPE does at encode time)."""
    merges = []
    for piece, score in scores.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                  if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, score) for left, right in splits)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tokenizer, meta: dict, kind: str, named: list[str]) -> None:
    """Control tokens (and the named bos/eos/unk/pad) become special added tokens, user-defined
    ones plain added tokens, so the text `<|im_start|>` encodes to its one id. In a byte-level
    vocabulary a "control" token spelled outside the byte alphabet is a llama.cpp mislabel, and
    is left alone."""
    from tokenizers import AddedToken

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    alphabet = set(_bytes_to_unicode().values()) if kind == "gpt2" else None
    special = [t for t, kind_id in zip(tokens, types)
               if kind_id == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    special += [t for t in named if t not in special]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    vocab = tokenizer.get_vocab()
    user = [t for t, kind_id in zip(tokens, types) if kind_id == _USER_DEFINED and t in vocab]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _set_post_processor(tokenizer, config: dict) -> None:
    """BOS/EOS added by the tokenizer itself, as in an HF `tokenizer.json`."""
    from tokenizers import processors

    bos = config["bos_token"] if config["add_bos_token"] else None
    eos = config["eos_token"] if config["add_eos_token"] else None
    if bos is None and eos is None:
        return

    def template(sequence: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (bos, sequence, eos) if t is not None]

    tokenizer.post_processor = processors.TemplateProcessing(
        single=template("$A", 0), pair=template("$A", 0) + template("$B", 1),
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in {bos, eos} if t is not None])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
