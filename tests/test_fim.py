"""Fill-in-the-middle prompts (luceio/server/fim.py): Qwen2.5-Coder's against token ids written
out by hand (text pieces as transformers' GGUF tokenizer encodes them), the other families on
character-level synthetic tokenizers whose ids are plain to read, and the prompt of a llama.cpp
/infill body (the rest of /infill: test_server_infill.py)."""
from __future__ import annotations

import pytest

from luceio.server.fim import FimFormat, FimUnsupported, build_fim_prompt
from luceio.server.infill import parse_infill
from luceio.tokenizer import Tokenizer

# Qwen2.5-Coder's special tokens
PRE, SUF, MID, PAD, REPO, SEP, EOT = 151659, 151661, 151660, 151662, 151663, 151664, 151643
PREFIX = "def add(a, b):\n    "
TYPED = "return"
SUFFIX = "\n\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "utils.py", "text": "def sub(a, b):\n    return a - b\n"},
         {"filename": "README.md", "text": "# calc\nSmall maths helpers.\n"}]
# transformers' Qwen2.5-Coder tokenizer (from the GGUF) on each text piece
PREFIX_IDS = [750, 912, 2877, 11, 293, 982, 257]
TYPED_IDS = [689]
SUFFIX_IDS = [1406, 1350, 25906, 7, 16, 11, 220, 17, 1171]
FIM_TAIL = [PRE, *PREFIX_IDS, *TYPED_IDS, SUF, *SUFFIX_IDS, MID]
FILES = [SEP, 6031, 7197, 198,  # utils.py\n
         750, 1186, 2877, 11, 293, 982, 262, 470, 264, 481, 293, 198,
         SEP, 54675, 21324, 198,  # README.md\n
         2, 10035, 198, 25307, 70708, 30187, 624,
         SEP, 8404, 198]  # filename\n: llama.cpp's name for the current file


@pytest.mark.registry
def test_qwen_fim_prompt(qwen_coder_tokenizer):
    tok = qwen_coder_tokenizer
    assert build_fim_prompt(tok, PREFIX, SUFFIX, prompt=TYPED) == FIM_TAIL
    assert build_fim_prompt(tok, PREFIX, "", prompt=TYPED) == [PRE, *PREFIX_IDS, *TYPED_IDS, SUF, MID]
    # the typed part is its own piece: encoded with the prefix, "    return" merges differently
    assert build_fim_prompt(tok, PREFIX + TYPED, "")[1:9] != [*PREFIX_IDS, *TYPED_IDS]


@pytest.mark.registry
def test_qwen_repo_level_prompt(qwen_coder_tokenizer):
    tok = qwen_coder_tokenizer
    ids = build_fim_prompt(tok, PREFIX, SUFFIX, EXTRA, repo_name="calc", prompt=TYPED)
    assert ids == [REPO, 26586, 198, *FILES, *FIM_TAIL]  # calc\n
    unnamed = build_fim_prompt(tok, PREFIX, SUFFIX, EXTRA, prompt=TYPED)
    assert unnamed == [REPO, 2408, 4987, 198, *FILES, *FIM_TAIL]  # llama.cpp's myproject\n


@pytest.mark.registry
def test_qwen_format(qwen_coder_tokenizer):
    tok = qwen_coder_tokenizer
    fmt = FimFormat.detect(tok)
    assert (fmt.name, fmt.prefix_id, fmt.suffix_id, fmt.middle_id) == ("Qwen2.5-Coder", PRE, SUF, MID)
    assert (fmt.repo_id, fmt.file_sep_id) == (REPO, SEP)
    assert fmt.stop_token_ids == (EOT, PAD, REPO, SEP)


# synthetic tokenizers: one token per character, ids in ALPHABET order, special tokens after --
ALPHABET = ["<unk>", "▁", "☺", "\n", " ", "-", "#", "(", ")", ":", ".", *"abcdefghijklmnopqrstuvwxyz"]


def char_tokenizer(specials: list[str], bos: str | None = None,
                   sentencepiece: bool = False) -> Tokenizer:
    """`sentencepiece`: spaces become `▁` and every text gets a leading `▁` (the dummy prefix),
    as luceio's SentencePiece-style GGUF tokenizers do."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers
    hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(ALPHABET)}, merges=[],
                                unk_token="<unk>"))
    if sentencepiece:
        hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                              normalizers.Replace(" ", "▁")])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return Tokenizer(hf, {"bos_token": bos, "add_bos_token": bos is not None}, {}, {})


def chars(text: str) -> list[int]:
    return [ALPHABET.index(c) for c in text]


def special(tok: Tokenizer, token: str) -> int:
    return tok.token_to_id(token)


def test_char_tokenizer_reads_as_expected():
    tok = char_tokenizer(["<x>"], sentencepiece=True)
    assert tok.encode("ab c", add_special_tokens=False) == [1, 11, 12, 1, 13]
    assert special(tok, "<x>") == len(ALPHABET)


def test_starcoder_psm_with_repository_tokens():
    tok = char_tokenizer(["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>",
                          "<fim_pad>", "<repo_name>", "<file_sep>"])
    n = len(ALPHABET)
    eot, pre, mid, suf, pad, repo, sep = range(n, n + 7)
    assert build_fim_prompt(tok, "ab", "c", prompt="d") == [pre, 11, 12, 14, suf, 13, mid]
    ids = build_fim_prompt(tok, "ab", "c", [{"filename": "x.py", "text": "e\n"}], repo_name="r")
    assert ids == [repo, *chars("r\n"), sep, *chars("x.py\n"), *chars("e\n"),
                   sep, *chars("filename\n"), pre, *chars("ab"), suf, *chars("c"), mid]
    assert FimFormat.detect(tok).stop_token_ids == (eot, pad, repo, sep)


def test_deepseek_coder_psm_with_bos_and_snippets():
    tok = char_tokenizer(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜fim▁hole｜>",
                          "<｜fim▁begin｜>", "<｜fim▁end｜>"], bos="<｜begin▁of▁sentence｜>")
    bos, eos, hole, begin, end = range(len(ALPHABET), len(ALPHABET) + 5)
    assert build_fim_prompt(tok, "ab", "c") == [bos, begin, *chars("ab"), hole, *chars("c"), end]
    # no repository tokens: each chunk follows llama.cpp's snippet separator, after BOS
    ids = build_fim_prompt(tok, "ab", "c", [{"filename": "x", "text": "e"}])
    assert ids == [bos, *chars("\n\n--- snippet ---\n\n"), *chars("e"),
                   begin, *chars("ab"), hole, *chars("c"), end]
    with pytest.raises(ValueError, match="repository token"):
        build_fim_prompt(tok, "ab", "c", repo_name="r")
    assert FimFormat.detect(tok).stop_token_ids == (eos,)


def test_codellama_suffix_has_no_dummy_prefix():
    tok = char_tokenizer(["<s>", "▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"], bos="<s>",
                         sentencepiece=True)
    bos, pre, suf, mid, eot = range(len(ALPHABET), len(ALPHABET) + 5)
    ids = build_fim_prompt(tok, "a b", "c d")
    # "<PRE> {pre} <SUF>{suf} <MID>": the prefix keeps its leading ▁, the suffix has none
    assert ids == [bos, pre, 1, 11, 1, 12, suf, 13, 1, 14, mid]
    assert ids != [bos, pre, 1, 11, 1, 12, suf, *tok.encode("c d", False), mid]  # control
    fmt = FimFormat.detect(tok)
    assert (fmt.name, fmt.stop_token_ids) == ("CodeLlama", (eot,))


def test_codestral_suffix_first_without_middle():
    tok = char_tokenizer(["<s>", "</s>", "[SUFFIX]", "[PREFIX]"], bos="<s>", sentencepiece=True)
    bos, _, suf, pre = range(len(ALPHABET), len(ALPHABET) + 4)
    # mistral_common: [BOS][SUFFIX]{suffix without ▁}[PREFIX]{prefix}, generation continues it
    assert build_fim_prompt(tok, "ab", "cd", prompt="e") == \
        [bos, suf, 13, 14, pre, 1, 11, 12, 1, 15]


def test_no_fim_tokens_is_refused_naming_them():
    with pytest.raises(FimUnsupported) as error:
        build_fim_prompt(char_tokenizer(["<|im_start|>"]), "a", "b")
    for token in ("<|fim_prefix|>", "<fim_middle>", "▁<SUF>", "<｜fim▁hole｜>", "[PREFIX]"):
        assert token in str(error.value)
    assert FimFormat.detect(char_tokenizer(["<|im_start|>"])) is None
    partial = char_tokenizer(["<|fim_prefix|>", "<|fim_suffix|>"])
    with pytest.raises(FimUnsupported, match=r"Qwen2.5-Coder: <\|fim_middle\|>;"):
        build_fim_prompt(partial, "a", "b")


# llama.cpp /infill bodies --------------------------------------------------------------------
def test_infill_request_builds_prompt_and_stop_tokens():
    tok = char_tokenizer(["<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
                          "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"])
    fmt = FimFormat.detect(tok)
    req = parse_infill({"input_prefix": "ab", "input_suffix": "c", "prompt": "d"})
    assert req.prompt_token_ids(fmt, tok) == build_fim_prompt(tok, "ab", "c", prompt="d")
    kw = req.sampling_kwargs(fmt)
    assert kw["stop_token_ids"] == list(fmt.stop_token_ids) and kw["top_p"] == 0.95
