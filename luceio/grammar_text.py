"""Rewrites of a constraint's text before xgrammar compiles it (`structured.GrammarCompiler`).

No character class may take a UTF-16 surrogate (U+D800-U+DFFF). xgrammar matches a class
against the UTF-8 bytes of its code points, and its classes take the surrogates: a negated class
(`[^x]`, a regex's `\\S`, `\\W`, `\\D`), a regex's `.` or any range across them. The 3-byte form of
a surrogate (ED A0-BF xx) is not UTF-8 at all, so a byte-level vocabulary can spell one byte by
byte and the text decodes to U+FFFD characters the constraint never allowed.

* `exclude_surrogates_regex(pattern)`, for a regex in xgrammar's syntax: `.` becomes
  `[^\\ud800-\\udfff]`, `\\S` / `\\W` / `\\D` the negated class of `\\s` / `\\w` / `\\d` and the
  surrogates; a negated class gets the surrogates added to what it excludes (first, so that a
  body ending in `-` keeps it a `-`); a positive class across them is written again without
  them, and one holding `\\S` / `\\W` / `\\D` becomes an alternation (`[a\\S]`:
  `(?:[^\\ud800-\\udfff\\s]|[a])`). Regexes have no `\\U`: code points past U+FFFF are written as
  themselves.
* `exclude_surrogates(ebnf, source=...)`, for xgrammar's EBNF: the same for its classes (which
  have no shorthands), and a `Regex("...")` rule's pattern through the regex rewrite. Other
  string literals are kept. `source=True`: text a user wrote (`#` comments skipped, escapes kept
  as written). `source=False`: xgrammar's printed form (`str(xgrammar.Grammar)`, which a JSON
  schema or structural tag must go through), where each `\\xHH` escape becomes `\\u00HH`:
  xgrammar prints the code points up to U+FF as `\\xHH` but reads `\\x` with every hex digit that
  follows, so the printed `"\\xdcbersicht"` of "Übersicht" would read as U+DCBE "rsicht".

A class is left exactly as written when it takes no surrogate; a class of surrogates only
becomes one that takes nothing. A `\\u` escape of four hex digits is one code point, as
xgrammar reads it (a surrogate pair's escapes are two). Surrogates a string literal asks for
are kept.
"""
from __future__ import annotations

import json
import re

SURROGATES = (0xD800, 0xDFFF)
_NO_SURROGATES = r"\ud800-\udfff"
_SINGLE_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "b": 0x08, "a": 0x07,
                   "e": 0x1B, "0": 0x00}
_HEX = re.compile(r"[0-9a-fA-F]+")
_BRACED = re.compile(r"\{([0-9a-fA-F]{1,6})\}")
_X_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|.)", re.S)
_REGEX_RULE = re.compile(r"Regex\(\s*$")


class GrammarTextError(ValueError):
    """The text ends inside a string literal, a character class or an escape."""


def _no_x_escapes(text: str) -> str:
    return _X_ESCAPE.sub(lambda m: "\\u00" + m[1] if m[1] else m[0], text)


def _escape(text: str, i: int, regex: bool = False) -> tuple[int, int]:
    """The code point of the escape whose backslash is at text[i], and the index after it: `\\x`
    takes two hex digits (as printed), `\\u` four, EBNF's `\\U` eight; a regex also has `\\u{...}`
    and `\\cX`."""
    if i + 1 >= len(text):
        raise GrammarTextError("the text ends in a backslash")
    c = text[i + 1]
    if regex and c == "u" and text.startswith("{", i + 2):
        m = _BRACED.match(text, i + 2)
        if m:
            return int(m[1], 16), m.end()
    if regex and c == "c" and text[i + 2:i + 3].isascii() and text[i + 2:i + 3].isalpha():
        return ord(text[i + 2]) & 0x1F, i + 3
    digits = {"x": 2, "u": 4, "U": 0 if regex else 8}.get(c, 0)
    m = _HEX.match(text, i + 2, i + 2 + digits) if digits else None
    if m and len(m[0]) == digits:
        return int(m[0], 16), m.end()
    return _SINGLE_ESCAPES.get(c, ord(c)), i + 2


def _class_units(body: str, regex: bool) -> tuple[list[tuple[int, int]], str]:
    """A class body as xgrammar reads it: its code point ranges, and a regex's shorthands
    (`\\d`-style escapes, which end no range: a `-` after one is itself)."""
    def unit(i):
        return _escape(body, i, regex) if body[i] == "\\" else (ord(body[i]), i + 1)
    ranges, shorthands = [], []
    i = 0
    while i < len(body):
        if regex and body[i] == "\\" and body[i + 1:i + 2] in ("d", "D", "w", "W", "s", "S"):
            shorthands.append(body[i + 1])
            i += 2
            continue
        lo, i = unit(i)
        if i + 1 < len(body) and body[i] == "-":
            hi, i = unit(i + 1)
            ranges.append((lo, hi))
        else:
            ranges.append((lo, lo))
    return ranges, "".join(shorthands)


def _point(cp: int, regex: bool) -> str:
    if cp <= 0xFFFF:
        return f"\\u{cp:04x}"
    return chr(cp) if regex else f"\\U{cp:08x}"


def _closing(text: str, i: int, close: str, what: str) -> int:
    """Index of the first unescaped `close` from text[i]: the end of a class or string literal."""
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == close:
            return i
        else:
            i += 1
    raise GrammarTextError(f"the text ends inside a {what}")


def _class(text: str, i: int, regex: bool, printed: bool) -> tuple[str, int]:
    """The class opened by the `[` at text[i], without the surrogates, and the index after it."""
    negated = text.startswith("[^", i)
    start = i + 2 if negated else i + 1
    end = _closing(text, start, "]", "character class")
    body = text[start:end]
    keep = _no_x_escapes if printed else (lambda t: t)
    ranges, shorthands = _class_units(body, regex)
    lo_s, hi_s = SURROGATES
    if any(lo > hi for lo, hi in ranges):  # xgrammar refuses it: left for it to say why
        return keep(text[i:end + 1]), end + 1
    if negated:
        if any(lo <= lo_s and hi >= hi_s for lo, hi in ranges):
            return keep(text[i:end + 1]), end + 1
        return "[^" + _NO_SURROGATES + keep(body) + "]", end + 1
    negs = [c.lower() for c in shorthands if c.isupper()]
    if not negs and not any(lo <= hi_s and hi >= lo_s for lo, hi in ranges):
        if regex and body.startswith("\\^") and len(body) > 2:  # xgrammar's converter makes
            # `[\\^a]` the negated `[^a]`: the '^' goes last (before a closing '-')
            rest = body[2:]
            dash = rest.endswith("-") and not rest.endswith("\\-")
            return "[" + (rest[:-1] if dash else rest) + "\\^" + ("-" if dash else "") + "]", end + 1
        return keep(text[i:end + 1]), end + 1
    kept = []
    for lo, hi in ranges:
        if lo <= hi_s and hi >= lo_s:
            if lo < lo_s:
                kept.append((lo, lo_s - 1))
            if hi > hi_s:
                kept.append((hi_s + 1, hi))
        else:
            kept.append((lo, hi))
    pos = "".join(_point(lo, regex) + ("" if lo == hi else "-" + _point(hi, regex))
                  for lo, hi in kept) + "".join("\\" + c for c in shorthands if c.islower())
    if negs:
        alts = ["[^" + _NO_SURROGATES + "\\" + c + "]" for c in negs] + (["[" + pos + "]"] if pos else [])
        return "(?:" + "|".join(alts) + ")", end + 1
    if not pos:  # surrogates only: a class that takes nothing
        return "[^" + _point(0, regex) + "-" + _point(0x10FFFF, regex) + "]", end + 1
    return "[" + pos + "]", end + 1


def exclude_surrogates_regex(pattern: str) -> str:
    """`pattern` (xgrammar's regex syntax) with no class or `.` taking a surrogate."""
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if pattern[i + 1:i + 2] in ("S", "W", "D"):
                out.append("[^" + _NO_SURROGATES + "\\" + pattern[i + 1].lower() + "]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
        elif c == "[":
            text, i = _class(pattern, i, regex=True, printed=False)
            out.append(text)
        elif c == ".":
            out.append("[^" + _NO_SURROGATES + "]")
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal (no `\\x` escapes: see the module docstring)."""
    return '"' + "".join("\\" + ch if ch in '"\\' else ch if 0x20 <= ord(ch) < 0x7F
                         else _point(ord(ch), regex=False) for ch in text) + '"'


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


def exclude_surrogates(ebnf: str, source: bool = False) -> str:
    """`ebnf` with no character class taking a surrogate (see the module docstring)."""
    out = []
    i = 0
    while i < len(ebnf):
        c = ebnf[i]
        if c == '"':
            j = _closing(ebnf, i + 1, '"', "string literal") + 1
            literal = ebnf[i:j]
            if _REGEX_RULE.search(ebnf, max(0, i - 64), i):
                literal = _ebnf_string(exclude_surrogates_regex(_ebnf_unstring(literal)))
            elif not source:
                literal = _no_x_escapes(literal)
            out.append(literal)
            i = j
        elif c == "[":
            text, i = _class(ebnf, i, regex=False, printed=not source)
            out.append(text)
        elif c == "#" and source:
            j = ebnf.find("\n", i)
            j = len(ebnf) if j < 0 else j
            out.append(ebnf[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def ascii_regex(pattern: str) -> str:
    """`pattern` with each character past U+007F written as an escape (`\\u` and four hex digits, `\\u{...}`
    past U+FFFF); an escaped one (`\\é`) becomes its escape. xgrammar inlines a JSON schema's
    `pattern` that holds raw non-ASCII characters as plain EBNF, where `.` and negated classes
    take a raw quote or control character and the output is not JSON; escaped, the pattern
    stays a `Regex(..., json_string=true)` rule, which keeps the string JSON."""
    out = []
    i = 0
    while i < len(pattern):
        escaped = pattern[i] == "\\" and i + 1 < len(pattern)
        ch = pattern[i + 1] if escaped else pattern[i]
        if ord(ch) > 0x7F:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\u{{{ord(ch):x}}}")
        else:
            out.append(pattern[i:i + 2] if escaped else ch)
        i += 2 if escaped else 1
    return "".join(out)


_NOT_SCHEMAS = ("const", "enum", "default", "examples")  # values, not schemas


def ascii_patterns(schema):
    """A JSON schema with every `pattern` and `patternProperties` regex through `ascii_regex`."""
    if isinstance(schema, list):
        return [ascii_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _NOT_SCHEMAS:
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            out[key] = ascii_regex(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ascii_regex(k): ascii_patterns(v) for k, v in value.items()}
        elif key == "properties" and isinstance(value, dict):
            out[key] = {k: ascii_patterns(v) for k, v in value.items()}
        else:
            out[key] = ascii_patterns(value)
    return out


def schema_patterns(schema) -> list[str]:
    """Every `pattern` and `patternProperties` regex of a JSON schema, in document order."""
    if isinstance(schema, list):
        return [p for s in schema for p in schema_patterns(s)]
    if not isinstance(schema, dict):
        return []
    found = []
    for key, value in schema.items():
        if key in _NOT_SCHEMAS:
            continue
        if key == "pattern" and isinstance(value, str):
            found.append(value)
        elif key == "patternProperties" and isinstance(value, dict):
            for k, v in value.items():
                found += [k, *schema_patterns(v)]
        elif key == "properties" and isinstance(value, dict):
            found += [p for v in value.values() for p in schema_patterns(v)]
        else:
            found += schema_patterns(value)
    return found


def refuse_unescapable_patterns(schema) -> None:
    """ValueError for a `pattern` that spells out a quote, a backslash or a control character
    outside a character class (`^a"`, `\\\\`, `\\u0022`, `\\t`): xgrammar writes such a pattern as
    plain EBNF rather than a JSON-string regex rule, where that character comes out raw (and
    `.` takes quotes and control characters), so the output would not be JSON. Seen by
    compiling the pattern alone: a pattern xgrammar keeps as `Regex(..., json_string=true)` is
    safe."""
    import xgrammar
    for p in dict.fromkeys(schema_patterns(schema)):
        alone = str(xgrammar.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": p})))
        if not _JSON_STRING_RULE.search(alone):
            raise ValueError(f"the JSON schema pattern {p!r} is not supported: a quote, "
                             "backslash or control character it spells out (outside a "
                             "character class) cannot be written as valid JSON")


_JSON_STRING_RULE = re.compile(r'^root_1 ::= Regex\(".*", json_string=true\)$', re.M)
