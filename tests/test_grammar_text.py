"""grammar_text.exclude_surrogates: no character class of a compiled constraint takes a UTF-16
surrogate (U+D800-U+DFFF), whatever the constraint's kind; everything else is unchanged."""
from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

from luceio.grammar_text import GrammarTextError, exclude_surrogates  # noqa: E402

SURROGATES = [b"\xed\xa0\x80", b"\xed\xb7\x80", b"\xed\xbf\xbf"]  # U+D800, U+DDC0, U+DFFF
NEIGHBOURS = ["\ud7ff", "\ue000", "a", "\u00e9", "\U0001f600", "\U0010ffff"]


@pytest.fixture(scope="module")
def compiler():
    info = xgr.TokenizerInfo(["a", "b"], xgr.VocabType.RAW, vocab_size=2)
    return xgr.GrammarCompiler(info)


def _takes(compiler, ebnf: str, text: bytes) -> bool:
    return xgr.GrammarMatcher(compiler.compile_grammar(ebnf)).accept_string(text)


@pytest.mark.parametrize("regex", [".", "[^x]", r"\S", r"\W", r"\D", r"[\u0000-\U0010FFFF]",
                                   r"[\ud000-\ue000]", r"[a\ud800-\udfffb]", r"[^\]\-^]"])
def test_regex_classes_take_no_surrogate_and_keep_the_rest(compiler, regex):
    ebnf = str(xgr.Grammar.from_regex(regex))
    fixed = exclude_surrogates(ebnf)
    before = [_takes(compiler, ebnf, s) for s in SURROGATES]
    assert any(before)  # xgrammar's own class takes them (the bug this guards against)
    assert not any(_takes(compiler, fixed, s) for s in SURROGATES)
    for ch in NEIGHBOURS + ["]", "-", "^", "\\", "x", "\n", "\0"]:
        assert _takes(compiler, fixed, ch.encode()) == _takes(compiler, ebnf, ch.encode()), ch


def test_string_literals_and_classes_without_surrogates_are_unchanged():
    ebnf = str(xgr.Grammar.from_ebnf(
        'root ::= "[^a]\\"[" [a-z]+ [\\t\\n-\\r] [\\u00e9-\\ud7ff] "x\\\\" [\\ue000-\\uffff]'))
    assert exclude_surrogates(ebnf) == ebnf


def test_idempotent_and_escapes_kept():
    ebnf = 'root ::= [^\\]\\-^a-cA\\xe9]+ [\\0-\\U0010ffff]'
    once = exclude_surrogates(ebnf)
    assert once == ('root ::= [^\\]\\-^a-cA\\xe9\\ud800-\\udfff]+ '
                    '[\\u0000-\\ud7ff\\ue000-\\U0010ffff]')
    assert exclude_surrogates(once) == once


def test_a_class_of_surrogates_only_and_unterminated_text_are_errors():
    with pytest.raises(GrammarTextError, match="only UTF-16 surrogates"):
        exclude_surrogates("root ::= [\\ud800-\\udbff]")
    for bad in ('root ::= "abc', "root ::= [abc", "root ::= [a\\"):
        with pytest.raises(GrammarTextError):
            exclude_surrogates(bad)


@pytest.mark.parametrize("json_string", [False, True])
@pytest.mark.parametrize("pattern", ["^.+$", r"^\S+$", r"^\W\D$", r"^[^x]+$", r"^[\u0000-\uffff]+$",
                                     r"^[a\d\s]+$", r'^[^\\"]+$'])
def test_regex_rules_take_no_surrogate_and_keep_the_rest(compiler, pattern, json_string):
    """A `Regex("...")` rule (how xgrammar keeps some of a schema's `pattern`s), in plain and
    JSON-string mode: its pattern is rewritten, the rest of what it takes is unchanged."""
    rule = str(xgr.Grammar.from_ebnf('root ::= "<" Regex(%s%s) ">"' % (
        json.dumps(pattern), ", json_string=true" if json_string else "")))
    assert "Regex(" in rule
    fixed = exclude_surrogates(rule)
    assert (fixed == rule) == (pattern == r"^[a\d\s]+$")  # that class takes no surrogate

    def takes(ebnf, text: bytes) -> bool:
        return _takes(compiler, ebnf, b"<" + text + b">")
    if pattern in ("^.+$", r"^\S+$", r"^[^x]+$", r"^[\u0000-\uffff]+$"):
        assert takes(rule, SURROGATES[0])  # xgrammar 0.2.9's own rule takes it
    assert not any(takes(fixed, s) for s in SURROGATES)
    for text in NEIGHBOURS + ["a5", " ", '"', "\\", "\n", "\x01", "x", "\u00e9\u00e9", "_ "]:
        assert takes(fixed, text.encode()) == takes(rule, text.encode()), text


def test_regex_rewrite_escapes():
    from luceio.grammar_text import exclude_surrogates_regex
    assert exclude_surrogates_regex(r"a\.b\\[\]x]") == r"a\.b\\[\]x]"
    assert exclude_surrogates_regex(r"[\\s]") == r"[\\s]"  # a backslash and an s
    assert exclude_surrogates_regex(r"[\S]") == r"[\S]"  # left as written (module docstring)
    assert exclude_surrogates_regex(".") == r"[^\ud800-\udfff]"
    assert exclude_surrogates_regex(r"[\ud000-\ue000\w]") == r"[\ud000-\ud7ff\ue000\w]"


def test_regex_rule_with_characters_past_the_bmp(compiler):
    """xgrammar writes U+1F600 in a Regex rule as `\\U0001f600`; the rewrite reads it as one
    character (also as a `\\ud83d\\ude00` pair) and writes it back the same way."""
    pattern = "^\u00e9\U0001f600[\U0001f600-\U0001f64f].$"
    rule = str(xgr.Grammar.from_ebnf("root ::= Regex(%s)" % json.dumps(pattern, ensure_ascii=False)))
    fixed = exclude_surrogates(rule)
    assert "\\U0001f600[\\U0001f600-\\U0001f64f]" in fixed
    head = "\u00e9\U0001f600\U0001f642".encode()
    for tail in ["z", "\ud7ff", "\U0010ffff"]:
        assert _takes(compiler, fixed, head + tail.encode())
    assert not _takes(compiler, fixed, "\u00e9\U0001f600\U0001f650z".encode())
    assert _takes(compiler, rule, head + SURROGATES[0])
    assert not _takes(compiler, fixed, head + SURROGATES[0])
    from luceio.grammar_text import exclude_surrogates_regex
    assert exclude_surrogates_regex(r"[\ud83d\ude00-\ud83d\ude4f]") == r"[\ud83d\ude00-\ud83d\ude4f]"
