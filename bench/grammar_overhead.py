"""Per-token cost of grammar masks, xgrammar vs llguidance, on the real Qwen2.5-Coder-0.5B
tokenizer (151,936 ids). For each JSON schema a valid document is tokenized, then walked token by
token: fill the next-token bitmask, accept the token — what a constrained decode step adds on the
host. Also the one-off costs: the tokenizer description and each grammar's compilation.
Then (`--decode`) luceio's greedy decode tok/s on the real model, constrained by a JSON schema
against unconstrained decoding of as many tokens, at batch 1 and 8 (the goal: >= 0.9x), runs
alternating and the best of each side counted (the CPU is shared); and the host cost a
constrained step adds, measured alone: filling the masks and applying them to the logits.
Writes bench/results/cpu/grammar_overhead.json. Needs llguidance too (`pip install llguidance`),
which luceio itself does not depend on.

    python bench/grammar_overhead.py [--repeats 5] [--threads 1] [--decode]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, timed_decode, write_json  # noqa: E402

from luceio.loader.gguf import load_gguf  # noqa: E402
from luceio.loader.resolve import resolve_model  # noqa: E402

# (schema, a valid instance): flat, nested with arrays, enums and patterns, a tool call
SCHEMAS = {
    "flat": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"}}, "required": ["name", "age", "email"],
        "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"}),
    "nested_arrays": ({"type": "object", "properties": {
        "project": {"type": "string"},
        "files": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
            "type": "object", "properties": {
                "path": {"type": "string"}, "lines": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["path", "lines"]}}},
        "required": ["project", "files"]},
        {"project": "luceio", "files": [
            {"path": "luceio/engine.py", "lines": 393, "tags": ["core", "step"]},
            {"path": "luceio/sampler.py", "lines": 175, "tags": ["sampling"]},
            {"path": "luceio/structured.py", "lines": 200, "tags": []}]}),
    "enum_pattern": ({"type": "object", "properties": {
        "level": {"enum": ["debug", "info", "warning", "error"]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "retry": {"type": "boolean"}}, "required": ["level", "code", "ratio", "retry"]},
        {"level": "warning", "code": "ABC-1234", "ratio": 0.25, "retry": True}),
    "tool_call": ({"type": "object", "properties": {
        "name": {"const": "read_file"},
        "arguments": {"type": "object", "properties": {
            "path": {"type": "string"}, "start_line": {"type": "integer"},
            "end_line": {"type": "integer"}}, "required": ["path"]}},
        "required": ["name", "arguments"]},
        {"name": "read_file", "arguments": {"path": "src/main.rs", "start_line": 10,
                                            "end_line": 42}}),
}


def _tool(i: int) -> dict:
    return {"type": "object", "properties": {
        "name": {"const": f"tool_{i}"},
        "arguments": {"type": "object", "properties": {
            "path": {"type": "string"}, "query": {"type": "string"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            "mode": {"enum": ["read", "write", "append"]},
            "flags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
            "required": ["path", "mode"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False}


# an agent's request: one call to any of 12 tools (the grammar a tool_choice "required" compiles)
SCHEMAS["tools_12"] = ({"anyOf": [_tool(i) for i in range(12)]},
                       {"name": "tool_7", "arguments": {"path": "a/b.py", "limit": 20,
                                                        "mode": "append", "flags": ["x", "y"]}})


def qwen_tokenizer():
    ckpt = load_gguf(resolve_model("qwen2.5-coder-0.5b"))
    eos = ckpt.generation_config["eos_token_id"]
    return ckpt.tokenizer, ckpt.config["vocab_size"], [eos] if isinstance(eos, int) else eos


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int, eos: list[int], threads: int):
        import transformers
        import xgrammar as xgr
        self.xgr = xgr
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=(",", ":"))

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, m) -> None:
        m.fill_next_token_bitmask(self.bitmask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, eos: list[int], threads: int):
        import llguidance as llg
        import llguidance.numpy as llg_np
        self.llg, self.llg_np = llg, llg_np
        self.tokenizer = llg.LLTokenizer(hf_tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.bitmask = llg_np.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False})
        self.llg.LLMatcher(self.tokenizer, grammar)  # parses and checks the grammar
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def fill(self, m) -> None:
        self.llg_np.fill_next_token_bitmask(m, self.bitmask)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)


def walk(lib, grammar, tokens: list[int]) -> tuple[list[float], list[float]]:
    """Fill + accept for every token of a valid document, then the end token; seconds each."""
    m = lib.matcher(grammar)
    fills, accepts = [], []
    for tok in tokens:
        t0 = time.perf_counter()
        lib.fill(m)
        t1 = time.perf_counter()
        ok = lib.accept(m, tok)
        t2 = time.perf_counter()
        if not ok:
            raise AssertionError(f"{lib.name} rejected token {tok} of a valid document")
        fills.append(t1 - t0)
        accepts.append(t2 - t1)
    return fills, accepts


def bench_library(cls, hf_tokenizer, vocab_size: int, eos: list[int], repeats: int,
                  threads: int) -> dict:
    t = time.perf_counter()
    lib = cls(hf_tokenizer, vocab_size, eos, threads)
    out = {"tokenizer_setup_ms": round((time.perf_counter() - t) * 1e3, 1), "schemas": {}}
    all_steps = []
    for name, (schema, instance) in SCHEMAS.items():
        t = time.perf_counter()
        grammar = lib.compile(schema)
        compile_ms = (time.perf_counter() - t) * 1e3
        tokens = hf_tokenizer.encode(json.dumps(instance, separators=(",", ":")),
                                     add_special_tokens=False).ids
        steps = []
        fills, accepts = [], []
        for _ in range(repeats):
            f, a = walk(lib, grammar, tokens)
            fills += f
            accepts += a
            steps += [x + y for x, y in zip(f, a)]
        all_steps += steps
        out["schemas"][name] = {
            "compile_ms": round(compile_ms, 1), "tokens": len(tokens),
            "fill_us_mean": round(statistics.mean(fills) * 1e6, 1),
            "accept_us_mean": round(statistics.mean(accepts) * 1e6, 1),
            "step_us_p50": round(float(np.percentile(steps, 50)) * 1e6, 1),
            "step_us_p99": round(float(np.percentile(steps, 99)) * 1e6, 1)}
    out["step_us_mean_all"] = round(statistics.mean(all_steps) * 1e6, 1)
    out["step_us_p99_all"] = round(float(np.percentile(all_steps, 99)) * 1e6, 1)
    return out


DECODE_SCHEMA = {"type": "object", "properties": {
    "files": {"type": "array", "minItems": 6, "maxItems": 8, "items": {
        "type": "object", "properties": {"path": {"type": "string"},
                                         "language": {"enum": ["python", "rust", "go", "c"]},
                                         "lines": {"type": "integer"}},
        "required": ["path", "language", "lines"]}}},
    "required": ["files"]}
DECODE_PROMPT = ("List the files of a small web service as JSON: for each its path, language "
                 "and number of lines.")


def _decode_tok_s(llm, ids: list[int], params, batch: int) -> tuple[float, int]:
    """Decode tok/s of `batch` copies of the request (the prefill step excluded), and the
    tokens each request generated."""
    for i in range(batch):
        llm.engine.add_request(f"d{i}", {"prompt_token_ids": ids}, params)
    steps, seconds = timed_decode(llm.engine)
    return batch * steps / seconds, steps + 1


def apply_ms(vocab_size: int, batch: int, threads: int, repeats: int = 20) -> float:
    """Milliseconds to apply `batch` rows of a grammar bitmask to fp32 logits."""
    import torch

    from luceio.structured import apply_token_bitmask
    torch.set_num_threads(threads)
    logits = torch.randn(batch, vocab_size)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (batch, (vocab_size + 31) // 32),
                            dtype=torch.int32)
    apply_token_bitmask(logits, bitmask)
    t = time.perf_counter()
    for _ in range(repeats):
        apply_token_bitmask(logits, bitmask)
    return (time.perf_counter() - t) / repeats * 1e3


def bench_decode(repeats: int, threads: int, max_tokens: int) -> dict:
    """Constrained (the schema, greedy) and unconstrained (ignore_eos, as many tokens) runs
    alternate; each side's best run counts."""
    from luceio import LLM, SamplingParams
    from luceio.sampling_params import StructuredOutputsParams
    llm = LLM(resolve_model("qwen2.5-coder-0.5b"), max_model_len=2048, cpu_threads=threads)
    tok = llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": DECODE_PROMPT}]),
                     add_special_tokens=False)
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=DECODE_SCHEMA))
    llm.generate([{"prompt_token_ids": ids}], constrained, use_tqdm=False)  # warm-up, compile
    out = {"schema": DECODE_SCHEMA, "threads": threads}
    for batch in (1, 8):
        runs = {"constrained": [], "unconstrained": []}
        num_tokens = None
        for _ in range(repeats):
            tput, num_tokens = _decode_tok_s(llm, ids, constrained, batch)
            runs["constrained"].append(tput)
            plain = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
            runs["unconstrained"].append(_decode_tok_s(llm, ids, plain, batch)[0])
        best = {k: max(v) for k, v in runs.items()}
        out[f"batch_{batch}"] = {
            "tokens_per_request": num_tokens,
            "bitmask_apply_ms_per_step": round(apply_ms(llm.engine.runner.cfg.vocab_size, batch,
                                                        threads), 3),
            **{f"{k}_tok_s": round(v, 2) for k, v in best.items()},
            "ratio": round(best["constrained"] / best["unconstrained"], 3),
            "runs_tok_s": {k: [round(x, 2) for x in v] for k, v in runs.items()}}
        print(f"batch {batch}", json.dumps(out[f"batch_{batch}"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="xgrammar compiler threads; torch threads for --decode")
    ap.add_argument("--decode", action="store_true", help="also measure decode tok/s")
    ap.add_argument("--decode-repeats", type=int, default=5, help="runs of each side")
    ap.add_argument("--decode-tokens", type=int, default=96, help="tokens per request")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "grammar_overhead.json"))
    args = ap.parse_args()
    hf_tokenizer, vocab_size, eos = qwen_tokenizer()
    results = {"env": env_info(), "tokenizer": "qwen2.5-coder-0.5b (GGUF)",
               "vocab_size": vocab_size, "repeats": args.repeats, "libraries": {}}
    for cls in (XGrammar, LLGuidance):
        results["libraries"][cls.name] = r = bench_library(cls, hf_tokenizer, vocab_size, eos,
                                                           args.repeats, args.threads)
        print(cls.name, json.dumps(r, indent=1))
    if args.decode:
        results["decode_qwen2.5-coder-0.5b"] = bench_decode(args.decode_repeats, args.threads,
                                                             args.decode_tokens)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
