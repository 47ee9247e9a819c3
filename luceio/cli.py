"""The `luceio` console script: `luceio serve [MODEL] [options]`, and `luceio stage [MODEL]
[options]`, one pipeline stage on another machine (`stages/worker.py`)."""
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
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        from .serve import serve
        return serve(ns)
    if ns.command == "stage":
        from .stages.worker import run_stage
        return run_stage(ns)
    parser.error(f"unknown command {ns.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
