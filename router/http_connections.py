"""The HTTP API's connections bounded before any request is read: how many are open at once, and how
long each may take to send a request's headers (its body's time is `http_api.BODY_TIMEOUT_S`).

uvicorn (0.54, h11) starts no timer when a connection opens, only once a response is sent, and any
byte that arrives stops that keep-alive timer; nor does it cap connections (its `limit_concurrency`
answers 503 to a request, so a connection that sends nothing is never counted against it). A peer
could hold thousands of silent connections, or drip a header byte now and then, until the router's
process runs out of file descriptors, which its gRPC, pyzmq and Ray sockets share. uvicorn takes a
protocol class (`uvicorn.Config(http=...)`): this one is its h11 protocol with both bounds added.

Under TLS a connection is counted and timed from the end of its handshake (asyncio calls the protocol
then; its handshake is bounded at 60 s by asyncio, whose limit uvicorn does not expose): until then, a
peer's silent connections are bounded in time, not in number. Per-peer limits are a proxy's to set.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

HEADER_TIMEOUT_S = 10.0  # a request's headers, from the connection's start or the last response's end
MAX_CONNECTIONS = 1024  # the manifest's default (`server.max_http_connections`)


def bounded_h11(max_connections: int, header_timeout_s: float = HEADER_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol that closes a connection past `max_connections` open at once as soon as it
    is accepted, and one whose next request's headers have not all come `header_timeout_s` after it
    opened or after its last response ended. A request under way (its body, its answer) is never cut."""

    class BoundedH11Protocol(H11Protocol):
        _headers_due: asyncio.TimerHandle | None = None
        _waiting_from: RequestResponseCycle | None = None  # the request cycle current when the deadline was set

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            # (this one counted) Refused before a request is read; under TLS, after its handshake (asyncio
            # calls this then), which asyncio bounds at 60 s.
            if len(self.connections) > max_connections:
                transport.close()
                return
            self._expect_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._headers_due is not None:
                self._headers_due.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            finished = self.cycle  # (uvicorn may start a pipelined request's cycle before it returns)
            super().on_response_complete()
            self._expect_headers(finished)

        def _expect_headers(self, after: RequestResponseCycle | None = None) -> None:
            if self._headers_due is not None:
                self._headers_due.cancel()
            self._waiting_from = after
            self._headers_due = self.loop.call_later(header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            # A new cycle means a request's headers came (uvicorn makes one per request): nothing to cut.
            if self.cycle is self._waiting_from and not self.transport.is_closing():
                self.transport.close()

    return BoundedH11Protocol
