"""`python -m luceio.serve [MODEL] [options]`: the OpenAI-compatible server.

One process, one event loop (uvloop when it imports): uvicorn serves the Starlette app from
`luceio.server.app.build_app` and the AsyncEngine steps on the same loop. SIGINT/SIGTERM run
uvicorn's graceful shutdown: in-flight requests are aborted at once (streams send their final
chunk and `[DONE]`), open connections drain, the lifespan shuts the engine down, and the process
exits 0. A dead engine (a pipeline stage died: `AsyncEngine.failure`) starts the same shutdown
within a tick (0.1 s): the requests in flight get 503 (or an error event, once streaming) with
the reason, and the process exits 1 with it on stderr, for a supervisor to restart it.
Options: `python -m luceio.serve --help` (server flags from `ServerArgs`, engine flags
from `EngineArgs`).

Startup checks the options, binds the port, and only then loads the model; SIGINT/SIGTERM stop
the load. A mistake (bad option, port in use, unknown model, unwritable cache) is one line on
stderr and exit status 1, an interrupted load one line and 128 + the signal number."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import signal
import socket
import sys

import uvicorn

from .config import EngineArgs
from .server.args import ServerArgs, make_parser, parse_args

logger = logging.getLogger("luceio.server")


def main(argv: list[str] | None = None) -> int:
    return serve(make_parser().parse_args(argv))


def serve(ns: argparse.Namespace) -> int:
    """Parsed options → exit status (`python -m luceio.serve` and `luceio serve`)."""
    try:
        server_args, engine_args = parse_args(ns)
    except ValueError as e:
        return _fail(str(e))
    return run(server_args, engine_args)


def run(server_args: ServerArgs, engine_args: EngineArgs) -> int:
    """Binds the port, loads the model, serves until SIGINT/SIGTERM. A startup mistake (port in
    use, unknown model, unwritable cache) is one line on stderr and exit status 1."""
    _setup_logging(server_args.log_level)
    try:
        sock = bind_socket(server_args.host, server_args.port)
    except OSError as e:
        hint = "; is another server running there? Pick another --port or stop it" \
            if e.errno == errno.EADDRINUSE else ""
        return _fail(f"cannot listen on {server_args.host}:{server_args.port} "
                     f"({e.strerror or e}){hint}.")
    with sock:
        host, port = sock.getsockname()[:2]
        logger.info("bound %s:%d; loading the model", host, port)
        try:
            with _interruptible():
                engine = _load(engine_args)
        except KeyboardInterrupt as e:
            sig = e.args[0] if e.args else signal.SIGINT
            print(f"luceio: interrupted ({signal.Signals(sig).name}) while loading the model",
                  file=sys.stderr)
            return 128 + sig
        except _StartupError as e:
            return _fail(str(e))
        server = make_server(engine, server_args)
        # uvicorn re-raises the signal that stopped it once it is done; it must not kill the
        # process (exit status -15) or raise KeyboardInterrupt after a clean shutdown.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        server.run(sockets=[sock])
    if engine.failure is not None:
        return _fail(f"the engine died: {engine.failure}")
    return 0


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening) before the model loads, so a busy port
    fails at once; uvicorn listens on it once the engine is up."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def make_server(engine, server_args: ServerArgs) -> "_Server":
    """uvicorn serving `build_app(engine, server_args)` with the connection limits of
    `server_args`; `.run(sockets=[...])` serves."""
    from .server.app import build_app
    from .server.http import http_protocol

    app = build_app(engine, server_args)
    config = uvicorn.Config(
        app, host=server_args.host, port=server_args.port, loop=_loop_name(), lifespan="on",
        http=http_protocol(server_args), timeout_keep_alive=server_args.timeout_keep_alive,
        log_config=None, log_level=server_args.log_level, access_log=server_args.access_log,
        timeout_graceful_shutdown=server_args.timeout_graceful_shutdown)
    return _Server(config, app.state.server)


class _StartupError(Exception):
    """A mistake in the options or the environment, reported as one line."""


def _load(engine_args: EngineArgs):
    from .async_engine import AsyncEngine
    from .loader.resolve import ModelResolveError

    try:
        return AsyncEngine.from_engine_args(engine_args)
    except (ModelResolveError, OSError, ValueError) as e:
        logger.debug("the engine failed to start", exc_info=True)
        what = "" if isinstance(e, ModelResolveError) else \
            f"cannot load the model {engine_args.model or 'default'!r}: "
        raise _StartupError(f"{what}{e} (--log-level debug shows the traceback)") from None


@contextlib.contextmanager
def _interruptible():
    """SIGINT/SIGTERM raise KeyboardInterrupt(signal number) while the model loads, even where
    the parent left SIGINT ignored (a background job of a script)."""
    def interrupt(sig, frame):
        raise KeyboardInterrupt(sig)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _fail(message: str) -> int:
    print("luceio: error: " + " ".join(message.split()), file=sys.stderr)
    return 1


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

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop polls this every 0.1 s: the one way in to its own shutdown path
        if self.state.engine.failure is not None and not self.should_exit:
            logger.error("the engine died (%s): shutting down", self.state.engine.failure)
            self.should_exit = True
            await self.state.drain()
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None and not self.loop.is_closed():
            logger.info("signal %d: aborting %d in-flight requests, shutting down", sig,
                        len(self.state.inflight))
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.state.drain()))


if __name__ == "__main__":
    sys.exit(main())
