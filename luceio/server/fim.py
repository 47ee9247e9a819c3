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
- `fim_prompts` reads `/v1/completions`' `prompt` and `suffix`; `infill.py` reads llama.cpp's
  `/infill` bodies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .fields import bad, show

if TYPE_CHECKING:
    from .protocol import ModelContext

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


def fim_prompts(prompt, suffix, ctx: ModelContext) -> list[tuple[None, list[int]]]:
    """/v1/completions' text prompt(s) and `suffix` → the model's fill-in-the-middle prompt ids
    (the prompt's text is not kept: it is not the model's input)."""
    if not isinstance(suffix, str):
        raise bad("suffix", f"'suffix' must be a string, got {show(suffix)}")
    if ctx.fim is None:
        raise bad("suffix", missing_fim_tokens(ctx.tokenizer) if ctx.tokenizer is not None
                  else "this model has no tokenizer, so it cannot fill in the middle")
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not (isinstance(texts, list) and texts and all(isinstance(p, str) for p in texts)):
        raise bad("prompt", "with 'suffix', 'prompt' must be text (a string or a list of "
                  "strings): the fill-in-the-middle prompt is built from the text")
    return [(None, ctx.fim.build(ctx.tokenizer, p, suffix)) for p in texts]
