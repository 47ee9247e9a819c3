"""Tokenizer wrapper, incremental detokenization and chat templates vs transformers."""
import pytest

from luceio.loader import load_checkpoint
from luceio.tokenizer import IncrementalDetokenizer, TemplateError, Tokenizer

TEXTS = ["Hello world! def f(x):\n    return x", "ünïcödé — 日本語も少し。 emoji 🦊🦊 ok",
         "  leading spaces and\ttabs\n\n", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def tok(tiny_llama):
    ck = load_checkpoint(tiny_llama)
    return Tokenizer(ck.tokenizer, ck.tokenizer_config, ck.generation_config, ck.config)


def test_encode_decode_match_transformers(tok, tiny_llama):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tiny_llama)
    for t in TEXTS:
        assert tok.encode(t) == hf.encode(t)
        ids = tok.encode(t)
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_one_token_at_a_time(tok, text):
    ids = tok.encode(text)
    prompt = tok.encode("prompt: ")
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    pieces = [detok.add([t]) for t in ids]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False)
    # a multi-byte character split over byte-level tokens never shows up half-decoded
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_detokenizer_does_not_depend_on_chunking(tok):
    """Tokens added several at a time (speculation) give the text of adding them one at a
    time, also where a chunk ends inside a multi-byte character: random byte-level ids, whose
    pieces split characters all the time."""
    import random
    rng = random.Random(1)
    vocab = tok._hf.get_vocab_size()
    for _ in range(300):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(3, vocab) for _ in range(8)]
        one = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
        want = "".join(one.add([t]) for t in ids)
        many = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
        got, i = "", 0
        while i < len(ids):
            n = rng.randrange(1, 6)
            got += many.add(ids[i:i + n])
            i += n
        assert got == want, (ids, prompt)


def _pieces(tok, prompt, ids, skip, stream: bool):
    """(pieces token by token, whether a stream decoded any); `stream=False`: Python only."""
    import luceio.tokenizer as module
    saved = module._DecodeStream
    if not stream:
        module._DecodeStream = None
    try:
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        pieces, streamed = [], False
        for t in ids:
            streamed |= detok._stream is not None
            pieces.append(detok.add([t]))
    finally:
        module._DecodeStream = saved
    return pieces, streamed


@pytest.mark.parametrize("skip", [False, True])
def test_decode_stream_path_equals_the_python_path(tok, skip):
    """The Rust `DecodeStream` window gives the Python window's pieces, token for token, on
    random byte-level ids (split characters, special tokens) and on real text."""
    import random
    rng = random.Random(2)
    vocab = tok._hf.get_vocab_size()
    used = 0
    cases = [(tok.encode("prompt: "), tok.encode(t)) for t in TEXTS]
    cases += [([rng.randrange(0, vocab) for _ in range(rng.randrange(1, 9))],
               [rng.randrange(0, vocab) for _ in range(rng.randrange(1, 40))]) for _ in range(300)]
    for prompt, ids in cases:
        fast, streamed = _pieces(tok, prompt, ids, skip, True)
        slow, _ = _pieces(tok, prompt, ids, skip, False)
        assert fast == slow, (prompt, ids)
        used += streamed
    assert used > len(cases) * 0.9  # the stream really ran


def test_decode_stream_refusal_continues_on_the_python_path(tok):
    """A stream that raises mid-generation hands the same window to the Python path, which
    hands back to a new stream once it emits."""
    ids = tok.encode(TEXTS[1] + TEXTS[0])
    prompt = tok.encode("prompt: ")
    want, _ = _pieces(tok, prompt, ids, False, False)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    assert detok._stream is not None
    real, calls = detok._stream, []

    class Refusing:
        def step(self, hf, token_id):
            calls.append(token_id)
            if len(calls) == 7:
                raise Exception("InvalidPrefix")
            return real.step(hf, token_id)
    detok._stream = Refusing()
    got = [detok.add([t]) for t in ids]
    assert len(calls) == 7 and detok._stream is not None and not isinstance(detok._stream, Refusing)
    assert got == want


def test_chat_template_matches_transformers(tok, tiny_llama):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tiny_llama)
    conv = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi ünï"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Write a loop."}]
    for gen in (True, False):
        assert tok.apply_chat_template(conv, add_generation_prompt=gen) == \
            hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)


def test_raise_exception_in_template(tok):
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(TemplateError, match="no system role"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_eos_from_tokenizer_config(tok):
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>")}


def _mixed_texts(rng, added: list[str], n: int) -> list[str]:
    """Long texts of code, prose and whitespace runs with added tokens anywhere, glued to words,
    doubled, at either end."""
    import argparse
    import inspect
    source = inspect.getsource(argparse)
    words = ["\n", "  ", "\t", " x", "é", "́", "日本", "🦊", "\r\n", "123", "'s"]
    out = []
    for _ in range(n):
        parts = []
        while sum(map(len, parts)) < 6000:
            start = rng.randrange(len(source) - 800)
            parts.append(source[start:start + rng.randrange(1, 800)])
            parts.append(rng.choice(added + words))
        out.append("".join(parts))
    return out


def test_segment_encoder_equals_whole_text_encoding(qwen_coder_tokenizer):
    """Long prompts encoded piece by piece between added tokens, pieces kept across calls,
    give the tokenizer's own encoding of the whole text, id for id (the real Qwen2.5-Coder
    tokenizer); the second encoding of a text reuses every long piece."""
    import random
    tok = qwen_coder_tokenizer
    seg = tok._segments
    assert seg is not None
    added = list(seg._added)
    rng = random.Random(7)
    for text in _mixed_texts(rng, added, 12):
        want = tok._hf.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_special_tokens=False) == want
        kept = len(seg._pieces)
        assert tok.encode(text, add_special_tokens=False) == want
        assert len(seg._pieces) == kept  # nothing new to encode the second time
    turn = tok.apply_chat_template([{"role": "system", "content": "x " * 4000},
                                    {"role": "user", "content": "hi"}])
    assert tok.encode(turn, add_special_tokens=False) == \
        tok._hf.encode(turn, add_special_tokens=False).ids


def test_segment_encoder_refuses_position_dependent_tokenizers():
    """A SentencePiece-style tokenizer (Metaspace prepends a space to the first piece only)
    encodes pieces differently from the whole text, and gets no segment encoder."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    from luceio.segment_encoder import SegmentEncoder
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    hf.train_from_iterator(["hello world, hello there"] * 20,
                           trainers.BpeTrainer(vocab_size=80, special_tokens=["<s>", "</s>"]))
    text = "hello <s> world </s>there"
    piecewise = SegmentEncoder(hf, {"<s>": hf.token_to_id("<s>"),
                                    "</s>": hf.token_to_id("</s>")})._encode(text, keep=False)
    assert piecewise != hf.encode(text, add_special_tokens=False).ids
    assert SegmentEncoder.for_backend(hf) is None


def test_segment_encoder_cache_is_bounded(qwen_coder_tokenizer):
    from luceio.segment_encoder import SegmentEncoder
    seg = SegmentEncoder.for_backend(qwen_coder_tokenizer._hf)
    seg.max_chars = 3000
    for i in range(10):
        seg.encode(f"<|im_start|>{i} " + "y" * 1000 + "<|im_end|>")
    assert seg._chars <= 3000 and len(seg._pieces) == 2
