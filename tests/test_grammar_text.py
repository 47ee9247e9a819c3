"""grammar_text and structured.constraint_text: no constraint of any kind takes a UTF-16
surrogate (U+D800-U+DFFF), whatever else it takes is unchanged, and xgrammar's printed `\\xHH`
escapes no longer break non-ASCII strings. Each constraint is compiled as the engine compiles it
(`constraint_text`) on a raw-byte vocabulary and matched byte by byte."""
from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

from luceio.grammar_text import exclude_surrogates, exclude_surrogates_regex  # noqa: E402
from luceio.structured import GrammarSpec, constraint_text  # noqa: E402

SURROGATES = ["\ud800", "\uddc0", "\udfff"]
NEIGHBOURS = ["\ud7ff", "\ue000", "a", "\u00e9", "\U0001f600", "\U0010ffff", "]", "-", "^", "\\",
              "x", "\n", "\0", "5", " ", '"', "_"]
_COMPILER = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"], xgr.VocabType.RAW, vocab_size=1),
                                cache_enabled=False)


def _compiled(kind: str, text: str):
    return _COMPILER.compile_regex(text) if kind == "regex" else _COMPILER.compile_grammar(text)


def _takes(compiled, text: str) -> bool:
    return xgr.GrammarMatcher(compiled).accept_string(text.encode("utf-8", "surrogatepass"))


def _engine(spec: GrammarSpec):
    return _compiled(*constraint_text(spec))


def _raw(spec: GrammarSpec):
    """What xgrammar compiles from the spec as given (the behaviour to keep)."""
    if spec.kind == "json":
        return _COMPILER.compile_json_schema(spec.text, strict_mode=True)
    return _compiled(spec.kind, spec.text)


def _string(pattern: str) -> GrammarSpec:
    return GrammarSpec("json", json.dumps({"type": "object", "properties": {
        "p": {"type": "string", "pattern": pattern}}, "required": ["p"]}))


def _j(text: str) -> str:
    return '{"p": "' + text + '"}'


REGEXES = [".", "[^x]", r"\S", r"\W", r"\D", r"[\u0000-\uffff]", r"[\ud000-\ue000]",
           r"[a\ud800-\udfffb]", r"[^\]\-^]", r"[^_-]", r"[\s\S]", r"[a\S]", r"[.\s-/]",
           r"[ \w-.]", r"[\u{20}-\u{10FFFF}]", r"[\cA-\u00ff\u0100-\uffff]", "[À-ÿ0-9]", "[Üa-f]",
           "[ÙÚab]", r"[\^a]", r"[\\s]"]


@pytest.mark.parametrize("regex", REGEXES)
def test_regexes_take_no_surrogate_and_keep_the_rest(regex):
    spec = GrammarSpec("regex", regex)
    try:
        raw = _raw(spec)
    except RuntimeError:  # xgrammar's regex converter refuses it (e.g. `[.\\s-/]`): still so
        with pytest.raises(RuntimeError):
            _engine(spec)
        return
    fixed = _engine(spec)
    assert not any(_takes(fixed, s) for s in SURROGATES)
    if regex == r"[\^a]":  # xgrammar's converter reads it as `[^a]`; the rewrite keeps its meaning
        assert _takes(fixed, "^") and _takes(fixed, "a") and not _takes(fixed, "b")
        return
    for ch in NEIGHBOURS + ["\u00c0", "\u00ff", "\u0100", "\u00dc", "b", "\x01",
                            ",", "+", ".", "/", "{", "u", "\t"]:
        assert _takes(fixed, ch) == _takes(raw, ch), repr(ch)


@pytest.mark.parametrize("json_string", [False, True])
@pytest.mark.parametrize("pattern", ["^.+$", r"^\S+$", r"^\W\D$", r"^[^x]+$", r"^[\u0000-\uffff]+$",
                                     r"^[a\d\s]+$", r'^[^\\"]+$', r"^[^_-]+$", r"^[\s\S]*$",
                                     r"^\d{2}[.\s-/]\d{2}$", r"^[ \w-.]+$", r"^[_\w-.]+$"])
def test_regex_rules_take_no_surrogate_and_keep_the_rest(pattern, json_string):
    """A `Regex("...")` rule (how xgrammar keeps some of a schema's `pattern`s), plain and in
    JSON-string mode: its pattern is rewritten, the rest of what it takes is unchanged."""
    rule = 'root ::= "<" Regex(%s%s) ">"' % (json.dumps(pattern),
                                             ", json_string=true" if json_string else "")
    printed = str(xgr.Grammar.from_ebnf(rule))
    assert "Regex(" in printed
    raw = _COMPILER.compile_grammar(printed)
    for fixed_text in (exclude_surrogates(printed), exclude_surrogates(rule, source=True)):
        fixed = _COMPILER.compile_grammar(fixed_text)
        assert not any(_takes(fixed, "<" + s + ">") for s in SURROGATES)
        for text in NEIGHBOURS + ["a5", "\x01", "\u00e9\u00e9", "_ ", "12-34", "12/34", "a-b",
                                  "a,b", "a+b", "a b", "x\u00e9"]:
            assert _takes(fixed, "<" + text + ">") == _takes(raw, "<" + text + ">"), repr(text)


SCHEMAS = [({"enum": ["Stra\u00dfe", "\u00dcbersicht", "M\u00e4dchen", "\u00e9cole"]},
            ['"\u00dcbersicht"', '"\u00e9cole"', '"Stra\u00dfe"'], ['"\udcbersicht"', '"cole"']),
           ({"const": "caf\u00e9\t1"}, ['"caf\u00e9\\t1"'], ['"caf\u00e9"']),
           ({"type": "object", "properties": {"a": {"type": "string"},
                                              "b": {"type": "string", "maxLength": 3}},
             "required": ["a", "b"]},
            ['{"a": "\ud7ff\u00e9\U0001f600", "b": "\ue000"}'],
            ['{"a": "\ud800", "b": "x"}', '{"a": "x", "b": "\udfff"}'])]


@pytest.mark.parametrize("schema,good,bad", SCHEMAS)
def test_json_schemas_with_non_ascii_strings_and_surrogates(schema, good, bad):
    """xgrammar prints U+00DC as `\\xdc`, which it reads back with the `be` that follows (U+DCBE):
    an enum of German or French words could never be generated. The printed `\\xHH` escapes are
    now `\\u00HH`."""
    compiled = _engine(GrammarSpec("json", json.dumps(schema, ensure_ascii=False)))
    for text in good:
        assert _takes(compiled, text), text
    for text in bad:
        assert not _takes(compiled, text), text


def test_choices_and_user_grammars():
    """A choice is EBNF luceio writes, a grammar the user's: both compile as written (no print
    round trip: xgrammar prints `[\\^a]` as `[^a]`), comments included, without surrogates."""
    choice = GrammarSpec.of(_params(choice=["Stra\u00dfe", "\u00dcbersicht", "\u00e9cole", "a\"b"]))
    compiled = _engine(choice)
    for text in ["Stra\u00dfe", "\u00dcbersicht", "\u00e9cole", 'a"b']:
        assert _takes(compiled, text), text
    assert not _takes(compiled, "\udcbersicht")
    grammar = _engine(GrammarSpec("grammar", 'root ::= [\\^a] [^b]+ # a comment with [ and "\n'))
    assert _takes(grammar, "^x") and _takes(grammar, "a\u00e9")
    assert not _takes(grammar, "bx") and not _takes(grammar, "ab")
    assert not any(_takes(grammar, "a" + s) for s in SURROGATES)


def _params(**kw):
    from luceio.sampling_params import StructuredOutputsParams
    return StructuredOutputsParams(**kw)


def test_rewrites_written_out():
    assert exclude_surrogates_regex(".") == r"[^\ud800-\udfff]"
    assert exclude_surrogates_regex(r"a\.b\\[\]x]") == r"a\.b\\[\]x]"  # no surrogate: as written
    assert exclude_surrogates_regex(r"[\\s]") == r"[\\s]"  # a backslash and an s
    assert exclude_surrogates_regex(r"[^_-]") == r"[^\ud800-\udfff_-]"  # the '-' stays a '-'
    assert exclude_surrogates_regex(r"[a\S]") == r"(?:[^\ud800-\udfff\s]|[\u0061])"
    assert exclude_surrogates_regex(r"[\ud000-\ue000\w]") == r"[\ud000-\ud7ff\ue000\w]"
    assert exclude_surrogates_regex(r"[\ud800-\udbff]") == "[^\\u0000-\U0010ffff]"  # takes nothing
    once = exclude_surrogates('root ::= [^\\]\\-^a-cA\\xe9]+ [\\0-\\U0010ffff] "\\xdcber"')
    assert once == ('root ::= [^\\ud800-\\udfff\\]\\-^a-cA\\u00e9]+ [\\u0000-\\ud7ff\\ue000-\\U0010ffff] '
                    '"\\u00dcber"')
    assert exclude_surrogates(once) == once
    for bad in ('root ::= "abc', "root ::= [abc", "root ::= [a\\"):
        with pytest.raises(ValueError):
            exclude_surrogates(bad)


def test_characters_past_the_bmp():
    """xgrammar writes U+1F600 in a Regex rule as `\\U0001f600`; it stays one character."""
    pattern = "^\u00e9\U0001f600[\U0001f600-\U0001f64f].$"
    rule = str(xgr.Grammar.from_ebnf("root ::= Regex(%s)" % json.dumps(pattern, ensure_ascii=False)))
    fixed = _COMPILER.compile_grammar(exclude_surrogates(rule))
    head = "\u00e9\U0001f600\U0001f642"
    for tail in ["z", "\ud7ff", "\U0010ffff"]:
        assert _takes(fixed, head + tail)
    assert not _takes(fixed, "\u00e9\U0001f600\U0001f650z")
    assert _takes(_COMPILER.compile_grammar(rule), head + SURROGATES[0])
    assert not _takes(fixed, head + SURROGATES[0])


@pytest.mark.parametrize("pattern,good,bad", [
    ("^\u00e9.$", ["\u00e9x", "\u00e9 "], ["\u00e9\"", "\u00e9\n", "\u00e9"]),
    ("^[A-Za-z\u00c0-\u00ff ]+$", ["\u00c0b c", "x\u00e9"], ["\"", "a\"b", "\U0001f600"]),
    ("^\U0001f600.$", ["\U0001f600x"], ["\U0001f600\"", "\U0001f600\\"]),
    ("^[^0-9]\\\u00e9$", ["x\u00e9"], ["\"\u00e9", "5\u00e9"])])
def test_patterns_with_non_ascii_characters_stay_json(pattern, good, bad):
    """xgrammar writes a `pattern` holding raw non-ASCII characters as plain EBNF, where `.` and
    negated classes took a raw quote or newline: `{"p": "é""}` was accepted. Escaped first
    (`grammar_text.ascii_patterns`), it stays a JSON-string regex rule."""
    compiled = _engine(_string(pattern))
    for text in good:
        assert _takes(compiled, _j(text)), text
    for text in bad:
        assert not _takes(compiled, _j(text)), text


def test_ascii_patterns_rewrites_regexes_only():
    from luceio.grammar_text import ascii_patterns, ascii_regex
    assert ascii_regex("^\u00e9\\\u00e9[\u00c0-\u00ff]\U0001f600\\.$") == \
        "^\\u00e9\\u00e9[\\u00c0-\\u00ff]\\u{1f600}\\.$"
    schema = {"type": "object", "properties": {
        "pattern": {"type": "string", "pattern": "\u00e9", "default": {"pattern": "\u00e9"}},
        "q": {"enum": [{"pattern": "\u00e9"}], "const": "\u00e9", "examples": ["\u00e9"]}},
        "patternProperties": {"^\u00e9": {"type": "string"}}, "$defs": {"d": {"pattern": "\u00fc"}}}
    got = ascii_patterns(schema)
    assert got["properties"]["pattern"]["pattern"] == "\\u00e9"
    assert got["properties"]["pattern"]["default"] == {"pattern": "\u00e9"}  # a value: as given
    assert got["properties"]["q"] == schema["properties"]["q"]
    assert list(got["patternProperties"]) == ["^\\u00e9"]
    assert got["$defs"]["d"]["pattern"] == "\\u00fc"
    assert list(got["properties"]) == ["pattern", "q"]


def test_tool_call_argument_patterns_stay_json():
    """Tool calls compile as a structural tag whose arguments are JSON schemas: their patterns
    are escaped the same way."""
    from luceio.structured import ToolCallFormat, tool_call_constraint
    fmt = ToolCallFormat(begin="<tool_call>", end="</tool_call>", separator="\n")
    fn = {"name": "f", "parameters": {"type": "object", "properties": {
        "p": {"type": "string", "pattern": "^\u00e9.$"}}, "required": ["p"]}}
    spec = GrammarSpec.of(tool_call_constraint([fn], fmt, parallel=False))
    compiled = _engine(spec)
    call = '<tool_call>{"name": "f", "arguments": {"p": "%s"}}</tool_call>'
    assert _takes(compiled, call % "\u00e9x")
    assert not _takes(compiled, call % "\u00e9\"")
