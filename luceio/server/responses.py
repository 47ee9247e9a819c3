"""Engine outputs → OpenAI's JSON shapes: responses, stream chunks, logprobs and usage.

Plain Python: no web framework here, so it is testable without a server."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..outputs import CompletionOutput, Logprob, RequestOutput
from .protocol import ParsedRequest


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


class ResponseBuilder:
    """Accumulates DELTA RequestOutputs of one API request (one engine request per prompt) into
    stream chunks and, at the end, the non-streaming response and usage."""

    def __init__(self, req: ParsedRequest, tokenizer):
        self.req = req
        self.text_of = _TokenText(tokenizer)
        self.choices: dict[int, _Choice] = {}
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens = 0
        for p, ids in enumerate(req.prompts):
            self.prompt_tokens[p] = len(ids["prompt_token_ids"])
            for i in range(req.n):
                c = self.choices[p * req.n + i] = _Choice()
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
                "total_tokens": p + self.completion_tokens}

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

    def _absorb(self, index: int, out: CompletionOutput) -> tuple[_Choice, dict | None]:
        c = self.choices.setdefault(index, _Choice())
        c.text.append(out.text)
        c.token_ids.extend(out.token_ids)
        self.completion_tokens += len(out.token_ids)
        lp = self._logprobs(c, out)
        if lp is not None:
            c.logprobs.append(lp)
        if out.finish_reason is not None:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        return c, lp

    # streaming ---------------------------------------------------------------------------------
    def first_chunks(self) -> list[dict]:
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

    def chunks(self, prompt_index: int, ro: RequestOutput) -> list[dict]:
        out = []
        for o in ro.outputs:
            index = prompt_index * self.req.n + o.index
            _, lp = self._absorb(index, o)
            if not (o.text or o.finish_reason or (lp is not None and o.token_ids)):
                continue
            if self.req.chat:
                choice = {"index": index, "delta": {"content": o.text} if o.text else {},
                          "logprobs": lp, "finish_reason": o.finish_reason}
            else:
                choice = {"index": index, "text": o.text, "logprobs": lp,
                          "finish_reason": o.finish_reason}
            if o.finish_reason is not None:
                choice["stop_reason"] = o.stop_reason
            out.append(self._chunk([choice]))
        return out

    def usage_chunk(self) -> dict:
        d = self._head("chat.completion.chunk" if self.req.chat else "text_completion")
        d["choices"] = []
        d["usage"] = self.usage()
        return d

    # non-streaming -----------------------------------------------------------------------------
    def absorb(self, prompt_index: int, ro: RequestOutput) -> None:
        for o in ro.outputs:
            self._absorb(prompt_index * self.req.n + o.index, o)

    def response(self) -> dict:
        choices = []
        for index, c in sorted(self.choices.items()):
            text = "".join(c.text)
            lp = _merge_logprobs(c.logprobs, self.req.chat) if self.req.num_logprobs is not None \
                else None
            if self.req.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": text},
                          "logprobs": lp, "finish_reason": c.finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason}
            choice["stop_reason"] = c.stop_reason
            choices.append(choice)
        d = self._head("chat.completion" if self.req.chat else "text_completion")
        d["choices"] = choices
        d["usage"] = self.usage()
        return d


def _merge_logprobs(parts: list[dict], chat: bool) -> dict:
    if chat:
        return {"content": [e for p in parts for e in p["content"]]}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for p in parts for x in p[k]] for k in keys}
