"""Editor-assistant latency on the CPU: the real Qwen2.5-Coder-0.5B GGUF (`--model` for
another), each request taken through the server's own path in-process (the OpenAI body parsed
by `luceio.server.protocol`, run by the AsyncEngine, shaped by the response builder; no HTTP).
On a GPU (`--random-shape qwen2.5-1.5b --tokenizer DIR`): random Q4_K_M-typed weights at that
shape (bench/decode_gguf.py's, through the load path) with the real model's tokenizer, chat
template and FIM tokens, exported once from its GGUF by `--export-tokenizer DIR` (the weights
cannot travel to the lent GPU); the token counts and cache hits are the real ones, the replies
are noise (the tool calls and JSON still follow their grammars).

(a) Fill-in-the-middle (`suffix` on /v1/completions) on a ~4K-token source file (a Python
    standard-library module): cold (nothing of it cached), warm (the same file with a second edit
    a few lines below the first, cursor there: the cache holds the file up to the first edit),
    and the warm request repeated. Prompt tokens, cached tokens and TTFT of each.
(b) Structured output: decode tok/s of a chat reply constrained by a JSON schema
    (`response_format`) against the same prompt unconstrained for as many tokens (ignore_eos),
    greedy, runs alternating, the best run of each side counted (the CPU is shared); the reply
    is checked against the schema.
(c) An agent transcript: a system prompt with a source file, then turns of tool calls
    (`tool_choice` "required", so every turn calls read_lines), each call's result sent back as a
    tool message: per turn, prompt tokens, cached tokens and TTFT.

TTFT is the engine's own (first token time - arrival), as the server logs it. Writes
bench/results/cpu/assist.json.

    python bench/assist.py [--quick] [--threads N] [--sections fim,structured,agent]
        [--turns N] [--agent-context TOKENS] [--out FILE]
    python bench/assist.py --export-tokenizer .models/qwen2.5-coder-tok   # here, once
    python bench/assist.py --random-shape qwen2.5-1.5b --tokenizer .models/qwen2.5-coder-tok \
        --out bench/results/h200/assist.json                                # on the GPU
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import inspect
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, run_sections  # noqa: E402

from luceio import AsyncEngine, EngineArgs  # noqa: E402
from luceio.loader.resolve import resolve_model  # noqa: E402
from luceio.server.app import ServerState  # noqa: E402
from luceio.server.args import ServerArgs  # noqa: E402
from luceio.server.protocol import parse_chat, parse_completion  # noqa: E402
from luceio.server.responses import ResponseBuilder  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "cpu", "assist.json")
FILE_TOKENS = 4096  # the source file for (a), cut to about this many tokens
SCHEMA = {"type": "object", "properties": {
    "file": {"type": "string"}, "line": {"type": "integer", "minimum": 1},
    "severity": {"enum": ["info", "warning", "error"]},
    "message": {"type": "string", "maxLength": 160}},
    "required": ["file", "line", "severity", "message"], "additionalProperties": False}
SCHEMA_PROMPT = ("Review this line of wrap.py (line 250) and answer as JSON with file, line, "
                 "severity and message: `chunks.reverse()`")
READ_LINES = {"type": "function", "function": {
    "name": "read_lines", "description": "Read lines of a file of the repository",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"}},
        "required": ["path", "start", "end"]}}}


class Bench:
    def __init__(self, threads: int | None, max_model_len: int = 8192,
                 model: str = "qwen2.5-coder-0.5b", random_shape: str | None = None,
                 tokenizer: str | None = None):
        self.gpu = bool(random_shape)
        if random_shape:
            self.engine = AsyncEngine(random_engine(random_shape, tokenizer, max_model_len))
        else:
            args = EngineArgs(model=resolve_model(model), device="cpu",
                              max_model_len=max_model_len, cpu_threads=threads)
            self.engine = AsyncEngine.from_engine_args(args)
        self.state = ServerState(self.engine, ServerArgs())
        self.tok = self.state.ctx.tokenizer
        self.count = 0

    async def call(self, parse, body: dict) -> tuple[dict, dict]:
        """The OpenAI response to `body` and the request's engine timings."""
        req = parse(body, self.state.ctx)
        builder = ResponseBuilder(req, self.tok)
        self.count += 1
        async for out in self.engine.generate(req.prompts[0], req.params[0], f"b{self.count}"):
            builder.step(0, out)
            m = out.metrics
        builder.end()
        decoded = m.num_generated_tokens - 1
        decode_s = m.finished_time - m.first_token_time
        return builder.response(), {
            "prompt_tokens": m.num_prompt_tokens, "cached_tokens": m.num_cached_tokens,
            "ttft_s": round(m.first_token_time - m.arrival_time, 3),
            "completion_tokens": m.num_generated_tokens,
            "decode_tok_s": round(decoded / decode_s, 2) if decoded > 0 else None}


TOKENIZER_FILES = ("tokenizer_config", "generation_config", "config")


def export_tokenizer(model: str, folder: str) -> None:
    """The tokenizer of `model`'s GGUF (its vocabulary, chat template, special tokens) as
    tokenizer.json plus the three JSON configs `luceio.tokenizer.Tokenizer` reads."""
    from luceio.loader.gguf import load_gguf
    ckpt = load_gguf(resolve_model(model))
    os.makedirs(folder, exist_ok=True)
    ckpt.tokenizer.save(os.path.join(folder, "tokenizer.json"))
    for name, data in zip(TOKENIZER_FILES, (ckpt.tokenizer_config, ckpt.generation_config,
                                            ckpt.config)):
        with open(os.path.join(folder, name + ".json"), "w") as f:
            json.dump(data, f)


def load_tokenizer(folder: str):
    """The tokenizer `export_tokenizer` wrote to `folder`."""
    import tokenizers
    from luceio.tokenizer import Tokenizer
    configs = []
    for name in TOKENIZER_FILES:
        with open(os.path.join(folder, name + ".json")) as f:
            configs.append(json.load(f))
    return Tokenizer(tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json")),
                     *configs)


def random_engine(shape: str, folder: str, max_model_len: int):
    """An LLMEngine on CUDA over random Q4_K_M-typed weights at `shape`, with the tokenizer
    `export_tokenizer` wrote to `folder`."""
    from decode_gguf import random_model
    from luceio import LLMEngine
    tok = load_tokenizer(folder)
    model = random_model(shape, "Q4_K_M", max_model_len + 512)
    args = EngineArgs(model=f"random-{shape}", dtype="bfloat16", device="cuda",
                      max_model_len=max_model_len, max_num_seqs=8)
    return LLMEngine(args, model=model, tokenizer=tok)


# (a) ---------------------------------------------------------------------------------------------
def source_lines(tok, target: int) -> tuple[str, list[str]]:
    """Standard-library source, about `target` tokens of it: textwrap.py's first lines, or past
    its length further modules appended whole (argparse, then json.decoder, ...)."""
    import argparse as m1
    import json.decoder as m2
    import textwrap
    import typing as m3
    lines: list[str] = []
    paths = []
    for module in (textwrap, m1, m2, m3):
        path = inspect.getsourcefile(module)
        with open(path) as f:
            lines += f.read().splitlines(keepends=True)
        paths.append(path)
        if len(tok.encode("".join(lines), add_special_tokens=False)) > target:
            break
    while len(tok.encode("".join(lines), add_special_tokens=False)) > target:
        lines = lines[:int(len(lines) * 0.95)]
    return ", ".join(paths), lines


async def bench_fim(b: Bench, out: dict) -> None:
    path, lines = source_lines(b.tok, FILE_TOKENS)
    text = "".join(lines)
    mid = len(lines) // 2
    edit = "    if not text:\n        return text\n"

    def fim(prefix: str, suffix: str) -> dict:
        return {"prompt": prefix, "suffix": suffix, "max_tokens": 8, "temperature": 0}

    # warm-up (one-off compilation), on text that shares no block with the file; on a GPU,
    # where Triton compiles kernels per shape class on first use, a cold request of the file's
    # size, then one that finds part of it cached, as the measured ones do
    await b.call(parse_completion, fim("import json\n" * 200, "\n"))
    if b.gpu:
        warm = ["# warm-up\n"] + lines  # its first line differs, so no block is shared
        await b.call(parse_completion, fim("".join(warm[:mid]) + edit, "".join(warm[mid:])))
        await b.call(parse_completion, fim("".join(warm[:mid]) + edit +
                                           "".join(warm[mid:mid + 5]) + edit,
                                           "".join(warm[mid + 5:])))
    first = fim("".join(lines[:mid]) + edit, "".join(lines[mid:]))
    second = fim("".join(lines[:mid]) + edit + "".join(lines[mid:mid + 5]) + edit,
                 "".join(lines[mid + 5:]))
    out.update(file=os.path.basename(path), file_sha256=hashlib.sha256(text.encode()).hexdigest(),
               file_lines=len(lines),
               file_tokens=len(b.tok.encode(text, add_special_tokens=False)), edit_line=mid)
    rows = {}
    for name, body in (("cold", first), ("warm", second), ("repeat", second)):
        rows[name] = (await b.call(parse_completion, body))[1]
        print(f"fim {name}: {json.dumps(rows[name])}", flush=True)
    out["requests"] = rows
    out["warm_over_cold_ttft"] = round(rows["warm"]["ttft_s"] / rows["cold"]["ttft_s"], 3)


# (b) ---------------------------------------------------------------------------------------------
async def bench_schema(b: Bench, out: dict, repeats: int, max_tokens: int) -> None:
    import jsonschema
    chat = {"messages": [{"role": "user", "content": SCHEMA_PROMPT}], "temperature": 0,
            "max_tokens": max_tokens}
    constrained = {**chat, "response_format": {"type": "json_schema", "json_schema": {
        "name": "files", "schema": SCHEMA}}}
    await b.call(parse_chat, constrained)  # warm-up: grammar compilation, the prompt cached
    runs = {"constrained": [], "unconstrained": []}
    for _ in range(repeats):
        reply, timing = await b.call(parse_chat, constrained)
        runs["constrained"].append(timing)
        plain = {**chat, "max_tokens": timing["completion_tokens"], "ignore_eos": True}
        runs["unconstrained"].append((await b.call(parse_chat, plain))[1])
    content = reply["choices"][0]["message"]["content"]
    try:
        jsonschema.validate(json.loads(content), SCHEMA)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    best = {k: max(r["decode_tok_s"] for r in v) for k, v in runs.items()}
    out.update(schema=SCHEMA, prompt=SCHEMA_PROMPT, reply=content, reply_valid=valid,
               finish_reason=reply["choices"][0]["finish_reason"],
               tokens_per_request=runs["constrained"][-1]["completion_tokens"],
               **{f"{k}_tok_s": v for k, v in best.items()},
               ratio=round(best["constrained"] / best["unconstrained"], 3),
               runs_tok_s={k: [r["decode_tok_s"] for r in v] for k, v in runs.items()})
    print(f"schema: {json.dumps({k: out[k] for k in ('ratio', 'reply_valid')})}", flush=True)


# (c) ---------------------------------------------------------------------------------------------
async def bench_agent(b: Bench, out: dict, turns: int, context: int = 1024) -> None:
    _, lines = source_lines(b.tok, context)
    system = ("You are a coding agent working in a repository. Call read_lines to read what you "
              "need. The file under review, wrap.py:\n\n" + "".join(lines))
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Find where wrap.py splits long words and explain "
                                            "the rule."}]
    rows = []
    for turn in range(turns):
        body = {"messages": messages, "tools": [READ_LINES], "tool_choice": "required",
                "temperature": 0, "max_tokens": 64}
        reply, timing = await b.call(parse_chat, body)
        message = reply["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        timing["tool_calls"] = [c["function"]["name"] for c in calls]
        timing["new_tokens"] = timing["prompt_tokens"] - timing["cached_tokens"]
        rows.append(timing)
        print(f"agent turn {turn + 1}: {json.dumps(timing)}", flush=True)
        messages = messages + [message] + [
            {"role": "tool", "tool_call_id": c["id"], "content": _read_lines(lines, c)}
            for c in calls]
    out.update(turns=rows, system_prompt_tokens=len(b.tok.encode(system, False)),
               cached_share_after_first=[
                   round(r["cached_tokens"] / r["prompt_tokens"], 3) for r in rows[1:]])


def _read_lines(lines: list[str], call: dict) -> str:
    """The tool's answer: the lines the call asked for (a few lines when its arguments are off)."""
    try:
        args = json.loads(call["function"]["arguments"])
        start, end = max(int(args["start"]), 1), int(args["end"])
    except (ValueError, KeyError, TypeError):
        start, end = 1, 5
    return "".join(lines[start - 1:min(end, start + 19)]) or "(no such lines)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer runs: under ~8 minutes on 2 cores")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (engine default)")
    ap.add_argument("--sections", default="fim,structured,agent")
    ap.add_argument("--turns", type=int, default=None, help="agent turns (default 4, quick; 6)")
    ap.add_argument("--agent-context", type=int, default=1024,
                    help="tokens of source in the agent's system prompt (the shared prefix)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b",
                    help="a short name (MODELS.md) or a GGUF path")
    ap.add_argument("--random-shape", default=None,
                    help="on CUDA: random Q4_K_M weights at this shape (bench/decode_gguf.py)")
    ap.add_argument("--tokenizer", default=None,
                    help="with --random-shape: the folder --export-tokenizer wrote")
    ap.add_argument("--export-tokenizer", default=None, metavar="DIR",
                    help="write --model's tokenizer to DIR and exit")
    ap.add_argument("--out", default=RESULTS)
    a = ap.parse_args()
    if a.export_tokenizer:
        export_tokenizer(a.model, a.export_tokenizer)
        return
    if a.random_shape and not a.tokenizer:
        raise SystemExit("--random-shape needs --tokenizer (a folder --export-tokenizer wrote)")
    repeats, decode_tokens, turns = (3, 128, 4) if a.quick else (6, 128, 6)
    turns = a.turns or turns
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(__file__)).stdout.strip()
    results = {"env": env_info(), "git_head": head, "quick": a.quick,
               "model": (f"random Q4_K_M weights at the {a.random_shape} shape, the tokenizer of "
                         f"{a.tokenizer}" if a.random_shape else f"{a.model} (GGUF)"),
               "cores": os.cpu_count(),
               "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}

    async def run() -> None:
        t = time.perf_counter()
        b = Bench(a.threads, max(8192, a.agent_context + 4096), a.model, a.random_shape,
                  a.tokenizer)
        results["load_s"] = round(time.perf_counter() - t, 1)
        results["torch_threads"] = torch.get_num_threads()
        loop = asyncio.get_running_loop()
        sections = [("fim", bench_fim, ()), ("structured", bench_schema, (repeats, decode_tokens)),
                    ("agent", bench_agent, (turns, a.agent_context))]
        sections = [x for x in sections if x[0] in a.sections.split(",")]
        todo = []
        for name, fn, extra in sections:
            results[name] = {}

            def section(fn=fn, name=name, extra=extra) -> None:
                asyncio.run_coroutine_threadsafe(fn(b, results[name], *extra), loop).result()
            todo.append((name, section))
        await loop.run_in_executor(None, run_sections, todo, results, a.out)
        await b.engine.shutdown()

    asyncio.run(run())


if __name__ == "__main__":
    main()
