"""`python -m luceio.serve [MODEL] [options]`: the OpenAI-compatible server.

One process, one event loop (uvloop when it imports): uvicorn serves the Starlette app from
`luceio.server.app.build_app` and the AsyncEngine steps on the same loop. SIGINT/SIGTERM run
uvicorn's graceful shutdown: in-flight requests are aborted at once (streams send their final
chunk and `[DONE]`), open connections drain, the lifespan shuts the engine down, and the process
exits 0. Options: `python -m luceio.serve --help` (server flags from `ServerArgs`, engine flags
from `EngineArgs`)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys

import uvicorn

from .config import EngineArgs
from .server.args import ServerArgs, make_parser, parse_args

logger = logging.getLogger("luceio.server")


def main(argv: list[str] | None = None) -> int:
    server_args, engine_args = parse_args(make_parser().parse_args(argv))
    return run(server_args, engine_args)


def run(server_args: ServerArgs, engine_args: EngineArgs) -> int:
    _setup_logging(server_args.log_level)
    if server_args.api_key is None and os.environ.get("LUCEIO_API_KEY"):
        server_args = dataclasses.replace(server_args, api_key=os.environ["LUCEIO_API_KEY"])

    from .async_engine import AsyncEngine
    from .server.app import build_app
    from .server.http import http_protocol

    engine = AsyncEngine.from_engine_args(engine_args)
    app = build_app(engine, server_args)
    config = uvicorn.Config(
        app, host=server_args.host, port=server_args.port, loop=_loop_name(), lifespan="on",
        http=http_protocol(),
        log_config=None, log_level=server_args.log_level, access_log=server_args.access_log,
        timeout_graceful_shutdown=server_args.timeout_graceful_shutdown)
    server = _Server(config, app.state.server)
    # uvicorn re-raises the signal that stopped it once it is done; it must not kill the process
    # (exit status -15) or raise KeyboardInterrupt after a clean shutdown.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401
        return "uvloop"
    except ImportError:
        return "asyncio"


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("luceio").setLevel(level.upper())


class _Server(uvicorn.Server):
    """uvicorn's server, aborting in-flight requests as soon as a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None and not self.loop.is_closed():
            logger.info("signal %d: aborting %d in-flight requests, shutting down", sig,
                        len(self.state.inflight))
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.state.drain()))


if __name__ == "__main__":
    sys.exit(main())
