"""`chat_template_kwargs` on /v1/chat/completions (vLLM's and SGLang's field): extra variables
for the chat template, refused when not an object or when they would set what the renderer sets.

The reference is the prompt written out by hand for a template that reads `enable_thinking`
(Qwen3's rule: an empty think block when it is false), counted with the `tokenizers` library on
the tiny model's tokenizer; the server runs that tiny model with that template."""
from __future__ import annotations

import json
import logging
import os

import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer

from conftest import make_tiny_model, running
from luceio.server.protocol import APIError, ModelContext, parse_chat
from luceio.tokenizer import TEMPLATE_VARIABLES, Tokenizer

THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}"
            "<think>\n\n</think>\n\n{% endif %}{% endif %}")
MSG = [{"role": "user", "content": "hi"}]
ASKED = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
NO_THINKING = ASKED + "<think>\n\n</think>\n\n"
KEY = "sk-kwargs"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder = make_tiny_model(str(tmp_path_factory.mktemp("kwargs") / "llama"), "llama")
    config_path = os.path.join(folder, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "chat_template": THINKING}, f)
    return folder


@pytest.fixture(scope="module")
def hf_tok(model) -> HFTokenizer:
    return HFTokenizer.from_file(os.path.join(model, "tokenizer.json"))


@pytest.fixture(scope="module")
def ctx(model) -> ModelContext:
    with open(os.path.join(model, "tokenizer_config.json")) as f:
        tok = Tokenizer(HFTokenizer.from_file(os.path.join(model, "tokenizer.json")),
                        json.load(f), {}, {})
    return ModelContext(["m"], tok, tok.vocab_size, 4096, 4096, lambda n, m: None)


EFFORT = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
          "{% if reasoning_effort is defined %}|effort={{ reasoning_effort }}{% endif %}")


def test_reasoning_effort(ctx, model):
    """`reasoning_effort`: "none" turns thinking off in a template that reads `enable_thinking`
    (as `chat_template_kwargs` does, which wins where both are set); other efforts are warned
    about there; a template that reads `reasoning_effort` (gpt-oss) gets it; a bad value is a
    400 naming the field."""
    none = parse_chat({"messages": MSG, "reasoning_effort": "none"}, ctx)
    assert none.prompt_texts == [NO_THINKING] and none.warnings == []
    high = parse_chat({"messages": MSG, "reasoning_effort": "high"}, ctx)
    assert high.prompt_texts == [ASKED]
    assert [w for w in high.warnings if "'reasoning_effort' 'high' is not applied" in w], \
        high.warnings
    both = parse_chat({"messages": MSG, "reasoning_effort": "none",
                       "chat_template_kwargs": {"enable_thinking": True}}, ctx)
    assert both.prompt_texts == [ASKED]
    with pytest.raises(APIError) as e:
        parse_chat({"messages": MSG, "reasoning_effort": "max"}, ctx)
    assert (e.value.status, e.value.param) == (400, "reasoning_effort")
    with open(os.path.join(model, "tokenizer_config.json")) as f:
        config = {**json.load(f), "chat_template": EFFORT}
    tok = Tokenizer(HFTokenizer.from_file(os.path.join(model, "tokenizer.json")), config, {}, {})
    effort_ctx = ModelContext(["m"], tok, tok.vocab_size, 4096, 4096, lambda n, m: None)
    low = parse_chat({"messages": MSG, "reasoning_effort": "low"}, effort_ctx)
    assert low.prompt_texts == ["hi|effort=low"] and low.warnings == []
    off = parse_chat({"messages": MSG, "reasoning_effort": "none"}, effort_ctx)
    assert off.prompt_texts == ["hi|effort=none"]


def test_kwargs_reach_the_template(ctx):
    plain = parse_chat({"messages": MSG}, ctx)
    off = parse_chat({"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}}, ctx)
    on = parse_chat({"messages": MSG, "chat_template_kwargs": {"enable_thinking": True}}, ctx)
    assert plain.prompt_texts == on.prompt_texts == [ASKED]
    assert off.prompt_texts == [NO_THINKING]
    assert off.prompts[0]["prompt_token_ids"] == ctx.tokenizer.encode(NO_THINKING, False)
    assert off.warnings == []


@pytest.mark.parametrize("kwargs, needle", [
    ([1], "must be an object"),
    ("enable_thinking", "must be an object"),
    ({"messages": []}, "'messages'"),
    ({"add_generation_prompt": False}, "send the 'add_generation_prompt' field"),
    ({"tools": []}, "send the 'tools' field"),
    ({"bos_token": "<s>"}, "'bos_token'"),
    ({"raise_exception": 1}, "'raise_exception'"),
    ({"not a name": 1}, "variable names"),
])
def test_refused(ctx, kwargs, needle):
    with pytest.raises(APIError) as error:
        parse_chat({"messages": MSG, "chat_template_kwargs": kwargs}, ctx)
    assert error.value.status == 400 and error.value.param == "chat_template_kwargs"
    assert needle in error.value.message


def test_every_renderer_variable_is_refused(ctx):
    """The refusal list is the renderer's: each name it sets is refused, by the tokenizer too."""
    for name in TEMPLATE_VARIABLES:
        with pytest.raises(APIError):
            parse_chat({"messages": MSG, "chat_template_kwargs": {name: 1}}, ctx)
        if name not in ("messages", "add_generation_prompt", "tools"):  # its own arguments
            with pytest.raises(ValueError, match=name):
                ctx.tokenizer.apply_chat_template(MSG, **{name: 1})


def test_a_variable_the_template_does_not_read_is_warned(ctx):
    req = parse_chat({"messages": MSG, "chat_template_kwargs": {"enable_thinking": False,
                                                                "reasoning": "low"}}, ctx)
    assert req.prompt_texts == [NO_THINKING]
    assert req.warnings == ["chat_template_kwargs: the chat template does not read 'reasoning'"]


def test_through_the_server(model, hf_tok, caplog):
    with running(model, {"max_model_len": 256}, api_key=KEY, served_model_name="tiny") as port:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as http:
            def prompt_tokens(**extra) -> int:
                r = http.post("/v1/chat/completions",
                              json={"messages": MSG, "max_tokens": 1, **extra})
                assert r.status_code == 200, r.text
                return r.json()["usage"]["prompt_tokens"]

            with caplog.at_level(logging.WARNING, logger="luceio.server"):
                off = prompt_tokens(chat_template_kwargs={"enable_thinking": False, "x": 1})
            assert off == len(hf_tok.encode(NO_THINKING, add_special_tokens=False).ids)
            assert prompt_tokens() == len(hf_tok.encode(ASKED, add_special_tokens=False).ids)
            assert "does not read 'x'" in caplog.text
            r = http.post("/v1/chat/completions", json={
                "messages": MSG, "chat_template_kwargs": {"messages": []}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
