"""Does an engine with adaptive n-gram speculation cost anything where drafting does not pay?
Real Qwen2.5-Coder-1.5B Q4_K_M on the CPU, the four code-generation prompts of spec_tree.py one
at a time (32 greedy tokens each), in one process: plain decoding, adaptive n-gram drafting, the
same engine with drafting switched off (`SpecDecoder.mode` -> None), plain decoding again.
Prints wall seconds, steps and why steps ran synchronously. Single runs on a 2-core machine move
by 10-20% from process to process; the rows of one process compare.

    python bench/spec_b1_overhead.py
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import spec_tree  # noqa: E402

from luceio import LLM, SamplingParams  # noqa: E402


def run(llm, prompts, label: str) -> None:
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # warm
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32)
    counters = llm.engine.counters
    sync0, steps0 = dict(counters["sync_steps"]), counters["steps"]
    t = time.perf_counter()
    for p in prompts:
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    wall = time.perf_counter() - t
    sync = {k: v - sync0.get(k, 0) for k, v in counters["sync_steps"].items()}
    print(f"{label}: {wall:.2f} s, {counters['steps'] - steps0} steps, sync {sync}", flush=True)


def main() -> None:
    common = dict(device="cpu", max_model_len=4096, cpu_threads=2)
    plain = LLM(spec_tree.TARGET, **common)
    prompts = spec_tree.build_prompts(plain.get_tokenizer(), 4, 3)["codegen"]
    run(plain, prompts, "plain")
    spec = LLM(spec_tree.TARGET, speculative_method="ngram", num_speculative_tokens=4, **common)
    run(spec, prompts, "ngram adaptive")
    spec.engine.spec.mode = lambda batch_size, step=None: None
    run(spec, prompts, "ngram, drafting off")
    run(plain, prompts, "plain again")


if __name__ == "__main__":
    main()
