"""uvicorn's HTTP/1.1 protocol with one change: a request that is not valid HTTP (garbage request
line, bad Content-Length, broken chunked encoding, oversized headers) is answered with an OpenAI
error object in JSON instead of uvicorn's plain-text 400, so every rejection has one shape."""
from __future__ import annotations

import json

from .protocol import error_body


def http_protocol():
    """The protocol class for `uvicorn.Config(http=...)`: uvicorn's own choice (httptools when it
    imports, else h11) with `send_400_response` overridden; "auto" where that hook is missing."""
    try:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol
    except ImportError:
        return "auto"
    if not callable(getattr(AutoHTTPProtocol, "send_400_response", None)):
        return "auto"

    class JSONErrorHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def send_400_response(self, msg: str) -> None:
            transport = self.transport
            cycle = getattr(self, "cycle", None)
            if cycle is not None and getattr(cycle, "response_started", False) and \
                    not getattr(cycle, "response_complete", False):
                transport.close()  # a response is already on the wire: just hang up
                return
            body = json.dumps(error_body(msg, code="bad_http_request")).encode()
            transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                            % (len(body), body))
            transport.close()

    return JSONErrorHTTPProtocol
