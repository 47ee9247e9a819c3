"""Encoding prompts that repeat: an agent's conversation grows by a few messages a turn, and a
16K-token prompt takes ~30-50 ms to encode on one core, on every turn. The pieces between the
tokenizer's added tokens (`<|im_start|>`, `<|im_end|>`, `<tool_call>`, FIM tokens, ...) are
encoded once and kept.

Rules:
- HF `tokenizers` cuts a text at its added tokens before it normalises, pre-tokenizes and runs
  the model, so encode(text) is the pieces' encodings with the added tokens' ids between them,
  when a piece's encoding does not depend on where it stands. That holds for byte-level
  tokenizers (GPT-2 style: Qwen, Llama 3, SmolLM) and not for SentencePiece-style ones whose
  Metaspace prepends a space to the first piece only, nor for added tokens that strip the
  whitespace beside them or match inside words. `SegmentEncoder.for_backend` returns None
  unless the tokenizer's description passes these checks and probe texts encode equal both
  ways.
- Pieces of at least `MIN_CHARS` characters are kept, least recently used first out, up to
  `max_chars` characters in all; shorter ones are encoded each time (cheap, and rarely reused
  as they are).
- Only encodings without the post-processor's special tokens (`add_special_tokens=False`, how
  chat prompts are encoded) go through it.
- Thread-safe: the server encodes prompts off its event loop, several at once.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict

MIN_CHARS = 256
_PROBES = ("a  b\n{0}{0} c\t\n  {0}x", "{0} leading", "trailing {0}", "é{0}́ 123 {0}\r\n")


class SegmentEncoder:
    def __init__(self, backend, added: dict[str, int], max_chars: int = 16_000_000):
        self._backend = backend
        self._added = added
        self._split = re.compile("(" + "|".join(
            re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self.max_chars = max_chars
        self._lock = threading.Lock()

    @classmethod
    def for_backend(cls, backend) -> "SegmentEncoder | None":
        """A cache for this HF tokenizer, or None where piecewise encoding would differ."""
        added = backend.get_added_tokens_decoder()
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized
                            for t in added.values()):
            return None
        parts = [c.__getstate__().decode() for c in (backend.pre_tokenizer, backend.normalizer)
                 if c is not None]
        if any(name in part for part in parts for name in ('"Metaspace"', '"Prepend"')):
            return None
        enc = cls(backend, {t.content: i for i, t in added.items()})
        for token in list(enc._added)[:8]:
            for probe in _PROBES:
                text = probe.format(token)
                if enc._encode(text, keep=False) != backend.encode(
                        text, add_special_tokens=False).ids:
                    return None
        return enc

    def encode(self, text: str) -> list[int]:
        """`backend.encode(text, add_special_tokens=False).ids`, from kept pieces where it can."""
        return self._encode(text, keep=True)

    def _encode(self, text: str, keep: bool) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # an added token
                ids.append(self._added[piece])
            elif piece:
                ids += self._piece(piece) if keep and len(piece) >= MIN_CHARS else \
                    self._backend.encode(piece, add_special_tokens=False).ids
        return ids

    def _piece(self, piece: str) -> list[int]:
        with self._lock:
            ids = self._pieces.get(piece)
            if ids is not None:
                self._pieces.move_to_end(piece)
                return ids
        ids = self._backend.encode(piece, add_special_tokens=False).ids
        with self._lock:
            if piece not in self._pieces:
                self._pieces[piece] = ids
                self._chars += len(piece)
            while self._chars > self.max_chars and self._pieces:
                old, _ = self._pieces.popitem(last=False)
                self._chars -= len(old)
        return ids
