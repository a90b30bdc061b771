"""uvicorn's h11 protocol, answering malformed HTTP with OpenAI's JSON error body.

uvicorn answers a request it cannot parse (bad Content-Length, broken request line, a
header block over the size limit) with a plain-text 400. Here the body is OpenAI's error
JSON and the status is h11's hint (431 for a header block that is too large).
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_REASONS = {400: "Bad Request", 431: "Request Header Fields Too Large"}


class JsonErrorH11Protocol(H11Protocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._error_status = 400
        next_event = self.conn.next_event

        def next_event_noting_status():
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._error_status = exc.error_status_hint if exc.error_status_hint in _REASONS else 400
                raise

        self.conn.next_event = next_event_noting_status

    def send_400_response(self, msg: str) -> None:
        status = self._error_status
        message = ("the request headers are too large" if status == 431
                   else "malformed HTTP request (request line, headers or Content-Length)")
        data = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": status}}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers, reason=_REASONS[status]),
                      h11.Data(data=data), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
