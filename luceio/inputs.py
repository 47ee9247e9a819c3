"""Prompt shapes, under vLLM's names: text, token ids, a `TextPrompt` or a `TokensPrompt`.

Rules: a dict prompt holds `prompt` (text) or `prompt_token_ids` (with an optional `prompt`, the
text those ids came from, which outputs echo). Any other key (vLLM's `multi_modal_data`,
`mm_processor_kwargs`, `cache_salt`, ...) raises ValueError naming it: luceio serves text models
and never drops a field silently. Unlike vLLM, a bare list of token ids is a prompt too."""
from __future__ import annotations

from typing import TypedDict, Union

_PROMPT_KEYS = ("prompt", "prompt_token_ids")


class TextPrompt(TypedDict):
    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):  # prompt_token_ids required, prompt optional
    prompt: str  # the text the ids came from, echoed in outputs


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]


def split_prompt(prompt: PromptType) -> tuple[str | None, str | list[int]]:
    """(the text given alongside token ids, or None; what to run: text or token ids)."""
    if not isinstance(prompt, dict):
        return None, prompt
    unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
    if unknown:
        raise ValueError(f"prompt keys {unknown} are not supported: luceio takes 'prompt' (text) "
                         f"or 'prompt_token_ids'")
    if "prompt_token_ids" in prompt:
        return prompt.get("prompt"), prompt["prompt_token_ids"]
    if "prompt" not in prompt:
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return None, prompt["prompt"]
