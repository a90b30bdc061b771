"""uvicorn's h11 protocol, answering malformed HTTP with OpenAI's JSON error body and
closing connections that stall before a request's head is complete.

uvicorn answers a request it cannot parse (bad Content-Length, broken request line, a
header block over the size limit) with a plain-text 400. Here the body is OpenAI's error
JSON and the status is h11's hint (431 for a header block that is too large). uvicorn also
has no timeout for a request head that never finishes (only for idle keep-alive), so a
slow-loris client could hold sockets until the process runs out of file descriptors: here
a connection between requests that has not delivered a whole head within
``header_timeout_s`` of its first byte (or of connecting) is closed.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_REASONS = {400: "Bad Request", 431: "Request Header Fields Too Large"}


class JsonErrorH11Protocol(H11Protocol):
    header_timeout_s = 10.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._error_status = 400
        self._head_timer = None
        next_event = self.conn.next_event

        def next_event_noting_status():
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._error_status = exc.error_status_hint if exc.error_status_hint in _REASONS else 400
                raise

        self.conn.next_event = next_event_noting_status

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._between_requests():
            self._cancel_head_timer()
        elif self._head_timer is None:
            self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()

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


def json_error_protocol(header_timeout_s: float) -> type:
    """The protocol class for uvicorn's ``http=`` with this head timeout."""
    return type("JsonErrorH11Protocol", (JsonErrorH11Protocol,), {"header_timeout_s": header_timeout_s})
