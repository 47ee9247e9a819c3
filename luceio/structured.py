"""Grammar-constrained decoding (structured outputs): a request's constraint becomes a grammar,
each of its sequences a matcher, and every step a bitmask of the tokens the grammar allows next.

Library: xgrammar, chosen over llguidance by the measured per-token cost on the real
Qwen2.5-Coder-0.5B vocabulary (151,936 ids; `bench/grammar_overhead.py`, results in
`bench/results/cpu/grammar_overhead.json`). Filling the next-token bitmask and accepting the
token took 11.9 us per token on average (p99 49 us) with xgrammar against 69.3 us (p99 901 us)
with llguidance over five JSON schemas (12-13 us against 33-69 us in the quieter three of four
runs on a shared CPU): xgrammar precomputes most of each mask when it compiles the grammar,
llguidance works it out per token. xgrammar pays up front instead: 2-31 ms to compile a schema
(llguidance: 1-27 ms), about 2 s to import (it imports transformers) and about 1 s to describe
the vocabulary, once per engine, on the first constrained request; compiled grammars are cached
here, so an agent's repeated tool set or schema compiles once. Random walks through 33 schemas
found one xgrammar bug that llguidance does not have (string length bounds, worked around
below). In the engine the masks cost nothing measurable: greedy decode of Qwen2.5-Coder-0.5B on
the CPU ran at 1.01x (batch 1) and 0.99x (batch 8) the unconstrained tok/s.

Rules:
- A constraint (`StructuredOutputsParams`: a JSON schema, any JSON object, a regex, a choice of
  strings, an EBNF grammar, or an xgrammar structural tag) is named by a `GrammarSpec`; each spec
  compiles once (LRU cache). One that does not compile raises `GrammarError` (a ValueError)
  saying why.
- Strings bounded by `minLength`/`maxLength`: xgrammar 0.2.9 compiles the lengths to a
  repetition of a character class that lets raw control characters through, which is not JSON
  (github.com/mlc-ai/xgrammar/issues/800, open). JSON schemas and structural tags are therefore
  converted to xgrammar's EBNF and that class is replaced by JSON's (`fix_length_bounded_strings`)
  before compiling. (Compiling them as the equivalent `pattern` instead, as before, was correct
  but made the mask of a long-bounded string slow: ~25 ms a token for `maxLength` 160 on
  Qwen2.5-Coder's vocabulary, against ~0.03 ms this way.) Such strings are written without
  escape sequences.
- No constraint of any kind takes a surrogate: a regex, a user's EBNF (a choice is one) and
  the printed EBNF of schemas and structural tags go through `grammar_text` first (a regex's
  `.` and `\\S`, negated classes, a schema's `pattern`). The printed EBNF also has its `\\xHH`
  escapes rewritten: xgrammar reads them greedily, so a schema's `enum` of "Übersicht" or
  "école" could never be generated before.
- A schema `pattern` that spells out a quote, backslash or control character outside a class
  is refused (`refuse_unescapable_patterns`): xgrammar inlines it as EBNF that writes the
  character raw, which is not JSON.
- JSON schemas are strict: properties the schema does not name are never generated, and
  properties come in the schema's order. Whitespace between JSON tokens comes in runs of at most
  `JSON_MAX_WHITESPACE` characters (none with `disable_any_whitespace`; at most
  `TOOL_CALL_MAX_WHITESPACE` in tool calls).
- The bitmask has one bit per id of the model's vocabulary (the logits' width, which may pass
  the tokenizer's): ids the tokenizer lacks and special tokens (which decoding drops from the
  text) are never allowed. The tokenizer's end-of-sequence tokens are allowed exactly where the
  grammar may end; once nothing else may follow, only they are. A grammar that has accepted
  one is terminated, and its request ends there.
- Each sequence (each of n samples) has its own `Matcher`. Speculative drafts are walked
  through the grammar to build one mask per verified row, then rolled back: a draft the grammar
  refuses gets probability zero, so the rejection sampler rejects it and replaces it with an
  allowed token; rows after it are never used.
- Tool calls (`tool_call_constraint`): one call (or several, when parallel calls are allowed)
  to one of the offered functions, written in the model family's format (`ToolCallFormat`), so
  the server's tool-call parser reads it back.
"""
from __future__ import annotations

import logging

import functools
import json
import re
from dataclasses import dataclass

import torch

from .sampling_params import StructuredOutputsParams
from .grammar_text import (ascii_patterns, exclude_surrogates, exclude_surrogates_regex,
                           refuse_unescapable_patterns)

logger = logging.getLogger("luceio")

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (an agent's tool sets, a service's schemas)
# consecutive whitespace characters allowed between JSON tokens: enough for pretty-printing seven
# levels deep, and a bound on the runs of blanks a weak model can fall into
JSON_MAX_WHITESPACE = 32
TOOL_CALL_MAX_WHITESPACE = 2  # tool calls are written on one line
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[12:00:00] /path/file.cc:94: "


class GrammarError(ValueError):
    """A constraint that does not compile (bad schema, regex or grammar)."""


# what to compile ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class GrammarSpec:
    """A constraint in canonical form, the cache key of its compiled grammar. `kind`: "json"
    (a JSON schema's text), "regex", "grammar" (EBNF) or "structural_tag" (xgrammar's JSON)."""
    kind: str
    text: str
    any_whitespace: bool = True  # json: whitespace allowed between tokens

    @classmethod
    def of(cls, p: StructuredOutputsParams) -> GrammarSpec:
        """A choice becomes an EBNF alternation of its strings; json_object the schema of any
        object."""
        ws = not p.disable_any_whitespace
        if p.json is not None:
            return cls("json", p.json if isinstance(p.json, str) else json.dumps(p.json), ws)
        if p.json_object:
            return cls("json", '{"type": "object"}', ws)
        if p.regex is not None:
            return cls("regex", p.regex)
        if p.choice is not None:
            return cls("grammar", "root ::= " + " | ".join(
                json.dumps(c, ensure_ascii=False) for c in p.choice))
        if p.grammar is not None:
            return cls("grammar", p.grammar)
        return cls("structural_tag", p.structural_tag)


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model family writes tool calls: `begin`, then `{"name": ..., "<arguments_key>":
    {...}}`, then `end`; parallel calls joined by `separator`."""
    begin: str
    end: str
    separator: str
    arguments_key: str = "arguments"


def tool_call_constraint(functions: list[dict], fmt: ToolCallFormat,
                         parallel: bool) -> StructuredOutputsParams:
    """The output is one call (with `parallel`, one or more) to one of `functions` (OpenAI
    function definitions: name and parameters schema), each call's arguments valid for its
    function's parameters."""
    tags = [{"type": "tag", "begin": fmt.begin, "end": fmt.end, "content": {
        "type": "json_schema", "max_whitespace_cnt": TOOL_CALL_MAX_WHITESPACE, "json_schema": {
            "type": "object", "properties": {
                "name": {"const": f["name"]},
                fmt.arguments_key: f.get("parameters") or {"type": "object"}},
            "required": ["name", fmt.arguments_key], "additionalProperties": False}}}
        for f in functions]
    tag = {"type": "structural_tag", "format": {
        "type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
        "at_least_one": True, "stop_after_first": not parallel}}
    return StructuredOutputsParams(structural_tag=json.dumps(tag, ensure_ascii=False))


# compiling ---------------------------------------------------------------------------------------
def constraint_text(spec: GrammarSpec) -> tuple[str, str]:
    """("regex" or "grammar", the text xgrammar compiles) for a spec: see the module's rules
    (JSON schemas and structural tags as xgrammar's printed EBNF, mended; every kind through
    `grammar_text`, so no class takes a UTF-16 surrogate)."""
    import xgrammar
    if spec.kind == "regex":
        return "regex", exclude_surrogates_regex(spec.text)
    if spec.kind == "grammar":
        return "grammar", exclude_surrogates(spec.text, source=True)
    if spec.kind == "json":
        schema = ascii_patterns(json.loads(spec.text))  # loads: a clear error for non-JSON text
        refuse_unescapable_patterns(schema)
        grammar = xgrammar.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=spec.any_whitespace, strict_mode=True,
            max_whitespace_cnt=JSON_MAX_WHITESPACE if spec.any_whitespace else None)
    else:
        grammar = xgrammar.Grammar.from_structural_tag(json.dumps(_tag_patterns(json.loads(spec.text))))
    # as xgrammar prints it, no `\xHH` escapes (grammar_text says why)
    return "grammar", exclude_surrogates(fix_length_bounded_strings(str(grammar)))


def _tag_patterns(tag):
    """A structural tag with its JSON schemas' patterns through `grammar_text.ascii_patterns`
    (and `refuse_unescapable_patterns`)."""
    if isinstance(tag, list):
        return [_tag_patterns(t) for t in tag]
    if not isinstance(tag, dict):
        return tag
    out = {}
    for k, v in tag.items():
        if k == "json_schema":
            out[k] = ascii_patterns(v)
            refuse_unescapable_patterns(out[k])
        else:
            out[k] = _tag_patterns(v)
    return out


class GrammarCompiler:
    """Compiles specs against one tokenizer and model vocabulary; the last
    `GRAMMAR_CACHE_SIZE` compiled grammars are kept."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 1):
        import xgrammar
        self.xgr = xgrammar
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(_tokenizer_info(tokenizer, vocab_size),
                                                  max_threads=max_threads, cache_enabled=False)
        self.compile = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile)

    def _compile(self, spec: GrammarSpec):
        try:
            kind, text = constraint_text(spec)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            return self._compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            why = _XGRAMMAR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else "")
            raise GrammarError(f"the {spec.kind} constraint does not compile: "
                               f"{why or type(e).__name__}") from None

    def matcher(self, compiled) -> Matcher:
        return Matcher(self.xgr.GrammarMatcher(compiled))

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32


# xgrammar 0.2.9's rule for one character of a length-bounded JSON string, and JSON's class for
# it (no raw control characters, no quote, no backslash: no escapes are written)
_LENGTH_BOUNDED_CHARACTER = re.compile(r'^(\S+_characters ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$',
                                       re.M)
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'


def fix_length_bounded_strings(ebnf: str) -> str:
    """xgrammar's EBNF for a JSON schema or structural tag, with each length-bounded string's
    character class made JSON's (see the module's rules). UTF-16 surrogates leave every class
    after it, in `grammar_text.exclude_surrogates`."""
    return _LENGTH_BOUNDED_CHARACTER.sub(lambda m: m[1] + _JSON_STRING_CHARACTER + m[2], ebnf)


def _tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's description of the vocabulary. Special tokens and ids past the tokenizer get an
    empty string, which xgrammar never allows inside a grammar."""
    import xgrammar
    backend = tokenizer.backend_json()
    if backend is None:
        raise GrammarError("structured outputs need a Hugging Face `tokenizers` tokenizer; this "
                           "model has a SentencePiece one")
    # the detection xgrammar's own from_huggingface runs on the same text
    meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(backend)
    encoded = [""] * vocab_size
    special = tokenizer.special_token_ids
    for text, i in tokenizer.vocab().items():
        if i < vocab_size and i not in special:
            encoded[i] = text
    stop = sorted(i for i in tokenizer.eos_token_ids if i < vocab_size) or None
    return xgrammar.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                                  stop_token_ids=stop, add_prefix_space=meta["add_prefix_space"])


# matching ----------------------------------------------------------------------------------------
class Matcher:
    """One sequence's place in its grammar. `num_accepted`: the output tokens it has taken."""

    def __init__(self, matcher):
        self._m = matcher
        self.num_accepted = 0

    @property
    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def accept(self, token_ids: list[int]) -> int:
        """Takes tokens in order until the grammar refuses one or terminates; returns how many
        it took."""
        taken = 0
        for t in token_ids:
            if self._m.is_terminated() or not self._m.accept_token(t):
                break
            taken += 1
        self.num_accepted += taken
        return taken

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)
            self.num_accepted -= n

    def fill_rows(self, bitmask: torch.Tensor, row: int, draft_ids: list[int]) -> None:
        """Rows `row` .. `row + len(draft_ids)` of `bitmask` [num_rows, words]: the tokens
        allowed before each draft and after the last one. A draft the grammar refuses ends the
        walk, and the rows after it repeat its row. The matcher ends where it began."""
        self._m.fill_next_token_bitmask(bitmask, row)
        walked = 0
        for j, t in enumerate(draft_ids):
            if self._m.is_terminated() or not self._m.accept_token(t):
                bitmask[row + j + 1:row + len(draft_ids) + 1] = bitmask[row + j]
                break
            walked += 1
            self._m.fill_next_token_bitmask(bitmask, row + walked)
        if walked:
            self._m.rollback(walked)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets to -inf, in place, every token of `logits` [rows, vocab] whose bit in `bitmask`
    [rows, words] is 0 (int32 on the host; bit j of word w is token 32w + j; bits past the
    vocabulary are ignored). Rows that allow everything are skipped. xgrammar's kernel does it:
    C++ on the CPU, Triton on a GPU."""
    vocab = logits.shape[-1]
    if bitmask.shape[-1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[-1]} words does not cover {vocab} tokens")
    rows = (bitmask != -1).any(-1).nonzero().flatten().tolist()
    if rows:
        import xgrammar
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             vocab_size=vocab, indices=rows)


@dataclass
class GrammarBatch:
    """One step's constrained rows: (matcher, first logits row, drafts verified there)."""
    num_rows: int
    words: int
    items: list[tuple[Matcher, int, list[int]]]

    def fill(self) -> torch.Tensor:
        """[num_rows, words] int32 on the host; rows of unconstrained requests allow every id,
        and so do the rows of a grammar that terminated since the step was scheduled (with
        overlapped scheduling, at the step before, which was in flight then): such a request
        has finished and its token here is dropped."""
        bitmask = torch.full((self.num_rows, self.words), -1, dtype=torch.int32)
        for matcher, row, drafts in self.items:
            if not matcher.is_terminated:
                matcher.fill_rows(bitmask, row, drafts)
        return bitmask


class StructuredOutputs:
    """The engine's grammars: compiles constraints (the compiler is built on first use) and
    holds the matcher of each running constrained sequence, by request id. A step's
    `GrammarBatch` holds its own references to the matchers, so releasing one mid-step (an
    abort) is safe; its drafts walk leaves each matcher as it found it."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        self._matchers: dict[str, Matcher] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            if self._tokenizer is None:
                raise GrammarError("structured outputs need a tokenizer; this engine has none")
            self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size)
        return self._compiler

    def add(self, request_ids: list[str], params: StructuredOutputsParams) -> None:
        """Compiles the constraint (raises GrammarError) and starts a matcher per sequence."""
        compiled = self.compiler.compile(GrammarSpec.of(params))
        for rid in request_ids:
            self._matchers[rid] = self.compiler.matcher(compiled)

    def matcher(self, request_id: str) -> Matcher | None:
        return self._matchers.get(request_id)

    def advance(self, changed, finish) -> None:
        """Feeds each constrained request's new tokens to its matcher; ends the request through
        `finish(request_id, status)` when the grammar terminates (tokens after that, which only
        speculation could add, are dropped)."""
        if not self._matchers:
            return
        from .request import RequestStatus
        for req in changed:
            matcher = self.matcher(req.request_id)
            if matcher is None or req.is_finished:
                continue
            new = req.output_token_ids[matcher.num_accepted:]
            taken = matcher.accept(new)
            if matcher.is_terminated:
                req.drop_last_tokens(len(new) - taken)
                finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            elif taken < len(new):  # the mask made this impossible; end it rather than go on
                logger.error("request %s: token %d is outside its grammar; request aborted",
                             req.request_id, new[taken])
                finish(req.request_id, RequestStatus.FINISHED_ABORTED)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    @property
    def num_active(self) -> int:
        return len(self._matchers)

    def plan(self, scheduled, row_slices: dict[str, slice], num_rows: int) -> GrammarBatch | None:
        """The step's constrained rows, from the scheduled requests (`ScheduledRequest`s) that
        sample this step; None when there are none."""
        if not self._matchers:
            return None
        items = [(m, row_slices[s.req.request_id].start, list(s.spec_token_ids))
                 for s in scheduled if s.req.request_id in row_slices
                 and (m := self._matchers.get(s.req.request_id)) is not None]
        return GrammarBatch(num_rows, self.compiler.bitmask_words, items) if items else None
