"""Server options: one frozen dataclass whose fields' `help` metadata become the CLI flags, next
to `EngineArgs`' own (one source of truth for `python -m luceio.serve` and `luceio serve`)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from ..config import CliArgs, EngineArgs, _opt
from .reasoning import REASONING_PARSER_CHOICES
from .tool_parsers import TOOL_PARSER_CHOICES


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
    timeout_headers: float = _opt(15.0, "seconds a connection has to send a request's complete "
                                  "headers, counted from the connection's start or, between "
                                  "requests, from the request's first byte (408 and close after; "
                                  "default %(default)s)")
    timeout_body: float = _opt(30.0, "seconds a request body may go without new bytes before the "
                               "server answers 408 and closes the connection (default %(default)s)")
    timeout_keep_alive: float = _opt(5.0, "seconds an idle keep-alive connection stays open "
                                     "between requests (default %(default)s)")
    limit_concurrency: int = _opt(512, "most open client connections; one more is answered 503 "
                                  "and closed at once (keep it under the open-file limit, "
                                  "`ulimit -n`; default %(default)s)")
    allowed_origins: str = _opt("", "comma-separated browser origins whose cross-origin requests "
                                "are allowed (CORS), e.g. http://localhost:3000; `*` for any; "
                                "default none")
    tool_parser: str = _opt("auto", "how tool calls are read from the model's text: auto (from "
                            "the chat template and vocabulary), a format, or none (requests "
                            "with tools answer 400); default %(default)s",
                            choices=list(TOOL_PARSER_CHOICES))
    reasoning_parser: str = _opt("auto", "how `<think>` reasoning is split from the answer into "
                                 "reasoning_content: auto (when the chat template writes "
                                 "`<think>`), a format, or none; default %(default)s",
                                 choices=list(REASONING_PARSER_CHOICES))

    def __post_init__(self):
        if self.api_key is not None and (not self.api_key.strip() or
                                         self.api_key != self.api_key.strip()):
            raise ValueError("--api-key (or LUCEIO_API_KEY) is empty or starts or ends with "
                             "whitespace; give a real key, or leave both unset to serve "
                             "without authentication")
        for name in ("timeout_headers", "timeout_body", "timeout_keep_alive",
                     "limit_concurrency"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}")

    @property
    def origins(self) -> list[str]:
        """--allowed-origins as a list."""
        return [o.strip() for o in self.allowed_origins.split(",") if o.strip()]


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
    """The options; raises ValueError for a combination the server refuses to start with."""
    if ns.model_tag is not None:
        ns.model = ns.model_tag
    if ns.api_key is None:
        ns.api_key = os.environ.get("LUCEIO_API_KEY")
    engine_args = EngineArgs.from_cli_args(ns)
    if engine_args.draft_model and not _uses_draft_model(engine_args):
        raise ValueError("--draft-model is given but nothing would use it: add "
                         "--speculative-method draft (or --spec-prefill-keep, or "
                         "--kv-resident-policy spec with --kv-resident-tokens)")
    return ServerArgs.from_cli_args(ns), engine_args


def _uses_draft_model(args: EngineArgs) -> bool:
    return args.speculative_method == "draft" or args.spec_prefill_keep is not None or \
        (args.kv_resident_policy == "spec" and bool(args.kv_resident_tokens))
