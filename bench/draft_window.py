"""The draft model's context window (`--spec-draft-window`) on long prompts, CPU, real weights:
target Qwen2.5-Coder-1.5B and draft Qwen2.5-Coder-0.5B (Q4_K_M GGUF), greedy. Each prompt is a
Python standard-library module's source cut after the signature of a function that starts past
`--min-tokens` tokens (the model continues the file), run alone, one after another, on one
engine a configuration that has first completed another such file (a server that has been
running: the cost model has measured its steps; nothing of the new files is cached). Per
configuration: plain decoding, then the draft model with the whole prompt (window 0) and with
each `--windows` N; the draft is pinned to chains of k = 4 at every step (`spec_tree.pin`)
unless `--adaptive`. Records per request the wall time (prefill included), decode tok/s after
the first token, tokens per verify, the draft's rows fed, and whether the output equals plain
decoding's.

    python bench/draft_window.py [--windows 128,512] [--prompts 4] [--new 64] [--adaptive]
Writes bench/results/cpu/draft_window.json (--out).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402
from spec_tree import pin  # noqa: E402

from luceio import LLM, SamplingParams  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
MODULES = ["argparse", "difflib", "textwrap", "configparser", "calendar", "ftplib"]


def build_prompts(tok, n: int, min_tokens: int, max_tokens: int) -> list[tuple[str, list[int]]]:
    """(module, ids) of the first `n` modules with a function whose signature ends between
    `min_tokens` and `max_tokens` tokens into the file: the file up to the end of that line."""
    out = []
    for name in MODULES:
        src = inspect.getsource(importlib.import_module(name))
        lines = src.splitlines(keepends=True)
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.FunctionDef) or not node.body:
                continue
            text = "".join(lines[:node.body[0].lineno - 1])  # through the signature
            ids = tok.encode(text, add_special_tokens=False)
            if min_tokens <= len(ids) <= max_tokens:
                out.append((f"{name}.{node.name}", ids))
                break
        if len(out) == n:
            break
    return out


def run(label: str, prompts, warm, new: int, window: int | None, adaptive: bool, threads: int,
        want=None):
    """One engine for the configuration; `warm` (another file) runs first, so the cost model
    has measured plain and drafting steps and the draft's feed cost, as in a server that has
    been running; then each prompt alone (a new file: nothing of it cached). Yields (row,
    output ids) per prompt."""
    kw = {} if window is None else dict(speculative_method="draft", draft_model=DRAFT,
                                        num_speculative_tokens=4, spec_draft_window=window)
    llm = LLM(TARGET, device="cpu", max_model_len=4096, cpu_threads=threads, **kw)
    eng, spec = llm.engine, llm.engine.spec
    if spec is not None and not adaptive:
        pin(spec, "chain")
    fed = []
    if spec is not None:
        execute = spec.proposer.runner.execute

        def spy(inp, probe=None):
            fed.append(int(inp.host.q_lens.sum()))
            return execute(inp, probe)
        spec.proposer.runner.execute = spy
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate([{"prompt_token_ids": warm[1]}], params, use_tqdm=False)
    for name, ids in prompts:
        first, out = [], None
        fed.clear()
        before = (spec.stats.num_verify_steps, spec.stats.num_accepted_tokens) if spec else (0, 0)
        t = time.perf_counter()
        eng.add_request(None, ids, params)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if not first and o.outputs[0].token_ids:
                    first.append(time.perf_counter())
                if o.finished:
                    out = o
        wall = time.perf_counter() - t
        toks = list(out.outputs[0].token_ids)
        row = {"config": label, "prompt": name, "prompt_tokens": len(ids), "wall_s": round(wall, 2),
               "ttft_s": round(first[0] - t, 2),
               "decode_tok_s": round((len(toks) - 1) / max(t + wall - first[0], 1e-9), 2)}
        if spec is not None:
            verify = spec.stats.num_verify_steps - before[0]
            acc = spec.stats.num_accepted_tokens - before[1]
            row.update(verify_steps=verify, accepted=acc,
                       tokens_per_verify=round((acc + verify) / verify, 3) if verify else None,
                       draft_rows_fed=sum(fed), draft_first_feed=fed[0] if fed else 0)
        if want is not None:
            row["equal_to_plain"] = toks == want[name]
        print(row, flush=True)
        yield row, toks
    del llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", default="128,512")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--min-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=2500)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--adaptive", action="store_true", help="the engine's own drafting choices")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "draft_window.json"))
    a = ap.parse_args()
    tok = LLM(DRAFT, device="cpu", max_model_len=256).get_tokenizer()
    prompts = build_prompts(tok, a.prompts + 1, a.min_tokens, a.max_tokens)
    prompts, warm = prompts[:-1], prompts[-1]
    results = {"env": env_info(), "target": TARGET, "draft": DRAFT, "new": a.new,
               "adaptive": a.adaptive, "prompts": [(n, len(i)) for n, i in prompts],
               "warm_up": (warm[0], len(warm[1])), "rows": []}
    want = {}
    for row, toks in run("plain", prompts, warm, a.new, None, a.adaptive, a.threads):
        want[row["prompt"]] = toks
        results["rows"].append(row)
    for w in [0] + [int(x) for x in a.windows.split(",") if x]:
        label = f"draft chain k4, window {w or 'off'}" + (" adaptive" if a.adaptive else "")
        for row, _ in run(label, prompts, warm, a.new, w, a.adaptive, a.threads, want):
            results["rows"].append(row)
        write_json(a.out, results)
    by = {}
    for r in results["rows"]:
        by.setdefault(r["config"], []).append(r)
    results["summary"] = []
    for label, rs in by.items():
        n = len(rs)
        mean = {f: round(sum(r[f] for r in rs) / n, 2) for f in ("wall_s", "ttft_s", "decode_tok_s")}
        if "tokens_per_verify" in rs[0]:
            tpv = [r["tokens_per_verify"] for r in rs if r["tokens_per_verify"] is not None]
            mean["verify_steps"] = sum(r["verify_steps"] for r in rs)
            mean["tokens_per_verify"] = round(sum(tpv) / len(tpv), 2) if tpv else None
            mean["all_equal_to_plain"] = all(r["equal_to_plain"] for r in rs)
        results["summary"].append({"config": label, **mean})
        print(results["summary"][-1])
    write_json(a.out, results)


if __name__ == "__main__":
    main()
