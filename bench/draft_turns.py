"""A conversation of several turns with a draft model, on the CPU: each turn's prompt is the
last turn's prompt, its output and a new message (the next code prompt of
bench/spec_acceptance.py's generation set), so the target finds all but the new message in its
prefix cache. The draft model keeps a cache of its own; this measures what its prefix cache
saves: the rows fed to the draft at the turn's first drafting step and the turn's wall time,
with the draft's prefix caching on (the code's default) and off, and plain decoding beside
them. Target Qwen2.5-Coder-1.5B, draft Qwen2.5-Coder-0.5B (real GGUF weights), greedy, every
decode step drafting a chain of `--k` (pinned, as bench/spec_tree.py pins it: on two CPU cores
the adaptive policy would often decode plainly and hide the feed).

    python bench/draft_turns.py [--turns 4] [--tokens 48] [--k 4] [--threads 2]
Writes bench/results/cpu/draft_turns.json (`--out`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402
from spec_acceptance import build_prompts  # noqa: E402
from spec_tree import pin  # noqa: E402

from luceio import LLM, SamplingParams  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
OUT = os.path.join(os.path.dirname(__file__), "results", "cpu", "draft_turns.json")


def conversation(llm, messages: list[list[int]], params, feeds: list[int] | None) -> list[dict]:
    """Runs the turns; per turn its wall time, output and (with a draft) the first feed's rows."""
    history: list[int] = []
    turns = []
    for i, message in enumerate(messages):
        prompt = history + message
        mark = len(feeds) if feeds is not None else 0
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        tokens = list(out.outputs[0].token_ids)
        row = {"turn": i + 1, "prompt_tokens": len(prompt), "wall_s": round(wall, 3),
               "tokens": tokens}
        if feeds is not None:
            row["first_feed_rows"] = feeds[mark] if len(feeds) > mark else None
        turns.append(row)
        history = prompt + tokens
    return turns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48, help="new tokens a turn")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    common = dict(device="cpu", max_model_len=4096, cpu_threads=a.threads)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=a.tokens)
    results = {"env": env_info(), "target": TARGET, "draft": DRAFT, "k": a.k,
               "tokens_per_turn": a.tokens, "runs": []}
    llm = LLM(TARGET, **common)
    messages = (build_prompts(llm.get_tokenizer(), 4, 3)["codegen"] * 4)[:a.turns]
    warm = [7] * 40  # compiles and buffers, on a prompt no turn starts with
    llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=4), use_tqdm=False)
    plain = conversation(llm, messages, params, None)
    results["runs"].append({"method": "plain", "turns": plain})
    print({"method": "plain", "wall_s": [t["wall_s"] for t in plain]}, flush=True)
    del llm
    for cached in (True, False):
        llm = LLM(TARGET, speculative_method="draft", draft_model=DRAFT,
                  num_speculative_tokens=a.k, **common)
        spec = llm.engine.spec
        pin(spec, "chain")
        prop = spec.proposer
        prop.kv.enable_prefix_caching = cached
        llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=8), use_tqdm=False)
        feeds: list[int] = []
        execute = prop.runner.execute

        def spy(inp, probe=None, execute=execute, feeds=feeds):
            feeds.append(int(inp.host.q_lens.max()))
            return execute(inp, probe)
        prop.runner.execute = spy
        turns = conversation(llm, messages, params, feeds)
        same = all(t["tokens"] == p["tokens"] for t, p in zip(turns, plain))
        method = f"draft chain k{a.k}, draft prefix cache {'on' if cached else 'off'}"
        results["runs"].append({"method": method, "greedy_exact": same, "turns": turns})
        print({"method": method, "greedy_exact": same, "wall_s": [t["wall_s"] for t in turns],
               "first_feed_rows": [t["first_feed_rows"] for t in turns],
               "prompt_tokens": [t["prompt_tokens"] for t in turns]}, flush=True)
        del llm, spec, prop
    write_json(a.out, results)


if __name__ == "__main__":
    main()
