"""Reasoning split (luceio/server/reasoning.py) and the reasoning-then-tools combinator.

Hand-written generations, parsed whole, one character at a time and in random cuts: reasoning,
answer and calls must match the expectation every way.
"""
from __future__ import annotations

import pytest
from test_tool_parsers import CUT_SEEDS, check_order, cuts, named, streamed

from luceio.server.deltas import ReasoningDelta, TextDelta, ToolCallArgs, ToolCallStart
from luceio.server.reasoning import ChatTextParser, ThinkParser, get_reasoning_parser
from luceio.server.tool_parsers import HermesToolParser, collect_deltas

THINK = [
    # (generation, starts inside reasoning, reasoning, answer)
    ("<think>\nThe user wants 2+2.\n</think>\n\nThe answer is 4.", False,
     "The user wants 2+2.", "The answer is 4."),
    ("\n<think>a < b, so </thin is not a tag</think>\nok", False,
     "a < b, so </thin is not a tag", "ok"),
    ("<think>\n\nfirst\n\nsecond\n\n</think>\n\n\nanswer\n\n", False,
     "first\n\nsecond", "answer\n\n"),
    # the template put `<think>` into the prompt
    ("The user wants 2+2.\n</think>\n\nThe answer is 4.", True, "The user wants 2+2.",
     "The answer is 4."),
    ("\nstill thinking when max_tokens ran out", True,
     "still thinking when max_tokens ran out", ""),
    ("<think>\nunfinished <thi", False, "unfinished <thi", ""),
    # no reasoning: all answer, and tags are only read at the start
    ("Hello <think>not reasoning</think> there", False, None,
     "Hello <think>not reasoning</think> there"),
    ("  plain answer", False, None, "  plain answer"),
    ("<think>\n\n</think>\n\nno thoughts", False, None, "no thoughts"),
    ("<thinking>", False, None, "<thinking>"),
    ("思考\n</think>\n\n答案 🦊 </think> kept", True, "思考", "答案 🦊 </think> kept"),
]


@pytest.mark.parametrize("text, in_reasoning, reasoning, answer", THINK)
def test_think_split_whole_and_streamed(text, in_reasoning, reasoning, answer):
    assert ThinkParser(in_reasoning).parse(text) == (reasoning, answer)
    for seed in [None, *CUT_SEEDS]:
        deltas = streamed(ThinkParser(in_reasoning), cuts(text, seed))
        assert all(d.text for d in deltas)
        assert not any("<think>" in d.text or "</think>" in d.text
                       for d in deltas if isinstance(d, ReasoningDelta))
        got_reasoning, got_answer, _ = collect_deltas(deltas)
        assert (got_reasoning, got_answer) == (reasoning, answer), seed


def test_only_partial_tags_and_newlines_are_held_back():
    parser = ThinkParser()
    assert parser.feed(" <thi") == []
    assert parser.feed("nk>\n") == []
    assert parser.feed("step 1\n") == [ReasoningDelta("step 1")]
    assert parser.feed("step 2 </") == [ReasoningDelta("\nstep 2 ")]
    assert parser.feed("b>") == [ReasoningDelta("</b>")]
    assert parser.feed("</think>\n\n") == []
    assert parser.feed("Answer") == [TextDelta("Answer")]
    assert parser.finish() == []
    parser = ThinkParser()
    assert parser.feed("<b>") == [TextDelta("<b>")]


@pytest.mark.parametrize("prompt, opens", [
    ("<|im_start|>assistant\n<think>\n", True),  # DeepSeek-R1 style generation prompt
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3, enable_thinking=False
    ("<think>old</think>answer<|im_start|>assistant\n", False),
    ("<|im_start|>assistant\n", False),
    # a tag inside a message (a file a tool read) opens nothing; the generation prompt's end does
    ("<|im_start|>tool\nif tag == '<think>':<|im_end|>\n<|im_start|>assistant\n", False),
    ("<|im_start|>user\nwhat is </think>?<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
])
def test_opens_reasoning_reads_the_prompt(prompt, opens):
    assert ThinkParser.opens_reasoning(prompt) is opens


def test_registry():
    assert get_reasoning_parser("auto", "{% if x %}<think>\n{% endif %}") is ThinkParser
    assert get_reasoning_parser("auto", "{{ messages }}") is None
    assert get_reasoning_parser("auto", None) is None
    assert get_reasoning_parser("qwen3", None) is ThinkParser
    assert get_reasoning_parser("deepseek_r1", None) is ThinkParser
    assert get_reasoning_parser("none", "<think>") is None
    with pytest.raises(ValueError, match="auto.*qwen3.*deepseek_r1.*none"):
        get_reasoning_parser("granite", None)


CHAT = [
    # (generation, reasoning, answer, calls)
    ('<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Zürich"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
     '</tool_call>', "I need the weather.", "",
     [("get_weather", '{"city": "Zürich"}'), ("get_time", "{}")]),
    ('<think>\nsimple\n</think>\n\nIt is 4.', "simple", "It is 4.", []),
    ('Checking.\n<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call>', None,
     "Checking.", [("f", '{"a": [1]}')]),
    ('<think>\nbroken call next\n</think>\n\n<tool_call>{"name": "f"</tool_call>',
     "broken call next", '<tool_call>{"name": "f"</tool_call>', []),
]


@pytest.mark.parametrize("text, reasoning, answer, calls", CHAT)
def test_reasoning_then_tool_calls(text, reasoning, answer, calls):
    def make():
        return ChatTextParser(ThinkParser(), HermesToolParser())

    got_reasoning, got_answer, got_calls = make().parse(text)
    assert (got_reasoning, got_answer, named(got_calls)) == (reasoning, answer, calls)
    for seed in [None, *CUT_SEEDS]:
        deltas = streamed(make(), cuts(text, seed))
        check_order(deltas)
        if calls:
            assert not any("<tool_call>" in d.text for d in deltas
                           if isinstance(d, (TextDelta, ReasoningDelta)))
        got_reasoning, got_answer, got_calls = collect_deltas(deltas)
        assert (got_reasoning, got_answer, named(got_calls)) == (reasoning, answer, calls), seed


def test_reasoning_comes_before_the_calls_in_the_stream():
    text = '<think>\nplan\n</think>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    deltas = streamed(ChatTextParser(ThinkParser(), HermesToolParser()), [text])
    assert [type(d) for d in deltas] == [ReasoningDelta, ToolCallStart, ToolCallArgs]


def test_stages_left_out_pass_text_through():
    text = '<think>x</think><tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert ChatTextParser(None, None).parse(text) == (None, text, [])
    assert ChatTextParser(None, None).feed("") == []
    reasoning, answer, calls = ChatTextParser(ThinkParser(), None).parse(text)
    assert (reasoning, answer, calls) == ("x", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', [])
    reasoning, answer, calls = ChatTextParser(None, HermesToolParser()).parse(text)
    assert (reasoning, answer, named(calls)) == (None, "<think>x</think>", [("f", "{}")])


def test_output_a_grammar_forces_is_answer_text_even_after_an_open_think():
    """A forced tool call (or a JSON schema) starts at the first token, so where the prompt
    opened `<think>` the parser for constrained output starts outside the reasoning block."""
    import json
    from types import SimpleNamespace
    from luceio.server.chat import _text_parser
    ctx = SimpleNamespace(reasoning_parser=ThinkParser, tool_parser=HermesToolParser)
    prompt = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    fmt = HermesToolParser.call_format
    forced = fmt.begin + json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}) + fmt.end
    reasoning, content, calls = _text_parser(ctx, prompt, True, constrained=True)().parse(forced)
    assert reasoning is None and content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    reasoning, content, calls = _text_parser(ctx, prompt, True)().parse("hmm</think>Hi")
    assert (reasoning, content, calls) == ("hmm", "Hi", [])  # unconstrained: inside the block
