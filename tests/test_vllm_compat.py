"""vLLM drop-in: vLLM's documented examples with `vllm` replaced by `luceio` in the import lines
(and the model and its engine arguments replaced by the tiny test model), the names vLLM exports,
and the SamplingParams fields vLLM has: logit_bias and allowed_token_ids against the logits
transformers computes, detokenize, and the refused ones."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from conftest import engine_kwargs

PROMPTS = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]

# every name vLLM's top-level package exports (vllm/__init__.py MODULE_ATTRS)
VLLM_NAMES = ["AsyncEngineArgs", "EngineArgs", "AsyncLLMEngine", "LLMEngine", "LLM",
              "initialize_ray_cluster", "PromptType", "TextPrompt", "TokensPrompt",
              "ModelRegistry", "SamplingParams", "PoolingParams", "ClassificationOutput",
              "ClassificationRequestOutput", "CompletionOutput", "EmbeddingOutput",
              "EmbeddingRequestOutput", "PoolingOutput", "PoolingRequestOutput", "RequestOutput",
              "ScoringOutput", "ScoringRequestOutput"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from luceio import LLM
    return LLM(model=tiny_llama, **engine_kwargs())


def test_every_vllm_name_is_provided_or_refused_with_a_reason():
    import luceio
    for name in VLLM_NAMES:
        if name in luceio._ABSENT:
            with pytest.raises(ImportError, match=f"luceio has no {name}: "):
                exec(f"from luceio import {name}")
        else:
            assert name in luceio.__all__ and getattr(luceio, name) is not None, name
    assert luceio.AsyncLLMEngine is luceio.AsyncLLM and luceio.AsyncEngineArgs is luceio.EngineArgs


# examples/offline_inference/basic/basic.py -----------------------------------------------------
def test_offline_inference_example(llm, capsys):
    from luceio import SamplingParams
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(PROMPTS, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    assert [o.prompt for o in outputs] == PROMPTS
    assert all(len(o.outputs[0].token_ids) == 16 for o in outputs)  # vLLM's default max_tokens
    assert "Processed prompts: 100%" in capsys.readouterr().err  # use_tqdm defaults to True


# examples/offline_inference/basic/chat.py --------------------------------------------------------
def test_chat_example(llm, capsys):
    from luceio import SamplingParams
    sampling_params = SamplingParams(max_tokens=8, temperature=0)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    assert capsys.readouterr().err == ""
    rendered = llm.get_tokenizer().apply_chat_template(conversation)
    assert outputs[0].prompt == rendered and rendered.endswith("<|im_start|>assistant\n")
    conversations = [conversation for _ in range(10)]
    batch = llm.chat(conversations, sampling_params, use_tqdm=True)
    assert "10/10" in capsys.readouterr().err
    assert [o.outputs[0].token_ids for o in batch] == [outputs[0].outputs[0].token_ids] * 10


# examples/offline_inference/async_llm_streaming.py ---------------------------------------------
async def test_async_llm_streaming_example(tiny_llama, llm):
    from luceio import AsyncEngineArgs, AsyncLLM
    from luceio.sampling_params import RequestOutputKind, SamplingParams

    async def stream_response(engine, prompt: str, request_id: str) -> str:
        sampling_params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=42,
                                         output_kind=RequestOutputKind.DELTA)
        text = ""
        async for output in engine.generate(request_id=request_id, prompt=prompt,
                                            sampling_params=sampling_params):
            for completion in output.outputs:
                text += completion.text
            if output.finished:
                break
        return text

    engine_args = AsyncEngineArgs(model=tiny_llama, enforce_eager=True, **engine_kwargs())
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        streamed = [await stream_response(engine, p, f"stream-example-{i}")
                    for i, p in enumerate(PROMPTS[:3], 1)]
    finally:
        engine.shutdown()  # synchronous, as vLLM's
    from luceio import SamplingParams as Params
    reference = llm.generate(PROMPTS[:3], Params(max_tokens=20, temperature=0.8, top_p=0.95,
                                                 seed=42), use_tqdm=False)
    assert streamed == [o.outputs[0].text for o in reference]  # seeded: the same draws
    with pytest.raises(RuntimeError, match="shut down"):
        await anext(engine.generate("x", request_id="after"))


async def test_async_llm_engine_from_engine_args(tiny_llama):
    from luceio import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
    from luceio.inputs import TokensPrompt
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama, **engine_kwargs()))
    final_output = None
    async for request_output in engine.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]),
                                                SamplingParams(max_tokens=4), "0"):
        final_output = request_output
    engine.shutdown()
    assert final_output.finished and len(final_output.outputs[0].token_ids) == 4


# examples/offline_inference/structured_outputs.py ---------------------------------------------------
def test_structured_outputs_example(llm):
    """vLLM's example as it is (the tiny random model writes nonsense, inside the grammar; the
    default 16 tokens can cut an output short, which must then be a prefix of the language)."""
    from enum import Enum

    from pydantic import BaseModel

    from luceio import SamplingParams
    from luceio.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    structured_outputs_params_choice = StructuredOutputsParams(choice=["Positive", "Negative"])
    sampling_params_choice = SamplingParams(structured_outputs=structured_outputs_params_choice)
    prompt_choice = "Classify this sentiment: vLLM is wonderful!"

    structured_outputs_params_regex = StructuredOutputsParams(regex=r"\w+@\w+\.com\n")
    sampling_params_regex = SamplingParams(structured_outputs=structured_outputs_params_regex,
                                           stop=["\n"])
    prompt_regex = ("Generate an email address for Alan Turing, who works in Enigma."
                    "End in .com and new line. Example result:"
                    "alan.turing@enigma.com\n")

    class CarType(str, Enum):
        sedan = "sedan"
        suv = "SUV"
        truck = "Truck"
        coupe = "Coupe"

    class CarDescription(BaseModel):
        brand: str
        model: str
        car_type: CarType

    json_schema = CarDescription.model_json_schema()
    structured_outputs_params_json = StructuredOutputsParams(json=json_schema)
    sampling_params_json = SamplingParams(structured_outputs=structured_outputs_params_json)
    prompt_json = ("Generate a JSON with the brand, model and car_type of"
                   "the most iconic car from the 90's")

    simplified_sql_grammar = """
        root ::= select_statement
        select_statement ::= "SELECT " column " from " table " where " condition
        column ::= "col_1 " | "col_2 "
        table ::= "table_1 " | "table_2 "
        condition ::= column "= " number
        number ::= "1 " | "2 "
    """
    structured_outputs_params_grammar = StructuredOutputsParams(grammar=simplified_sql_grammar)
    sampling_params_grammar = SamplingParams(structured_outputs=structured_outputs_params_grammar)
    prompt_grammar = ("Generate an SQL query to show the 'username' and 'email'"
                      "from the 'users' table.")

    outs = {}
    for name, prompt, params in [("choice", prompt_choice, sampling_params_choice),
                                 ("regex", prompt_regex, sampling_params_regex),
                                 ("json", prompt_json, sampling_params_json),
                                 ("grammar", prompt_grammar, sampling_params_grammar)]:
        outputs = llm.generate(prompts=prompt, sampling_params=params)
        outs[name] = outputs[0].outputs[0]
    assert outs["choice"].text in ("Positive", "Negative")
    sql = [f"SELECT col_{a}  from table_{b}  where col_{c} = {d} " for a in "12" for b in "12"
           for c in "12" for d in "12"]
    regex = outs["regex"]
    if regex.finish_reason == "stop":
        assert re.fullmatch(r"\w+@\w+\.com", regex.text), regex.text
    else:
        assert re.fullmatch(r"\w*(@\w*(\.(c(om?)?)?)?)?", regex.text), regex.text
    grammar = outs["grammar"]
    assert grammar.text in sql if grammar.finish_reason == "stop" else \
        any(s.startswith(grammar.text) for s in sql), grammar.text
    car = outs["json"]
    if car.finish_reason == "stop":
        CarDescription.model_validate_json(car.text)
    else:
        assert car.text.startswith('{"brand": "') or car.text.startswith("{")
    guided = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["Positive", "Negative"]))
    assert llm.generate(prompt_choice, guided)[0].outputs[0].text in ("Positive", "Negative")
    with pytest.raises(ValueError, match="one kind"):
        StructuredOutputsParams(choice=["a"], regex="a")


# SamplingParams fields ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def first_logits(tiny_llama):
    """transformers' logits for the token after PROMPT_IDS: the reference for the first token."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([PROMPT_IDS])).logits[0, -1]


PROMPT_IDS = [17, 42, 99, 7, 250, 3]


def _first_token(llm, **params) -> int:
    from luceio import SamplingParams
    out = llm.generate({"prompt_token_ids": PROMPT_IDS},
                       SamplingParams(max_tokens=1, temperature=0, **params), use_tqdm=False)
    return out[0].outputs[0].token_ids[0]


def test_logit_bias_and_allowed_token_ids_move_greedy_choice_as_computed(llm, first_logits):
    ranked = first_logits.argsort(descending=True).tolist()
    assert _first_token(llm) == ranked[0]
    allowed = ranked[3:8]  # the best of these by the raw logits wins
    assert _first_token(llm, allowed_token_ids=allowed[::-1]) == allowed[0]
    target = ranked[5]  # lifted past the best by a margin far above float error
    bias = float(first_logits[ranked[0]] - first_logits[target]) + 0.05
    assert _first_token(llm, logit_bias={target: bias}) == target
    assert _first_token(llm, logit_bias={target: bias - 0.1}) == ranked[0]  # control
    assert _first_token(llm, logit_bias={str(ranked[0]): -100}) == ranked[1]  # JSON-style key


def test_allowed_token_ids_hold_for_every_sampled_token(llm):
    from luceio import SamplingParams
    allowed = [10, 20, 30]
    out = llm.generate([{"prompt_token_ids": PROMPT_IDS}] * 4,
                       SamplingParams(max_tokens=12, temperature=1.5, seed=3,
                                      allowed_token_ids=allowed), use_tqdm=False)
    tokens = {t for o in out for t in o.outputs[0].token_ids}
    assert tokens <= set(allowed) and len(tokens) > 1


def test_sampler_masks_and_bias_match_hand_computation():
    from luceio import SamplingParams
    from luceio.request import Request
    from luceio.sampler import Sampler
    logits = torch.tensor([[0.5, 1.0, -2.0, 3.0], [1.0, 2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4]])
    reqs = [Request(str(i), [1], SamplingParams(temperature=0, **kw), set(), 64)
            for i, kw in enumerate([{"logit_bias": {1: 2.0, 3: -1.0}},
                                    {"allowed_token_ids": [0, 2], "logit_bias": {2: -0.5, 3: 9}},
                                    {}])]
    inf = float("-inf")
    expected = torch.tensor([[0.5, 3.0, -2.0, 2.0], [1.0, inf, 2.5, inf], [0.1, 0.2, 0.3, 0.4]])
    assert torch.equal(Sampler().process(logits, reqs), expected)


def test_bad_token_ids_are_refused(llm):
    from luceio import SamplingParams
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("hi", SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("hi", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words is not supported"):
        SamplingParams(bad_words=["foo"])


def test_detokenize_false_gives_ids_only(llm):
    from luceio import SamplingParams
    out = llm.generate("Hello", SamplingParams(max_tokens=5, detokenize=False, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 5
    assert all(lp.decoded_token is None for d in out.logprobs for lp in d.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


def test_prompts_as_vllm_typed_dicts(llm):
    from luceio.inputs import TextPrompt, TokensPrompt
    from luceio import SamplingParams
    params = SamplingParams(max_tokens=3, temperature=0)
    text = llm.generate(TextPrompt(prompt="Hello"), params, use_tqdm=False)[0]
    ids = llm.generate(TokensPrompt(prompt_token_ids=text.prompt_token_ids), params,
                       use_tqdm=False)[0]
    assert text.outputs[0].token_ids == ids.outputs[0].token_ids
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "Hello", "multi_modal_data": {}}, params, use_tqdm=False)


def test_default_sampling_params_come_from_generation_config(tiny_llama, tmp_path):
    from luceio import LLM, SamplingParams
    folder = shutil.copytree(tiny_llama, tmp_path / "model")
    with open(folder / "generation_config.json", "w") as f:
        json.dump({"temperature": 0.3, "top_k": 20, "max_new_tokens": 7, "do_sample": True}, f)
    llm = LLM(str(folder), **engine_kwargs())
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.3, 20, 7)
    assert defaults.top_p == SamplingParams().top_p
    assert len(llm.generate("Hello", use_tqdm=False)[0].outputs[0].token_ids) == 7
    llm.shutdown()
    assert not hasattr(llm, "engine")


def test_untouched_greedy_rows_skip_the_copy_and_others_do_not():
    """A batch of plain greedy rows is returned as it is (the common case costs no copy of
    [rows, vocab]); a row that any step changes gets a processed copy."""
    from luceio import SamplingParams
    from luceio.request import Request
    from luceio.sampler import Sampler
    logits = torch.tensor([[0.5, 1.0, -2.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    plain = [Request(str(i), [1], SamplingParams(temperature=0), set(), 64) for i in range(2)]
    assert Sampler().process(logits, plain) is logits
    for kw in ({"logit_bias": {0: 1.0}}, {"repetition_penalty": 1.2}, {"min_tokens": 2},
               {"allowed_token_ids": [0, 1]}, {"temperature": 0.7}):
        reqs = [plain[0], Request("x", [1], SamplingParams(**kw), {3}, 64)]
        out = Sampler().process(logits, reqs)
        assert out is not logits and torch.equal(logits[0], torch.tensor([0.5, 1.0, -2.0, 3.0]))


def test_greedy_infill_rows_do_not_depend_on_their_batch():
    """llama.cpp's infill stage changes a greedy row's pick (a prefix merged into a likelier
    token); it applies whether or not a sampled row shares the batch."""
    import math
    from luceio import SamplingParams
    from luceio.request import Request
    from luceio.sampler import Sampler
    pieces = {1: b"a", 2: b"ab", 3: b"x"}
    row = torch.full((8,), float("-inf"))
    row[[1, 2, 3]] = torch.tensor([math.log(0.30), math.log(0.25), math.log(0.45)])
    greedy = Request("g", [0], SamplingParams(temperature=0, infill_sampler=True, top_k=3), {7}, 64)
    sampled = Request("s", [0], SamplingParams(temperature=1.0, seed=1), {7}, 64)
    sampler = Sampler(piece=lambda t: pieces.get(t, b""))
    alone = sampler.draw(row[None].clone(), [greedy])
    mixed = sampler.draw(torch.stack([row, row]), [greedy, sampled])
    assert int(row.argmax()) == 3  # plain greedy would take "x"
    assert alone.tolist() == [1] and mixed[0].item() == 1  # "a" and "ab" merged: 0.55 > 0.45
