"""LLM: the synchronous offline wrapper, with vLLM's method names and the arguments of theirs
that luceio honours (an argument it does not take is a TypeError, never ignored).

Rules: `generate` runs every prompt to completion in one batch and returns outputs in prompt
order; without sampling params it uses `get_default_sampling_params()`, the model's own
generation_config.json defaults, as vLLM does. `use_tqdm` shows a progress bar over finished
prompts (True, as vLLM, or a callable that makes the bar). `shutdown()` releases the engine."""
from __future__ import annotations

from typing import Callable

from tqdm import tqdm

from .config import EngineArgs
from .engine import LLMEngine
from .inputs import PromptType
from .outputs import RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams.from_generation_config(self.engine.generation_config)

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams or one per prompt")
        ids = []
        for prompt, p in zip(prompts, params):
            p = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            ids.append(self.engine.add_request(None, prompt, p))
        done: dict[str, RequestOutput] = {}
        bar = _progress_bar(use_tqdm, len(ids))
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, add_generation_prompt: bool = True,
             tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the model's chat template
        (`tools` and `chat_template_kwargs` go to the template)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           tools=tools, **(chat_template_kwargs or {}))
            prompts.append({"prompt": text,
                            "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        """Drops the engine, so its weights and KV cache can be freed, and ends its pipeline
        stages' processes; the LLM is unusable after."""
        self.engine.close()
        del self.engine


def _progress_bar(use_tqdm: bool | Callable[..., tqdm], total: int) -> tqdm:
    make = use_tqdm if callable(use_tqdm) else tqdm
    return make(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
