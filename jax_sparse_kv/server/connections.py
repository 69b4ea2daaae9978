"""A deadline on reading a request's headers (slowloris), on top of uvicorn's HTTP protocol.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``), but nothing bounds the time a
client takes to send a request's headers: any byte received cancels the keep-alive timer, and a new
connection that sends nothing has no timer at all. A client that opens connections and trickles a header
byte now and then holds each of them, and their count against ``--limit-concurrency``, forever.

`header_timeout_protocol(base, seconds)` subclasses uvicorn's protocol class (``base``: the one uvicorn
would use, h11's or httptools') with one deadline per request: armed when a connection opens and when the
first bytes of a next request arrive on a kept-alive connection, disarmed once the headers are complete
(uvicorn has started the request's cycle). When it passes, a client that sent part of a request gets
``408 Request Timeout`` and the connection is closed; one that sent nothing is closed. Bodies, responses
and streams are not limited by it: a request is timed only until its headers are read.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["header_timeout_protocol", "uvicorn_protocol"]

log = logging.getLogger("jax_sparse_kv.server")

_RESPONSE_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


def uvicorn_protocol() -> type[asyncio.Protocol]:
    """The HTTP protocol class uvicorn's ``http="auto"`` picks (httptools' when installed, else h11's)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol


def header_timeout_protocol(base: type[asyncio.Protocol], seconds: float) -> type[asyncio.Protocol]:
    """`base` (a uvicorn HTTP protocol class) with a deadline of `seconds` on each request's headers."""
    if not seconds > 0:
        raise ValueError(f"the header timeout must be > 0 seconds, got {seconds!r}")

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        header_timeout = seconds

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._timed_cycle: Any = None  # the cycle before the request being timed (None: a new connection)
            self._header_bytes = 0  # bytes of the timed request received so far

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of a next request on a kept-alive connection
            if self._header_timer is not None:
                self._header_bytes += len(data)
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not None and self.cycle is not self._timed_cycle:
                self._disarm()  # uvicorn has the request's headers: its cycle started

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._timed_cycle, self._header_bytes = self.cycle, 0
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.transport is None or self.transport.is_closing():
                return
            client = self.client
            who = f"{client[0]}:{client[1]}" if client else "a client"
            log.warning(
                "closing the connection of %s: no complete request headers within %g s (%d bytes received)",
                who,
                self.header_timeout,
                self._header_bytes,
            )
            if self._header_bytes:
                message = f"request headers not complete within {self.header_timeout:g} s\n".encode()
                self.transport.write(_RESPONSE_408 % (len(message), message))
            self.transport.close()

    HeaderTimeoutProtocol.__name__ = HeaderTimeoutProtocol.__qualname__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol
