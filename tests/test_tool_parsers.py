"""Tool-call parsing (luceio/server/tool_parsers.py) and tool-call chat templates.

Every case is hand-written: the text a model emits, the content and calls it must give. Each is
parsed whole, streamed one character at a time and streamed in random cuts; all must agree with
the expectation, and streamed text deltas must never carry markup. The real Qwen2.5-Coder
template renders tools, an assistant call and a tool result (`registry`: needs the real GGUF),
checked by hand and against transformers' renderer.
"""
from __future__ import annotations

import json
import random
import re

import pytest

from luceio.server.deltas import TextDelta, ToolCallArgs, ToolCallStart
from luceio.server.tool_parsers import (HermesToolParser, Llama3JsonToolParser,
                                        Qwen25CoderToolParser, collect_deltas, get_tool_parser)

MARKUP = ("<tool_call>", "</tool_call>", "```json", "<|python_tag|>")
CUT_SEEDS = range(12)


def cuts(text: str, seed: int | None) -> list[str]:
    """`text` in 1-character pieces (seed None) or random pieces of 1 to 9 characters."""
    if seed is None:
        return list(text)
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 9)
        pieces.append(text[i:i + n])
        i += n
    return pieces


def streamed(parser, pieces: list[str]) -> list:
    deltas = [d for piece in pieces for d in parser.feed(piece)]
    return deltas + parser.finish()


def check_order(deltas: list) -> None:
    """deltas.py's rules: a call starts before its arguments, indices count up from 0, no
    empty text."""
    started = []
    for delta in deltas:
        if isinstance(delta, ToolCallStart):
            assert delta.index == len(started)
            started.append(delta.index)
        elif isinstance(delta, ToolCallArgs):
            assert delta.index in started
        else:
            assert delta.text


def named(calls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


HERMES = [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>', "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    # parallel calls; the newlines between them are not content
    ('<tool_call>\n{"name": "a", "arguments": {"i": 1}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {"i": 2}}\n</tool_call>\n', "",
     [("a", '{"i": 1}'), ("b", '{"i": 2}')]),
    # compact JSON comes out canonical, key order kept
    ('<tool_call>{"name":"f","arguments":{"b":[1,2.5,{"c":null}],"a":true}}</tool_call>', "",
     [("f", '{"b": [1, 2.5, {"c": null}], "a": true}')]),
    # unicode, escapes and a surrogate pair in the arguments
    ('<tool_call>\n{"name": "echo", "arguments": {"text": "h\u00e9llo 日本 \\u00e9 \\ud83e\\udd16 🦊",'
     ' "q": "say \\"hi\\"\\n"}}\n</tool_call>', "",
     [("echo", '{"text": "héllo 日本 é 🤖 🦊", "q": "say \\"hi\\"\\n"}')]),
    # the closing tag inside a JSON string does not end the call; text after a call is content
    ('<tool_call>{"name": "note", "arguments": {"s": "a </tool_call> b"}}</tool_call>\nDone.',
     "Done.", [("note", '{"s": "a </tool_call> b"}')]),
    # a call left open at the end of the text is judged as if closed
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n', "Sure.", [("f", "{}")]),
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', "", [("f", '{"x": 1}')]),
    ("if a < b and <tool> or <tool_call", "if a < b and <tool> or <tool_call", []),
    # Hermes does not read bare JSON
    ('{"name": "a", "arguments": {}}', '{"name": "a", "arguments": {}}', []),
]

MALFORMED = [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # a brace short
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments as text
    '<tool_call>{"name": "f"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>',  # Infinity once written
    '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
    '<tool_call>get_weather(city="Paris")</tool_call>',
    '<tool_call>[]</tool_call>',
    'Calling.\n<tool_call>\n{"name": "f", "argu',  # cut off by max_tokens
]

QWEN25_CODER = [
    ('I will look it up.\n```json\n{"name": "search", "arguments": {"query": "rust traits"}}\n```',
     "I will look it up.", [("search", '{"query": "rust traits"}')]),
    ('```json\n[{"name": "a", "arguments": {"i": 1}}, {"name": "b", "arguments": {"i": 2}}]\n```',
     "", [("a", '{"i": 1}'), ("b", '{"i": 2}')]),
    ('{"name": "read_file", "arguments": {"path": "src/main.rs"}}', "",
     [("read_file", '{"path": "src/main.rs"}')]),
    ('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]\nDone.', "Done.",
     [("a", "{}"), ("b", "{}")]),
    ('\n  {"name": "a", "arguments": {}}\n{"name": "b", "arguments": {"x": "}"}}', "",
     [("a", "{}"), ("b", '{"x": "}"}')]),
    ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>', "", [("a", "{}")]),
    # backticks inside a string do not close the fence
    ('```json\n{"name": "write", "arguments": {"text": "```py\\nx = 1\\n```"}}\n```', "",
     [("write", '{"text": "```py\\nx = 1\\n```"}')]),
    # JSON that is not a call, other fences, and JSON-looking text stay content, verbatim
    ('Example:\n```json\n{"a": 1}\n```\nThat is all.', 'Example:\n```json\n{"a": 1}\n```\nThat is all.',
     []),
    ('Here:\n```python\nprint("hi")\n```', 'Here:\n```python\nprint("hi")\n```', []),
    ('[docs](https://x.y) say {"name": "no"}', '[docs](https://x.y) say {"name": "no"}', []),
    ('{"answer": 42, "unit": "m"}', '{"answer": 42, "unit": "m"}', []),
    ('{"name": "a", "arguments": {}} {"answer": 1}', '{"name": "a", "arguments": {}} {"answer": 1}',
     []),
]

LLAMA3_JSON = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", '{"city": "Paris"}')]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", '{"city": "Paris"}')]),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": 2}}', "",
     [("a", '{"x": 1}'), ("b", '{"y": 2}')]),
    ('{"name": "a", "arguments": {}}', "", [("a", "{}")]),
    ('<|python_tag|>brave_search.call(query="weather")',
     '<|python_tag|>brave_search.call(query="weather")', []),
    ("The capital is Paris.", "The capital is Paris.", []),
    ('I think {"name": "a", "parameters": {}}', 'I think {"name": "a", "parameters": {}}', []),
]

CASES = ([(HermesToolParser, *case) for case in HERMES]
         + [(HermesToolParser, text, text, []) for text in MALFORMED]
         + [(Qwen25CoderToolParser, text, text, []) for text in MALFORMED]
         + [(Qwen25CoderToolParser, *case) for case in QWEN25_CODER]
         + [(Llama3JsonToolParser, *case) for case in LLAMA3_JSON])


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_and_streamed_parsing_match_the_expectation(parser, text, content, calls):
    whole_content, whole_calls = parser().parse(text)
    assert (whole_content, named(whole_calls)) == (content, calls)
    for seed in [None, *CUT_SEEDS]:
        deltas = streamed(parser(), cuts(text, seed))
        check_order(deltas)
        _, got_content, got_calls = collect_deltas(deltas)
        assert (got_content, named(got_calls)) == (content, calls), seed
        if calls:
            assert not any(m in d.text for d in deltas if isinstance(d, TextDelta) for m in MARKUP)


def test_a_malformed_call_beside_valid_ones_is_content():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>oops</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"k": "v"}}</tool_call>')
    content, calls = HermesToolParser().parse(text)
    assert content == "<tool_call>oops</tool_call>"
    assert named(calls) == [("a", "{}"), ("b", '{"k": "v"}')]


def test_call_ids_are_distinct_and_openai_shaped():
    text = "".join(f'<tool_call>{{"name": "f{i}", "arguments": {{}}}}</tool_call>' for i in range(5))
    _, calls = HermesToolParser().parse(text)
    assert [c.name for c in calls] == [f"f{i}" for i in range(5)]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert len({c.id for c in calls}) == 5


def test_text_is_held_only_while_it_could_become_markup():
    parser = HermesToolParser()
    assert parser.feed("Hello wor") == [TextDelta("Hello wor")]
    assert parser.feed("ld, ") == [TextDelta("ld,")]  # the space may precede a call
    assert parser.feed("a <tool") == [TextDelta(" a")]
    assert parser.feed("box> <tool_") == [TextDelta(" <toolbox>")]
    assert parser.feed('call>{"name": "f", "arguments": {"a": ') == []
    start, args = parser.feed('1}}</tool_call>')  # sent when the region closes, before finish
    assert (start.index, start.name, args) == (0, "f", ToolCallArgs(0, '{"a": 1}'))
    assert parser.feed("\n") == [] and parser.finish() == []


def test_bare_json_is_held_only_while_it_could_be_a_call():
    parser = Qwen25CoderToolParser()
    assert parser.feed(" [") == []
    assert parser.feed("x") == [TextDelta(" [x")]
    parser = Qwen25CoderToolParser()
    assert parser.feed("```") == []
    assert parser.feed("python\n") == [TextDelta("```python")]
    parser = Llama3JsonToolParser()
    assert parser.feed("<|python") == []
    assert parser.feed('_tag|>{"name": "a", "parameters": {}}') == []  # a parallel call may follow
    assert [type(d) for d in parser.feed(" x")] == [ToolCallStart, ToolCallArgs, TextDelta]


# ---- choosing a parser -------------------------------------------------------------------------

QWEN3_TEMPLATE_PART = ("{%- if tools %}\n{{- '<|im_start|>system\\n' }}\n... <tools></tools> XML tags:"
                       "\\n<tools>\" }}\n{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}\n"
                       "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with "
                       "function name and arguments within <tool_call></tool_call> XML tags\" }}")
LLAMA31_TEMPLATE_PART = ("{%- if builtin_tools is defined or tool_calls %}{{- \"<|python_tag|>\" }}"
                         "{%- endif %}{{- '{\"name\": \"' + tool_call.name + '\", ' }}"
                         "{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}")


@pytest.mark.parametrize("template, vocab, expected", [
    (QWEN3_TEMPLATE_PART, None, HermesToolParser),
    (LLAMA31_TEMPLATE_PART, None, Llama3JsonToolParser),
    ("{{ messages }}", {"<|python_tag|>": 128010}, Llama3JsonToolParser),
    ("{{ messages }}", {"<tool_call>", "<|im_start|>"}, HermesToolParser),
    ("{{ messages }}", {"<|im_start|>"}, None),
    (None, None, None),
])
def test_auto_reads_the_template_then_the_vocabulary(template, vocab, expected):
    assert get_tool_parser("auto", template, vocab) is expected


def test_explicit_names_and_unknown_ones():
    assert get_tool_parser("hermes", None, None) is HermesToolParser
    assert get_tool_parser("qwen25_coder", None, None) is Qwen25CoderToolParser
    assert get_tool_parser("llama3_json", QWEN3_TEMPLATE_PART, None) is Llama3JsonToolParser
    assert get_tool_parser("none", QWEN3_TEMPLATE_PART, {"<tool_call>"}) is None
    with pytest.raises(ValueError, match="hermes.*qwen25_coder.*llama3_json.*none"):
        get_tool_parser("mistral", None, None)


# ---- chat templates with tools -----------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


def template_tokenizer(template: str):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from luceio.tokenizer import Tokenizer
    return Tokenizer(Backend(models.BPE()), {"chat_template": template}, {}, {})


@pytest.mark.parametrize("template, rendered", [
    ("{% for c in messages[0].tool_calls %}{{ c.function.arguments }}{% endfor %}",
     '{"city":  "Zürich"}'),  # printed as the client sent it
    ("{% for c in messages[0].tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}",
     '{"city": "Zürich"}'),
    ("{% for c in messages[0].tool_calls %}{% if c.function.arguments is string %}S"
     "{{ c.function.arguments }}{% else %}M{{ c.function.arguments | tojson }}{% endif %}"
     "{% endfor %}", 'M{"city": "Zürich"}'),
    ("{{ messages[0].tool_calls[0].function.arguments.city }}", "Zürich"),
    ("{{ '<' + messages[0].content + '>' }}", "<>"),  # OpenAI's null content
])
def test_tool_call_arguments_suit_each_kind_of_template(template, rendered):
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":  "Zürich"}'}}]}
    assert template_tokenizer(template).apply_chat_template([message], False) == rendered


def test_arguments_that_are_not_a_json_object_reach_the_template_unchanged():
    template = "{% for c in messages[0].tool_calls %}{{ c.function.arguments | tojson }};{% endfor %}"
    calls = [{"function": {"name": "f", "arguments": a}} for a in ("[1]", "{oops", {"k": 1})]
    message = {"role": "assistant", "content": "", "tool_calls": calls}
    rendered = template_tokenizer(template).apply_chat_template([message], False)
    assert rendered == '"[1]";"{oops";{"k": 1};'


QWEN25_EXPECTED = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in '
    'a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
    "</tool_call><|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n")


@pytest.mark.registry
def test_real_qwen25_coder_template_renders_tools_calls_and_results(qwen_coder_tokenizer):
    prompt = qwen_coder_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert prompt == QWEN25_EXPECTED
    from transformers.utils.chat_template_utils import render_jinja_template
    reference = json.loads(json.dumps(CONVERSATION))  # transformers takes arguments as a dict
    reference[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Zürich"}
    (rendered,), _ = render_jinja_template([reference], tools=TOOLS, add_generation_prompt=True,
                                           chat_template=qwen_coder_tokenizer.chat_template)
    assert prompt == rendered
    ids = qwen_coder_tokenizer.encode(prompt, add_special_tokens=False)
    assert ids.count(qwen_coder_tokenizer.token_to_id("<tool_call>")) == 3  # 2 in the instructions


@pytest.mark.registry
def test_auto_parser_reads_back_what_the_qwen25_template_wrote(qwen_coder_tokenizer):
    parser = get_tool_parser("auto", qwen_coder_tokenizer.chat_template, None)
    assert parser is Qwen25CoderToolParser
    turn = QWEN25_EXPECTED.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parser().parse(turn)
    assert (content, named(calls)) == ("", [("get_weather", '{"city": "Zürich"}')])
