"""Rewrites of xgrammar's EBNF text that every compiled constraint goes through.

`exclude_surrogates(ebnf)`: no character class of the grammar takes a UTF-16 surrogate
(U+D800-U+DFFF). xgrammar matches a class against the UTF-8 bytes of its code points, and its
classes take the surrogates: a negated class (`[^x]`, a regex's `\\S`, `\\W`, `\\D`), a regex's `.`
(`[\\0-\\U0010ffff]`) or any range across them. The 3-byte form of a surrogate (ED A0-BF xx) is
not UTF-8 at all, so a byte-level vocabulary can spell one byte by byte and the text decodes to
U+FFFD characters that the constraint never allowed. A negated class gets the surrogates added
to what it excludes; a positive class that overlaps them is written out again without them,
each range as `\\u` / `\\U` escapes. A `Regex("...")` rule (xgrammar keeps some of a JSON
schema's `pattern`s that way) has its pattern rewritten by `exclude_surrogates_regex`. Other
string literals and the rest of the text are kept as they are. The text must be xgrammar's
printed form (`str(xgrammar.Grammar)`), which has no comments and writes strings in double
quotes.

`exclude_surrogates_regex(pattern)`: the same for a regex in xgrammar's syntax: `.` becomes
`[^\\ud800-\\udfff]`, `\\S` / `\\W` / `\\D` the negated class of `\\s` / `\\w` / `\\d` without the
surrogates, and classes as above (xgrammar's regexes have no `\\U`: code points past U+FFFF are
written as themselves). Left as written: a positive class holding `\\S`, `\\W` or `\\D`.
"""
from __future__ import annotations

import re

SURROGATES = (0xD800, 0xDFFF)
_NO_SURROGATES = r"\ud800-\udfff"
_SINGLE_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "b": 0x08, "a": 0x07,
                   "e": 0x1B, "0": 0x00}
_SHORTHANDS = {"\\" + c for c in "sSwWdD"}  # a regex's class shorthands
_HEX_ESCAPE = re.compile(r"x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})")
_LOW_SURROGATE_ESCAPE = re.compile(r"\\u([dD][c-fC-F][0-9a-fA-F]{2})")


class GrammarTextError(ValueError):
    """The EBNF text ends inside a string literal or a character class."""


def _escape(text: str, i: int) -> tuple[int, int]:
    """The code point of the escape whose backslash is at text[i], and the index after it."""
    if i + 1 >= len(text):
        raise GrammarTextError("the grammar ends in a backslash")
    m = _HEX_ESCAPE.match(text, i + 1)
    if m:
        cp = int(next(g for g in m.groups() if g is not None), 16)
        low = _LOW_SURROGATE_ESCAPE.match(text, m.end())
        if 0xD800 <= cp <= 0xDBFF and low:  # a pair: how xgrammar prints a character past U+FFFF
            return 0x10000 + ((cp - 0xD800) << 10) + (int(low[1], 16) - 0xDC00), low.end()
        return cp, m.end()
    c = text[i + 1]
    return _SINGLE_ESCAPES.get(c, ord(c)), i + 2


def _class_ranges(body: str) -> list[tuple[int, int]]:
    """The code point ranges of a character class's body (between `[` or `[^` and `]`)."""
    points: list[tuple[int, bool]] = []  # (code point, written as a '-' that may join a range)
    i = 0
    while i < len(body):
        if body[i] == "\\":
            cp, i = _escape(body, i)
            points.append((cp, False))
        else:
            points.append((ord(body[i]), body[i] == "-"))
            i += 1
    ranges = []
    j = 0
    while j < len(points):
        lo = points[j][0]
        if j + 2 < len(points) and points[j + 1][1]:  # a - b
            ranges.append((lo, points[j + 2][0]))
            j += 3
        else:
            ranges.append((lo, lo))
            j += 1
    return ranges


def _point(cp: int, regex: bool = False) -> str:
    if cp <= 0xFFFF:
        return f"\\u{cp:04x}"
    return chr(cp) if regex else f"\\U{cp:08x}"


def _positive_class(body: str, shorthands: str = "", regex: bool = False) -> str:
    """`[body + shorthands]`, or the class without the surrogates where it takes any
    (`shorthands`: a regex's `\\s`, `\\w`, `\\d`, which take none)."""
    ranges = _class_ranges(body)
    lo_s, hi_s = SURROGATES
    if not any(lo <= hi_s and hi >= lo_s for lo, hi in ranges):
        return "[" + body + shorthands + "]"
    kept = []
    for lo, hi in ranges:
        if lo <= hi_s and hi >= lo_s:
            if lo < lo_s:
                kept.append((lo, lo_s - 1))
            if hi > hi_s:
                kept.append((hi_s + 1, hi))
        else:
            kept.append((lo, hi))
    if not kept and not shorthands:  # an empty class is not EBNF
        raise GrammarTextError("a character class holds only UTF-16 surrogates, which are not "
                               "UTF-8 characters")
    return "[" + "".join(_point(lo, regex) if lo == hi else
                         _point(lo, regex) + "-" + _point(hi, regex) for lo, hi in kept) \
        + shorthands + "]"


def _class_end(text: str, i: int) -> int:
    """Index of the `]` that closes the class whose body starts at text[i]."""
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == "]":
            return i
        else:
            i += 1
    raise GrammarTextError("the grammar ends inside a character class")


def _string_end(text: str, i: int) -> int:
    """Index after the `"` that closes the string literal opened at text[i - 1]."""
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    raise GrammarTextError("the grammar ends inside a string literal")


def _class(text: str, i: int, regex: bool) -> tuple[str, int]:
    """The class opened by the `[` at text[i], without the surrogates, and the index after it."""
    negated = text.startswith("[^", i)
    start = i + 2 if negated else i + 1
    end = _class_end(text, start)
    body = text[start:end]
    rest, shorthands = _split_shorthands(body) if regex else (body, "")
    if negated:
        if (SURROGATES[0], SURROGATES[1]) in _class_ranges(rest):
            return text[i:end + 1], end + 1
        return "[^" + body + _NO_SURROGATES + "]", end + 1
    if any(c in shorthands for c in "SWD"):  # a negated shorthand in a positive class
        return text[i:end + 1], end + 1
    return _positive_class(rest, shorthands, regex), end + 1


def _split_shorthands(body: str) -> tuple[str, str]:
    """A regex class's body without its `\\s`-style shorthands, and the shorthands."""
    rest, shorthands = [], []
    i = 0
    while i < len(body):
        unit = body[i:i + 2] if body[i] == "\\" else body[i]
        (shorthands if unit in _SHORTHANDS else rest).append(unit)
        i += len(unit)
    return "".join(rest), "".join(shorthands)


def exclude_surrogates_regex(pattern: str) -> str:
    """`pattern` (xgrammar's regex syntax) with no class or `.` taking a UTF-16 surrogate (see
    the module docstring)."""
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if pattern[i + 1:i + 2] in ("S", "W", "D"):
                out.append("[^\\" + pattern[i + 1].lower() + _NO_SURROGATES + "]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
        elif c == "[":
            text, i = _class(pattern, i, regex=True)
            out.append(text)
        elif c == ".":
            out.append("[^" + _NO_SURROGATES + "]")
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal."""
    out = []
    for ch in text:
        cp = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= cp < 0x7F:
            out.append(ch)
        else:
            out.append(f"\\x{cp:02x}" if cp < 0x80 else _point(cp))
    return '"' + "".join(out) + '"'


def _ebnf_unstring(literal: str) -> str:
    """The text of an EBNF string literal (its quotes included)."""
    out = []
    i = 1
    while i < len(literal) - 1:
        if literal[i] == "\\":
            cp, i = _escape(literal, i)
            out.append(chr(cp))
        else:
            out.append(literal[i])
            i += 1
    return "".join(out)


def exclude_surrogates(ebnf: str) -> str:
    """`ebnf` with no character class taking a UTF-16 surrogate (see the module docstring)."""
    out = []
    i = 0
    while i < len(ebnf):
        c = ebnf[i]
        if c == '"':
            j = _string_end(ebnf, i + 1)
            literal = ebnf[i:j]
            if ebnf.endswith("Regex(", 0, i):
                literal = _ebnf_string(exclude_surrogates_regex(_ebnf_unstring(literal)))
            out.append(literal)
            i = j
        elif c == "[":
            text, i = _class(ebnf, i, regex=False)
            out.append(text)
        else:
            out.append(c)
            i += 1
    return "".join(out)
