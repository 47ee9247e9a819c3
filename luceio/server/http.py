"""uvicorn's HTTP/1.1 protocol (httptools when it imports, else h11) with the server's connection
limits, every refusal an OpenAI error object in JSON:

- a request that is not valid HTTP (garbage request line, bad Content-Length, broken chunked
  encoding, oversized headers) gets 400 instead of uvicorn's plain-text one;
- a connection beyond `--limit-concurrency` open ones gets 503 and is closed as soon as it is
  accepted, so a flood of idle sockets cannot use up the process's file descriptors;
- a request whose headers are not complete `--timeout-headers` seconds after the connection
  opened (or, between requests, after the request's first byte) gets 408 and is closed: a
  header sent a byte at a time cannot hold the socket;
- so does a request body that goes `--timeout-body` seconds without a new byte (nginx's
  `client_body_timeout`); a pause while the app is not reading (flow control) does not count.
Idle keep-alive connections are closed by uvicorn's own `--timeout-keep-alive`."""
from __future__ import annotations

import json
import logging
import math
from http import HTTPStatus

from .args import ServerArgs
from .fields import error_body

logger = logging.getLogger("luceio.server")


def http_protocol(args: ServerArgs):
    """The protocol class for `uvicorn.Config(http=...)`: uvicorn's own choice with the limits of
    `args`."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    last_warning = [-math.inf]  # a flood of refused connections logs one line per minute

    class LimitedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.deadline: tuple | None = None  # (timer, phase, the cycle it watches)
            if len(self.connections) > args.limit_concurrency:
                if self.loop.time() - last_warning[0] > 60:
                    last_warning[0] = self.loop.time()
                    logger.warning("%d connections open (--limit-concurrency): refusing more",
                                   args.limit_concurrency)
                self._refuse(503, f"the server has {args.limit_concurrency} connections open; "
                             "retry later", "too_many_connections")
                return
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            self._refuse(400, msg, "bad_http_request")

        def _phase(self) -> str | None:
            """"headers" while a request's headers are awaited, "body" while its body is, else
            None (the app is working on it)."""
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                return "headers"
            return "body" if cycle.more_body else None

        def _watch(self) -> None:
            """Arms the deadline the connection's state calls for (after every read)."""
            phase = self._phase()
            if self.transport.is_closing():
                phase = None
            elif phase == "headers" and self.deadline is not None and \
                    self.deadline[1:] == (phase, self.cycle):
                return  # the header deadline runs from the start, not from the latest byte
            self._disarm()
            if phase is not None:
                timeout = args.timeout_headers if phase == "headers" else args.timeout_body
                timer = self.loop.call_later(timeout, self._expired)
                self.deadline = (timer, phase, self.cycle)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline[0].cancel()
                self.deadline = None

        def _expired(self) -> None:
            _, phase, cycle = self.deadline
            self.deadline = None
            if self.transport.is_closing() or self.cycle is not cycle or self._phase() != phase:
                return
            if phase == "body" and self.flow.read_paused:
                self._watch()  # the app has not read what came: the stall is ours
                return
            timeout = args.timeout_headers if phase == "headers" else args.timeout_body
            self._refuse(408, f"no complete request {phase} within {timeout:g} s",
                         "request_timeout")

        def _refuse(self, status: int, msg: str, code: str) -> None:
            """Answers `status` with an error object (unless a response is already on the wire)
            and closes the connection."""
            self._disarm()
            transport, cycle = self.transport, self.cycle
            if cycle is None or cycle.response_complete or not cycle.response_started:
                body = json.dumps(error_body(msg, code=code)).encode()
                transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                                b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                                % (status, HTTPStatus(status).phrase.encode(), len(body), body))
            transport.close()

    return LimitedHTTPProtocol
