"""Tokenizers (HF `tokenizers` JSON or SentencePiece), incremental detokenization, and chat
templates rendered with jinja2 the way transformers renders them."""
from __future__ import annotations

import json
from datetime import datetime

from .segment_encoder import SegmentEncoder

_SEGMENTED = 4096  # characters from which an encoding goes piece by piece (`segment_encoder`)


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    def __init__(self, backend, tokenizer_config: dict, generation_config: dict,
                 model_config: dict):
        self.config = tokenizer_config
        self.chat_template = tokenizer_config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default
            self.chat_template = {t["name"]: t["template"] for t in self.chat_template}.get("default")
        if isinstance(backend, str):
            import sentencepiece
            self._sp = sentencepiece.SentencePieceProcessor(model_file=backend)
            self._hf = None
        else:
            self._hf, self._sp = backend, None
        # long prompts encoded piece by piece between added tokens, pieces kept (agent turns)
        self._segments = SegmentEncoder.for_backend(backend) if self._hf is not None else None
        self.special_tokens = {k: _token_str(tokenizer_config.get(k)) for k in
                               ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.add_bos = bool(tokenizer_config.get("add_bos_token", self._sp is not None))
        self.eos_token_ids = self._eos_ids(generation_config, model_config)
        self._special_ids = self._collect_special_ids()

    # ids of special tokens ---------------------------------------------------------------------
    def _eos_ids(self, gen: dict, cfg: dict) -> set[int]:
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        name = self.special_tokens.get("eos_token")
        if not ids and name is not None and self.token_to_id(name) is not None:
            ids.add(self.token_to_id(name))
        return ids

    def _collect_special_ids(self) -> set[int]:
        if self._hf is not None:
            return {i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}
        sp = self._sp
        return {i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}

    def token_to_id(self, token: str) -> int | None:
        if self._hf is not None:
            return self._hf.token_to_id(token)
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def vocab(self) -> dict[str, int]:
        """Token text → id, added tokens included."""
        if self._hf is not None:
            return self._hf.get_vocab(with_added_tokens=True)
        return {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size() if self._hf is not None else self._sp.get_piece_size()

    @property
    def special_token_ids(self) -> set[int]:
        """Ids that `decode(..., skip_special_tokens=True)` leaves out of the text."""
        return set(self._special_ids)

    def backend_json(self) -> str | None:
        """The HF `tokenizers` description (tokenizer.json text); None for SentencePiece."""
        return self._hf.to_str() if self._hf is not None else None

    # encode / decode ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._segments is not None and not add_special_tokens and len(text) >= _SEGMENTED:
            return self._segments.encode(text)
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._sp.encode(text)
        if add_special_tokens and self.add_bos and self._sp.bos_id() >= 0:
            ids = [self._sp.bos_id()] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._sp.decode(ids)

    def id_to_token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    # chat --------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, **kwargs) -> str:
        """Renders OpenAI-shaped `messages` (assistant `tool_calls`, `tool` results) and `tools`
        (the OpenAI list, passed to the template as is) through the model's template; `kwargs`
        reach the template as extra variables (`enable_thinking=False` for Qwen3), none of them
        one of `TEMPLATE_VARIABLES`."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API")
        taken = sorted(set(kwargs) & set(TEMPLATE_VARIABLES))
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the renderer, not a template kwarg")
        template = _compile_template(self.chat_template)[0]
        special = {k: v for k, v in self.special_tokens.items() if v is not None}
        return template.render(messages=[_template_message(m) for m in messages], tools=tools,
                               add_generation_prompt=add_generation_prompt, **special, **kwargs)

    def chat_template_variables(self) -> frozenset[str]:
        """The variables the chat template reads (none without a template)."""
        return _compile_template(self.chat_template)[1] if self.chat_template else frozenset()


# what the renderer gives every template: its arguments, the special tokens, the globals
TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                      "unk_token", "pad_token", "raise_exception", "strftime_now")


class _JsonArguments(dict):
    """A call's arguments, which OpenAI sends as JSON text: templates that write them with
    `tojson` (Qwen2.5, Llama 3.1) or test `is mapping` need the object, templates that print
    them as they are (or test `is string` and then print) need the text. This is both: the
    object, printing as the client's text."""

    def __init__(self, text: str, value: dict):
        super().__init__(value)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _template_message(message: dict) -> dict:
    """`message` as chat templates expect it: tool-call arguments as `_JsonArguments`, and a
    null `content` (as OpenAI sends beside `tool_calls`) as an empty string."""
    if message.get("content", "") is None:
        message = {**message, "content": ""}
    if message.get("tool_calls"):
        message = {**message, "tool_calls": [_template_call(c) for c in message["tool_calls"]]}
    return message


def _template_call(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        value = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the client's text
    if not isinstance(value, dict):
        return call
    return {**call, "function": {**function, "arguments": _JsonArguments(function["arguments"], value)}}


class TemplateError(ValueError):
    pass


def _raise(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


_TEMPLATES: dict = {}


def _compile_template(source: str):
    """(template, the variables it reads). Same environment as transformers: sandboxed,
    trim/lstrip blocks, loop controls, `raise_exception`, `strftime_now` and a non-ASCII-escaping
    `tojson`."""
    if source not in _TEMPLATES:
        from jinja2 import meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        variables = frozenset(meta.find_undeclared_variables(env.parse(source)))
        _TEMPLATES[source] = env.from_string(source), variables
    return _TEMPLATES[source]


class IncrementalDetokenizer:
    """Text deltas for a growing token list. Decodes a short window of earlier tokens with the
    new ones so leading-space markers and multi-byte UTF-8 sequences come out right, and holds
    back text that ends in an incomplete character (U+FFFD).

    With an HF `tokenizers` backend the window is kept by `tokenizers.decoders.DecodeStream`,
    which runs the same algorithm in Rust (one call per token instead of two decodes from
    Python). Where it cannot start (the prompt's window ends inside a character) or refuses (a
    window whose text does not extend its prefix's), the Python path continues from the same
    window, which is tracked alongside, and hands back to a new stream at its next emission."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self._stream = _decode_stream(tokenizer, self.ids[self.prefix_offset:], skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the newly complete text. Token by token, so the text never
        depends on how many tokens arrive at once (speculation accepts several a step): taken
        together, a chunk ending inside a multi-byte character would hold back the complete
        text of the tokens before it too, and at the end of generation that text was lost."""
        return "".join([self._add_one(t) for t in token_ids])

    def _add_one(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self.tok._hf, token_id)
            except Exception:  # noqa: BLE001 - tokenizers raises its own error types
                self._stream = None  # the Python path recomputes this token from the window
            else:
                if delta is None:
                    return ""
                return self._emitted(delta)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        return self._python_emitted(full[len(prefix):])

    def _emitted(self, delta: str) -> str:
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return delta

    def _python_emitted(self, delta: str) -> str:
        delta = self._emitted(delta)
        self._stream = _decode_stream(self.tok, self.ids[self.prefix_offset:], self.skip)
        return delta


def _decode_stream(tokenizer: Tokenizer, window: list[int], skip: bool):
    """A `DecodeStream` starting from `window` (the text before the new tokens), or None where
    the Python path must run: a SentencePiece backend, a `tokenizers` without prefilled streams,
    or a window ending inside a character (the stream would emit the window's own text)."""
    if tokenizer._hf is None or _DecodeStream is None:
        return None
    if tokenizer.decode(window, skip).endswith("\ufffd"):
        return None
    try:
        return _DecodeStream(ids=window, skip_special_tokens=skip)
    except TypeError:  # a release without the `ids` prefill
        return None


try:
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # tokenizers < 0.21
    _DecodeStream = None
