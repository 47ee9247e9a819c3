"""Server options: one frozen dataclass whose fields' `help` metadata become the CLI flags, next
to `EngineArgs`' own (one source of truth for `python -m luceio.serve` and `luceio serve`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..config import CliArgs, EngineArgs, _opt


@dataclass(frozen=True)
class ServerArgs(CliArgs):
    host: str = _opt("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = _opt(8000, "TCP port to listen on")
    served_model_name: str | None = _opt(None, "model name the API reports and accepts; "
                                         "default the --model value")
    api_key: str | None = _opt(None, "require `Authorization: Bearer KEY` on every route but "
                               "/health (default: the LUCEIO_API_KEY environment variable)")
    max_request_bytes: int = _opt(4 << 20, "largest request body accepted, in bytes (413 above)")
    max_tokens_cap: int | None = _opt(None, "upper bound on any request's max_tokens (requests "
                                      "asking for more, or for no limit, get this many)")
    log_level: str = _opt("info", "log level", choices=["critical", "error", "warning", "info",
                                                         "debug"])
    access_log: bool = _opt(True, "log one line per HTTP request (uvicorn's access log)")
    timeout_graceful_shutdown: int = _opt(30, "seconds to wait for open connections on "
                                          "SIGINT/SIGTERM before cancelling them")



def make_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The serve options: `[MODEL]` positional (same as --model), then server and engine flags."""
    parser = parser or argparse.ArgumentParser(
        prog="python -m luceio.serve", description="OpenAI-compatible luceio server")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model to serve (same as --model)")
    ServerArgs.add_cli_args(parser.add_argument_group("server"))
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))
    return parser


def parse_args(ns: argparse.Namespace) -> tuple[ServerArgs, EngineArgs]:
    if ns.model_tag is not None:
        ns.model = ns.model_tag
    return ServerArgs.from_cli_args(ns), EngineArgs.from_cli_args(ns)
