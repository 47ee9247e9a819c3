"""What a request must satisfy before the engine queues it: each check raises ValueError with
the reason, and a refused request leaves nothing behind (`LLMEngine.add_request` runs these
before it changes any state)."""
from __future__ import annotations

from .sampling_params import SamplingParams


def check_token_ids(what: str, ids: list, vocab: int) -> None:
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise ValueError(f"{what} must be ints in [0, {vocab})")


def check_request(engine, ids: list[int], params: SamplingParams) -> None:
    """Raises ValueError for a request `engine` (an LLMEngine) could never run or that would
    break a step."""
    vocab = engine.runner.cfg.vocab_size
    engine.scheduler.check_fits(len(ids), params.max_tokens)
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab)
    check_token_ids("logit_bias token ids", list(params.logit_bias or ()), vocab)
    check_token_ids("allowed_token_ids", params.allowed_token_ids or [], vocab)
    if params.seed is not None and not 0 <= params.seed < 2**63 - params.n:
        raise ValueError(f"seed must be in [0, 2**63), got {params.seed}")
    if params.spec_prefill_keep is not None and engine.spec_prefill is None:
        raise ValueError("spec_prefill_keep needs speculative prefill, which this engine "
                         "does not run (it needs a --draft-model the target allows it with)")
    if params.prompt_logprobs is not None and \
            engine.spec_prefill_keep(len(ids), params) is not None:
        raise ValueError("prompt_logprobs cannot be combined with speculative prefill")
    if params.infill_sampler and engine.tokenizer is None:
        raise ValueError("infill_sampler compares the candidates' text: it needs a tokenizer")
