"""LLM: the synchronous offline wrapper, like vLLM's."""
from __future__ import annotations

from .config import EngineArgs
from .engine import LLMEngine, PromptType
from .outputs import RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Runs all prompts to completion, batched; returns outputs in prompt order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams or one per prompt")
        ids = []
        for prompt, p in zip(prompts, params):
            p = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            ids.append(self.engine.add_request(None, prompt, p))
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(c), add_special_tokens=False)}
                   for c in convs]
        return self.generate(prompts, sampling_params)
