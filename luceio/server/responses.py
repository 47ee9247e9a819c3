"""Engine outputs → OpenAI's JSON shapes: responses, stream chunks, logprobs and usage.

Chat text goes through the request's `text_parser` (reasoning, then tool calls) when it has one:
each output's text becomes deltas (`deltas.py`), and a chunk carries one delta: `content`,
`reasoning_content`, or one `tool_calls` entry (a call's index, id, type and name first, then its
arguments). A choice that made calls and stopped finishes with "tool_calls". The Anthropic and
Responses routes read the same deltas (`ResponseBuilder.absorb`).

Plain Python: no web framework here, so it is testable without a server."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..outputs import CompletionOutput, Logprob, RequestOutput
from .deltas import Delta, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallStart
from .fields import error_body
from .protocol import ParsedRequest
from .reasoning import ChatTextParser
from .tool_parsers import collect_deltas


def _f(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


class _TokenText:
    """Token id → (text, raw bytes). Byte-level BPE tokens map back to their exact bytes; other
    tokenizers give the UTF-8 of the decoded text."""

    _BYTE_DECODER: dict[str, int] | None = None

    def __init__(self, tokenizer):
        self.tok = tokenizer
        hf = getattr(tokenizer, "_hf", None)
        dec = getattr(hf, "decoder", None) if hf is not None else None
        self.byte_level = hf if dec is not None and type(dec).__name__ == "ByteLevel" else None
        self.cache: dict[int, list[int]] = {}

    @classmethod
    def _byte_decoder(cls) -> dict[str, int]:
        if cls._BYTE_DECODER is None:  # GPT-2's bytes_to_unicode, inverted
            bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
            cs, k = list(bs), 0
            for b in range(256):
                if b not in bs:
                    bs.append(b)
                    cs.append(256 + k)
                    k += 1
            cls._BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs)}
        return cls._BYTE_DECODER

    def bytes(self, token_id: int, text: str) -> list[int]:
        b = self.cache.get(token_id)
        if b is None:
            b = list(text.encode("utf-8"))
            if self.byte_level is not None:
                piece = self.byte_level.id_to_token(token_id)
                dec = self._byte_decoder()
                if piece is not None and all(c in dec for c in piece):
                    b = [dec[c] for c in piece]
            self.cache[token_id] = b
        return b


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # formatted entries (chat) / raw tuples
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    offset: int = 0  # text_offset of the next token (completions logprobs)
    parser: ChatTextParser | None = None
    deltas: list[Delta] = field(default_factory=list)  # the parsed text so far


class ResponseBuilder:
    """Accumulates DELTA RequestOutputs of one API request (one engine request per prompt) into
    stream chunks and, at the end, the non-streaming response and usage. As a wire format
    (`driver.Wire`): `start()`, `step()` per output, then `end()` or `fail()`; `response()`."""

    ping_event = None  # keep-alives are SSE comments
    stop_reason = None  # runs until the engine finishes

    def __init__(self, req: ParsedRequest, tokenizer):
        self.req = req
        self.text_of = _TokenText(tokenizer)
        self.choices: dict[int, _Choice] = {}
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}  # prompt tokens read from the prefix cache
        self.completion_tokens = 0
        for p, ids in enumerate(req.prompts):
            self.prompt_tokens[p] = len(ids["prompt_token_ids"])
            for i in range(req.n):
                c = self.choices[p * req.n + i] = _Choice()
                if req.text_parser is not None:
                    c.parser = req.text_parser()
                if req.echo:
                    c.text.append(req.prompt_texts[p])
                    c.offset = len(req.prompt_texts[p])

    # shared pieces -----------------------------------------------------------------------------
    def _head(self, obj: str) -> dict:
        return {"id": self.req.id, "object": obj, "created": self.req.created,
                "model": self.req.model}

    def usage(self) -> dict:
        p = sum(self.prompt_tokens.values())
        return {"prompt_tokens": p, "completion_tokens": self.completion_tokens,
                "total_tokens": p + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}

    def _logprobs(self, c: _Choice, out: CompletionOutput) -> dict | None:
        if self.req.num_logprobs is None or out.logprobs is None:
            return None
        n = self.req.num_logprobs
        entries = []
        for tid, d in zip(out.token_ids, out.logprobs):
            chosen = d.get(tid) or Logprob(float("nan"), None, "")
            tops = sorted(((t, lp) for t, lp in d.items() if lp.rank is not None and lp.rank <= n),
                          key=lambda x: x[1].rank)[:n]
            entries.append((tid, chosen, tops))
        if self.req.chat:
            content = [{"token": ch.decoded_token or "", "logprob": _f(ch.logprob),
                        "bytes": self.text_of.bytes(tid, ch.decoded_token or ""),
                        "top_logprobs": [{"token": lp.decoded_token or "",
                                          "logprob": _f(lp.logprob),
                                          "bytes": self.text_of.bytes(t, lp.decoded_token or "")}
                                         for t, lp in tops]}
                       for tid, ch, tops in entries]
            return {"content": content}
        res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, ch, tops in entries:
            tok = ch.decoded_token or ""
            res["tokens"].append(tok)
            res["token_logprobs"].append(_f(ch.logprob))
            res["top_logprobs"].append({lp.decoded_token or "": _f(lp.logprob) for _, lp in tops})
            res["text_offset"].append(c.offset)
            c.offset += len(tok)
        return res

    def _absorb(self, index: int, out: CompletionOutput) -> tuple[_Choice, dict | None,
                                                                   list[Delta]]:
        c = self.choices.setdefault(index, _Choice())
        c.text.append(out.text)
        c.token_ids.extend(out.token_ids)
        self.completion_tokens += len(out.token_ids)
        lp = self._logprobs(c, out)
        if lp is not None:
            c.logprobs.append(lp)
        deltas = self._parse(c, out)
        c.deltas.extend(deltas)
        if out.finish_reason is not None:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
            if c.finish_reason == "stop" and any(isinstance(d, ToolCallStart) for d in c.deltas):
                c.finish_reason = "tool_calls"
        return c, lp, deltas

    def _parse(self, c: _Choice, out: CompletionOutput) -> list[Delta]:
        if c.parser is None:
            return [TextDelta(out.text)] if out.text else []
        deltas = c.parser.feed(out.text)
        if out.finish_reason is not None:
            deltas += c.parser.finish()
        if not self.req.parallel_tool_calls:
            deltas = [d for d in deltas
                      if not isinstance(d, (ToolCallStart, ToolCallArgs)) or d.index == 0]
        return deltas

    def _seen(self, prompt_index: int, ro: RequestOutput) -> None:
        self.cached_tokens[prompt_index] = ro.num_cached_tokens

    def finish(self, index: int = 0) -> tuple[str | None, str | None]:
        """(finish reason, the stop string that ended choice `index`, if one did)."""
        c = self.choices[index]
        return c.finish_reason, c.stop_reason if isinstance(c.stop_reason, str) else None

    # streaming ---------------------------------------------------------------------------------
    def start(self) -> list[dict]:
        """Chat: the assistant role for each choice; completions with echo: the prompt."""
        out = []
        for index, c in sorted(self.choices.items()):
            if self.req.chat:
                choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}
            elif self.req.echo:
                choice = {"index": index, "text": "".join(c.text), "logprobs": None,
                          "finish_reason": None}
            else:
                continue
            out.append(self._chunk([choice]))
        return out

    def _chunk(self, choices: list[dict]) -> dict:
        d = self._head("chat.completion.chunk" if self.req.chat else "text_completion")
        d["choices"] = choices
        if self.req.include_usage:
            d["usage"] = None
        return d

    def step(self, prompt_index: int, ro: RequestOutput) -> list[dict]:
        self._seen(prompt_index, ro)
        out = []
        for o in ro.outputs:
            index = prompt_index * self.req.n + o.index
            c, lp, deltas = self._absorb(index, o)
            if self.req.chat:
                out += self._chat_chunks(index, c, o, lp, deltas)
                continue
            if not (o.text or o.finish_reason or (lp is not None and o.token_ids)):
                continue
            choice = {"index": index, "text": o.text, "logprobs": lp,
                      "finish_reason": o.finish_reason}
            if o.finish_reason is not None:
                choice["stop_reason"] = o.stop_reason
            out.append(self._chunk([choice]))
        return out

    def _chat_chunks(self, index: int, c: _Choice, o: CompletionOutput, lp: dict | None,
                     deltas: list[Delta]) -> list[dict]:
        """One chunk per delta; the output's logprobs ride on the first, its finish on the last
        (an empty delta carries them when the parser held all the text back)."""
        pieces = [_chat_delta(d) for d in deltas]
        if not pieces and (o.finish_reason or (lp is not None and o.token_ids)):
            pieces = [{}]
        out = []
        for k, delta in enumerate(pieces):
            last = k == len(pieces) - 1
            choice = {"index": index, "delta": delta, "logprobs": lp if k == 0 else None,
                      "finish_reason": c.finish_reason if last else None}
            if last and o.finish_reason is not None:
                choice["stop_reason"] = o.stop_reason
            out.append(self._chunk([choice]))
        return out

    def end(self) -> list[dict | str]:
        """After the last output: the usage chunk when asked for, then [DONE]."""
        if not self.req.include_usage:
            return ["[DONE]"]
        d = self._head("chat.completion.chunk" if self.req.chat else "text_completion")
        d["choices"] = []
        d["usage"] = self.usage()
        return [d, "[DONE]"]

    @staticmethod
    def fail(message: str) -> list[dict | str]:
        return [error_body(message, "server_error"), "[DONE]"]

    # non-streaming -----------------------------------------------------------------------------
    def absorb(self, prompt_index: int, ro: RequestOutput) -> list[Delta]:
        """Takes one output in; returns its deltas (one choice's when n is 1)."""
        return [d for _, deltas in self.absorb_each(prompt_index, ro) for d in deltas]

    def absorb_each(self, prompt_index: int, ro: RequestOutput) -> list[tuple[int, list[Delta]]]:
        """Takes one output in; returns (choice index, its deltas) for each choice in it."""
        self._seen(prompt_index, ro)
        out = []
        for o in ro.outputs:
            index = prompt_index * self.req.n + o.index
            out.append((index, self._absorb(index, o)[2]))
        return out

    def choice_tokens(self, index: int) -> int:
        """The tokens choice `index` has generated so far."""
        return len(self.choices[index].token_ids)

    def response(self) -> dict:
        choices = []
        for index, c in sorted(self.choices.items()):
            text = "".join(c.text)
            lp = _merge_logprobs(c.logprobs, self.req.chat) if self.req.num_logprobs is not None \
                else None
            if self.req.chat:
                choice = {"index": index, "message": self._message(c), "logprobs": lp,
                          "finish_reason": c.finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason}
            choice["stop_reason"] = c.stop_reason
            choices.append(choice)
        d = self._head("chat.completion" if self.req.chat else "text_completion")
        d["choices"] = choices
        d["usage"] = self.usage()
        return d


    def _message(self, c: _Choice) -> dict:
        reasoning, text, calls = collect_deltas(c.deltas)
        msg = {"role": "assistant", "content": text if text or not calls else None}
        if c.parser is not None and c.parser.reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": call.arguments}} for call in calls]
        return msg


def _chat_delta(d: Delta) -> dict:
    if isinstance(d, TextDelta):
        return {"content": d.text}
    if isinstance(d, ReasoningDelta):
        return {"reasoning_content": d.text}
    if isinstance(d, ToolCallStart):
        return {"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                "function": {"name": d.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": d.index, "function": {"arguments": d.fragment}}]}


def _merge_logprobs(parts: list[dict], chat: bool) -> dict:
    if chat:
        return {"content": [e for p in parts for e in p["content"]]}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for p in parts for x in p[k]] for k in keys}
