"""Fill-in-the-middle: the model's FIM format found in its vocabulary, FIM prompts built as token
ids, and llama.cpp `/infill` request bodies read. No web framework here, so all of it is testable
on its own.

Rules
- A format is the first family of `FAMILIES` whose prefix, suffix (and middle) tokens are all in
  the vocabulary. Each family keeps its documented order: prefix-suffix-middle
  `<pre>{prefix}<suf>{suffix}<mid>` for Qwen2.5-Coder, StarCoder/StarCoder2, CodeLlama and
  DeepSeek-Coder; Codestral's `[SUFFIX]{suffix}[PREFIX]{prefix}` with no middle token (the model
  continues the prefix).
- A prompt is special-token ids joined with text pieces encoded one by one; the special tokens'
  text is never encoded. BOS comes first where the tokenizer adds one. CodeLlama and Codestral
  encode the suffix without SentencePiece's dummy-prefix space, as their reference encoders do.
- llama.cpp's `/infill` conventions: `prompt` (the part of the current line already typed) is
  encoded right after the prefix. `input_extra` file chunks come before the current file: with
  the repository tokens as `<repo_name>{repo}\\n`, then `<file_sep>{filename}\\n{text}` per
  chunk, then `<file_sep>filename\\n` for the current file (`myproject` and `filename` are
  llama.cpp's placeholders); without them each chunk follows llama.cpp's snippet separator.
  Unlike llama.cpp, a request with no chunks and no repository name gets the plain FIM prompt,
  not an empty repository header, and BOS leads the prompt rather than following the chunks.
- Nothing is truncated: a prompt longer than the context is refused like any other prompt.
- `parse_infill` honours the fields listed in `HONOURED`; any other field is refused with a 400
  naming it (`protocol.APIError`, the error every request parser here raises).
"""
from __future__ import annotations

from dataclasses import dataclass

from .protocol import _boolean, _integer, _number, _seed, _show, _stop, bad

_REPO_PLACEHOLDER = "myproject"
_FILE_PLACEHOLDER = "filename"
_SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
_MARKER = "☺"  # what Meta's and mistral_common's FIM encoders put before a suffix, then cut off


@dataclass(frozen=True)
class FimFamily:
    name: str
    prefix: str
    suffix: str
    middle: str | None  # None: generation continues the prefix
    repo: str | None = None
    file_sep: str | None = None
    stops: tuple[str, ...] = ()  # tokens that end an infill besides EOS
    suffix_first: bool = False
    bare_suffix: bool = False  # encode the suffix without SentencePiece's dummy-prefix space

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(t for t in (self.prefix, self.suffix, self.middle) if t is not None)


FAMILIES = (
    FimFamily("Qwen2.5-Coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
              "<|repo_name|>", "<|file_sep|>",
              ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")),
    FimFamily("StarCoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>",
              "<file_sep>", ("<|endoftext|>", "<fim_pad>", "<repo_name>", "<file_sep>")),
    FimFamily("CodeLlama", "▁<PRE>", "▁<SUF>", "▁<MID>", stops=("▁<EOT>",), bare_suffix=True),
    FimFamily("CodeLlama", "<PRE>", "<SUF>", "<MID>", stops=("<EOT>",), bare_suffix=True),
    FimFamily("DeepSeek-Coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>",
              stops=("<｜end▁of▁sentence｜>", "<|EOT|>")),
    FimFamily("Codestral", "[PREFIX]", "[SUFFIX]", None, suffix_first=True, bare_suffix=True),
)


class FimUnsupported(ValueError):
    """The model's vocabulary has no fill-in-the-middle tokens."""


@dataclass(frozen=True)
class FimFormat:
    family: FimFamily
    prefix_id: int
    suffix_id: int
    middle_id: int | None
    repo_id: int | None
    file_sep_id: int | None
    stop_token_ids: tuple[int, ...]  # add these to the request's stop_token_ids

    @classmethod
    def detect(cls, tokenizer) -> FimFormat | None:
        for family in FAMILIES:
            ids = [tokenizer.token_to_id(t) for t in family.required]
            if None in ids:
                continue
            present = [i for i in map(tokenizer.token_to_id, family.stops) if i is not None]
            return cls(family, ids[0], ids[1], ids[2] if family.middle is not None else None,
                       _optional_id(tokenizer, family.repo),
                       _optional_id(tokenizer, family.file_sep), tuple(present))
        return None

    @property
    def name(self) -> str:
        return self.family.name

    def build(self, tokenizer, prefix: str, suffix: str, extra=(), repo_name: str | None = None,
              prompt: str = "") -> list[int]:
        """The FIM prompt's token ids (see the module's rules)."""
        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        head = _bos(tokenizer) + self._context(encode, list(extra), repo_name)
        pre = [self.prefix_id] + encode(prefix) + encode(prompt)
        suf = [self.suffix_id] + (_encode_bare(tokenizer, suffix) if self.family.bare_suffix
                                  else encode(suffix))
        body = suf + pre if self.family.suffix_first else pre + suf
        return head + body + ([self.middle_id] if self.middle_id is not None else [])

    def _context(self, encode, extra: list[dict], repo_name: str | None) -> list[int]:
        """The other files' chunks and the current file's header, before the FIM prefix."""
        if not extra and repo_name is None:
            return []
        if repo_name is not None and self.repo_id is None:
            raise ValueError(f"repo_name needs a repository token, which the {self.name} FIM "
                             f"format does not have")
        ids = []
        if self.repo_id is not None:
            name = repo_name if repo_name is not None else _REPO_PLACEHOLDER
            ids += [self.repo_id] + encode(name + "\n")
        for chunk in extra:
            if self.file_sep_id is not None:
                ids += [self.file_sep_id] + encode(chunk["filename"] + "\n")
            else:
                ids += encode(_SNIPPET_SEPARATOR)
            ids += encode(chunk["text"])
        if self.file_sep_id is not None:
            ids += [self.file_sep_id] + encode(_FILE_PLACEHOLDER + "\n")
        return ids


def build_fim_prompt(tokenizer, prefix: str, suffix: str, extra=(), repo_name: str | None = None,
                     prompt: str = "") -> list[int]:
    """`FimFormat.build` with the format found in `tokenizer`'s vocabulary; raises FimUnsupported
    when there is none. `extra`: [{"filename": str, "text": str}, ...]."""
    fmt = FimFormat.detect(tokenizer)
    if fmt is None:
        raise FimUnsupported(missing_fim_tokens(tokenizer))
    return fmt.build(tokenizer, prefix, suffix, extra, repo_name, prompt)


def missing_fim_tokens(tokenizer) -> str:
    """Which tokens of each known FIM family the vocabulary lacks, as an error message."""
    lacks = []
    for family in FAMILIES:
        missing = [t for t in family.required if tokenizer.token_to_id(t) is None]
        if missing:
            lacks.append(f"{family.name}: {' '.join(missing)}")
    return ("this model cannot fill in the middle: its vocabulary lacks the FIM tokens of every "
            "format luceio knows (" + "; ".join(lacks) + ")")


def _optional_id(tokenizer, token: str | None) -> int | None:
    return tokenizer.token_to_id(token) if token is not None else None


def _bos(tokenizer) -> list[int]:
    bos = tokenizer.special_tokens.get("bos_token")
    bos_id = tokenizer.token_to_id(bos) if tokenizer.add_bos and bos is not None else None
    return [bos_id] if bos_id is not None else []


def _encode_bare(tokenizer, text: str) -> list[int]:
    """`text`'s ids without the dummy-prefix space SentencePiece puts before a text: a marker is
    encoded before it and its ids cut off. Where the marker's ids merge into the text's (no
    dummy prefix to remove), the text is encoded as it is."""
    marker = tokenizer.encode(_MARKER, add_special_tokens=False)
    ids = tokenizer.encode(_MARKER + text, add_special_tokens=False)
    if ids[:len(marker)] == marker:
        return ids[len(marker):]
    return tokenizer.encode(text, add_special_tokens=False)


# llama.cpp's POST /infill ------------------------------------------------------------------------
# llama.cpp's /completion defaults, which its /infill shares
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
_CHUNK_FILENAME = "tmp"  # llama.cpp's name for a chunk that gives none

HONOURED = {
    "input_prefix": "text before the gap (default empty)",
    "input_suffix": "text after the gap (default empty)",
    "input_extra": "other files' chunks, [{filename (default 'tmp'), text}]; other chunk keys "
                   "(llama.vim's `time`) carry nothing for the prompt and are not read",
    "prompt": "the typed part of the current line, encoded after the prefix (text only)",
    "n_predict": "max_tokens; -1 (default) runs until a stop or the end of the context",
    "temperature": "default 0.8", "top_k": "default 40; <= 0 disables",
    "top_p": "default 0.95", "min_p": "default 0.05",
    "stop": "stop strings", "seed": "-1 (default) draws a random seed", "stream": "default false",
    "ignore_eos": "default false",
    "cache_prompt": "accepted: luceio always reuses cached prefixes",
    "id_slot": "accepted: luceio has no slots; its prefix cache serves every request",
    "model": "the served model's name",
}
"""What luceio honours of `/infill`. luceio samples in vLLM's order (temperature, then min_p,
top_k, top_p), not llama.cpp's default chain with temperature last: with temperature != 1,
min_p and top_p keep a different set of tokens than llama.cpp would."""

_REFUSED_WHY = {
    "n_indent": "stopping on the next line's indentation is not implemented",
    "t_max_predict_ms": "generation time limits are not implemented",
    "t_max_prompt_ms": "prompt time limits are not implemented",
    "samplers": "luceio's sampler chain is fixed (temperature, min_p, top_k, top_p)",
    "response_fields": "responses carry all their fields",
    "repeat_penalty": "llama.cpp's penalty covers only the last repeat_last_n tokens",
    "presence_penalty": "llama.cpp's penalty covers only the last repeat_last_n tokens",
    "frequency_penalty": "llama.cpp's penalty covers only the last repeat_last_n tokens",
    "grammar": "grammar-constrained decoding is not implemented",
    "json_schema": "grammar-constrained decoding is not implemented",
}


@dataclass(frozen=True)
class InfillRequest:
    input_prefix: str
    input_suffix: str
    input_extra: list[dict]  # [{"filename": str, "text": str}]
    prompt: str
    max_tokens: int | None  # n_predict; None: until a stop or the end of the context
    stream: bool
    model: str | None
    sampling: dict  # SamplingParams keyword arguments, max_tokens and stop_token_ids aside

    def prompt_token_ids(self, fmt: FimFormat, tokenizer) -> list[int]:
        return fmt.build(tokenizer, self.input_prefix, self.input_suffix, self.input_extra,
                         prompt=self.prompt)

    def sampling_kwargs(self, fmt: FimFormat) -> dict:
        """SamplingParams keyword arguments (all but max_tokens), the format's stop tokens added."""
        return {**self.sampling, "stop_token_ids": list(fmt.stop_token_ids)}


def parse_infill(body: dict) -> InfillRequest:
    """A llama.cpp `/infill` body; raises `protocol.APIError` (400, `param` = the field) for a
    field it does not honour (see `HONOURED`) or a value of the wrong type."""
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    for name in body:
        if name not in HONOURED:
            why = _REFUSED_WHY.get(name, "luceio's /infill does not honour it")
            raise bad(name, f"'{name}' is not supported: {why}")
    n_predict = _integer(body, "n_predict", -1)
    if n_predict != -1 and n_predict < 1:
        raise bad("n_predict", f"'n_predict' must be -1 (no limit) or at least 1, got {n_predict}")
    _boolean(body, "cache_prompt", True)
    _integer(body, "id_slot", -1)
    sampling = dict(
        temperature=_number(body, "temperature", DEFAULTS["temperature"]),
        top_k=max(_integer(body, "top_k", DEFAULTS["top_k"]), 0),
        top_p=_number(body, "top_p", DEFAULTS["top_p"]),
        min_p=_number(body, "min_p", DEFAULTS["min_p"]),
        seed=None if body.get("seed") in (None, -1) else _seed(body),
        stop=_stop(body),
        ignore_eos=_boolean(body, "ignore_eos", False),
    )
    return InfillRequest(_text(body, "input_prefix"), _text(body, "input_suffix"),
                         _chunks(body.get("input_extra")), _text(body, "prompt"),
                         None if n_predict == -1 else n_predict, _boolean(body, "stream", False),
                         _optional_text(body, "model"), sampling)


def _text(body: dict, name: str) -> str:
    return _optional_text(body, name) or ""


def _optional_text(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad(name, f"'{name}' must be a string, got {_show(v)}")
    return v


def _chunks(extra) -> list[dict]:
    if extra is None:
        return []
    if not isinstance(extra, list):
        raise bad("input_extra", f"'input_extra' must be a list of {{filename, text}} objects, "
                  f"got {_show(extra)}")
    chunks = []
    for i, chunk in enumerate(extra):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise bad(where, f"'{where}' must be an object with a string 'text'")
        filename = chunk.get("filename", _CHUNK_FILENAME)
        if not isinstance(filename, str):
            raise bad(where, f"'{where}.filename' must be a string, got {_show(filename)}")
        chunks.append({"filename": filename, "text": chunk["text"]})
    return chunks
