"""The `luceio` console script: `luceio serve [MODEL] [options]`, `luceio stage [MODEL]
[options]`, one pipeline stage on another machine (`stages/worker.py`), and `luceio
calibrate-experts --model M --prompts FILE --out placement.json`, which counts each sparse
layer's expert choices over the prompts for `--expert-placement` (`models/expert_offload.py`)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from . import __version__
    from .server.args import make_parser
    from .stages.worker import make_parser as make_stage_parser

    parser = argparse.ArgumentParser(prog="luceio", description="luceio: LLM inference")
    parser.add_argument("--version", action="version", version=f"luceio {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    make_parser(sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                               description="OpenAI-compatible server: /v1/completions, "
                               "/v1/chat/completions, /v1/models, /health, /metrics"))
    make_stage_parser(sub.add_parser("stage", help="run one pipeline stage of an engine on "
                                     "several machines (--world-size, --rank)"))
    make_calibrate_parser(sub.add_parser(
        "calibrate-experts", help="count a mixture-of-experts model's expert choices over "
        "prompts and write a placement file for --expert-placement"))
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        from .serve import serve
        return serve(ns)
    if ns.command == "stage":
        from .stages.worker import run_stage
        return run_stage(ns)
    if ns.command == "calibrate-experts":
        try:
            return calibrate_experts(ns)
        except (OSError, ValueError) as e:
            print(f"luceio calibrate-experts: {e}", file=sys.stderr)
            return 2
    parser.error(f"unknown command {ns.command!r}")
    return 2


def make_calibrate_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from .config import EngineArgs
    parser.add_argument("--prompts", required=True, help="prompts: a text file, one prompt "
                        "per line, or a .jsonl file of {\"prompt\": text}, {\"prompt_token_ids\": "
                        "[...]} or {\"messages\": [...]} (rendered with the chat template)")
    parser.add_argument("--out", required=True, help="the placement file to write (JSON)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per "
                        "prompt (greedy) after its prefill; every token computed is counted "
                        "(1: the prompts only)")
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))
    return parser


def calibrate_experts(ns: argparse.Namespace) -> int:
    """Runs the prompts (prefix caching off, so every prompt token is computed; eager, so
    every forward is seen) and writes each sparse layer's experts by count."""
    import dataclasses
    import json

    from . import LLM, SamplingParams
    from .config import EngineArgs
    from .models.expert_calibration import count_experts, placement
    args = dataclasses.replace(EngineArgs.from_cli_args(ns), enable_prefix_caching=False,
                               enforce_eager=True)
    prompts = read_prompts(ns.prompts)
    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, ignore_eos=True)
    with count_experts(llm.engine.runner.model) as counts:
        chats = [p["messages"] for p in prompts if "messages" in p]
        plain = [p for p in prompts if "messages" not in p]
        if plain:
            llm.generate(plain, params, use_tqdm=False)
        if chats:
            llm.chat(chats, params, use_tqdm=False)
    with open(ns.out, "w") as f:
        json.dump(placement(counts, args.model), f, indent=1)
    pairs = sum(int(c.sum()) for c in counts.values())
    print(f"{len(prompts)} prompts, {pairs} (token, expert) choices over {len(counts)} sparse "
          f"layers -> {ns.out}")
    return 0


def read_prompts(path: str) -> list[dict]:
    """The --prompts file as engine prompts ({"prompt": ...}, {"prompt_token_ids": ...} or
    {"messages": ...}); ValueError for an empty file or a bad line."""
    import json
    with open(path) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    if not path.endswith(".jsonl"):
        prompts = [{"prompt": line} for line in lines]
    else:
        prompts = [json.loads(line) for line in lines]
        for n, p in enumerate(prompts, 1):
            if not isinstance(p, dict) or len(p.keys() & {"prompt", "prompt_token_ids",
                                                          "messages"}) != 1:
                raise ValueError(f"{path} line {n}: give one of prompt, prompt_token_ids, "
                                 "messages")
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


if __name__ == "__main__":
    sys.exit(main())
