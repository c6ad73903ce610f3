"""Connection limits: head size, read deadlines, an idle timeout and a cap on connections.

uvicorn's httptools protocol reads headers without a size bound (httptools joins a
header value in memory until it ends: docs/decisions.md, HTTP server), never closes a
connection that has not sent a request yet, and has no read deadline for a head or a
body. `LimitedProtocol` is that protocol with these added, before any byte reaches the
app (so before auth):

- `max_header_bytes`: the request line and headers of one request together; past it
  431 and the connection closes (once an earlier request of the connection, a pipelining
  client's, has its own answer). Counted twice: per received chunk while a head is being
  read, so httptools never holds more than the limit plus one read (256 KiB), and as the
  parser hands over the URL and each header (name, value and their separators), so a head
  that ends inside one read is measured too.
- `header_timeout_s`: from a request's first byte until its head is complete; past it
  408 (slow-header clients). Not while an earlier request of the connection is still
  being answered (a pipelining client): its clock starts again then.
- `body_timeout_s`: from the end of the head until the body is complete; past it 408
  (slow-body clients). Not counted while the server itself holds the reading back
  (flow control, a pipelined request waiting its turn). It also bounds a stalled answer:
  a client that reads nothing of an answer waiting in the write buffer (a handler waiting
  to write more, or a close waiting for the answer's end to go out) is cut off after this
  long (the connection is aborted, its requests see a disconnect). Without it such a
  client held its connection for good: enough of them held every `max_connections` slot.
- `keep_alive_s`: a connection with no request in progress is closed after this long,
  also before its first request (uvicorn arms it only after a response). Only a request's
  beginning stops it: uvicorn stopped it at any byte, so a lone CRLF (which the parser
  skips) held a connection open for good.
- `max_connections`: open connections; the next one is answered 503 and closed at once,
  before it can hold a file descriptor for long.

A client that leaves is seen by every request of its connection not yet answered, so that
the app cancels them. With a pipelining client uvicorn stopped reading while a pipelined
request waited its turn, so it never saw the client leave, and told only the newest request
when it did: the request being answered ran to its end. Here what arrives meanwhile is kept
(up to `max_header_bytes`, then reading pauses) and parsed once that request's turn comes.

A refusal is the app's JSON error shape (`{"error": {"code", "message", "request_id"}}`,
with `X-Request-Id`) and `Connection: close`. The connection then lingers: its write
side is shut and what the client still sends is read and dropped, until the client
closes, `LINGER_S` pass without a byte, `MAX_LINGER_S` pass in all, or `MAX_LINGER_BYTES`
have been dropped. Closing at once with unread bytes would send a reset, and a client
that sends its whole request before reading (most do) would see the reset instead of
the refusal (docs/decisions.md, HTTP server). The same lingering close follows an app
answer given before the request's body was read (a 413 for a declared size over the
body limit) on a connection that is not kept alive (`Connection: close`, HTTP/1.0):
uvicorn would close it at once. At most `max_connections` connections linger at a time;
beyond that they close at once.

The HTTP codes carry the nearest code of `xrec.errors`: 431 PAYLOAD_TOO_LARGE, 408
DEADLINE_EXCEEDED, 503 UNAVAILABLE (with `Retry-After: 1`), and 400 INVALID_ARGUMENT for
bytes that are not HTTP (uvicorn answers those in plain text). `refusals` counts them by
reason (`xrec_http_refusals_total`) when the server is built with a registry.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

LINGER_S = 1.0                # a refused connection closes after this long without a byte
MAX_LINGER_S = 10.0           # or after this long in all
MAX_LINGER_BYTES = 64 << 20   # or once this much has been dropped


@dataclass(frozen=True)
class ConnectionLimits:
    """Limits of one server's connections (see the module docstring); CLI flags of the
    same names (`xrec serve --max-header-bytes ...`)."""

    max_header_bytes: int = 16 << 10
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    max_connections: int = 1024

    def __post_init__(self) -> None:
        for name, low in (("max_header_bytes", 1024), ("max_connections", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: got {value!r}, expected an integer >= {low}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name}: got {value!r}, expected a number of seconds > 0")


class _Shared:
    """What the connections of one server share: refused connections lingering now, and
    the refusal counter."""

    def __init__(self, refusals: Any):
        self.num_lingering = 0
        self.refusals = refusals


class _HeadRefused(Exception):
    """Raised from a parser callback after a 431: stops httptools in the middle of a read."""


class _CycleTransport:
    """The transport as one request's cycle (uvicorn's RequestResponseCycle) sees it: a
    close after its complete answer while the request's body is still arriving lingers
    (module docstring) instead of resetting the connection."""

    def __init__(self, protocol: LimitedProtocol, cycle: Any):
        self._protocol, self._cycle = protocol, cycle
        self._transport = protocol.transport

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        cycle, protocol = self._cycle, self._protocol
        if protocol._is_lingering:
            return   # lingering already: the linger closes it
        if cycle.response_complete and cycle.more_body and not self._transport.is_closing():
            protocol._linger_close()
        else:
            self._transport.close()


def protocol_class(limits: ConnectionLimits, registry: Any = None) -> type[LimitedProtocol]:
    """A protocol class for `uvicorn.Config(http=...)` that enforces `limits`; refusals
    are counted on `registry` (a prometheus_client CollectorRegistry) when given."""
    refusals = None
    if registry is not None:
        from prometheus_client import Counter
        refusals = Counter("xrec_http_refusals", "Connections refused or closed by a limit, "
                           "by reason", ["reason"], registry=registry)
    return type("LimitedProtocol", (LimitedProtocol,), {"limits": limits,
                                                         "shared": _Shared(refusals)})


class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `ConnectionLimits` (module docstring)."""

    limits = ConnectionLimits()
    shared = _Shared(None)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.limits.keep_alive_s
        self._is_reading_head = True   # the bytes coming in belong to a request head
        self._head_bytes = 0           # received since that head began
        self._head_size = 0            # of that head, as parsed so far (URL, headers)
        self._deadline: asyncio.TimerHandle | None = None   # head or body deadline
        self._is_lingering = False     # lingering (refused, or answered with a body unread)
        self._linger_until = 0.0       # loop time at which a lingering connection closes at last
        self._num_dropped = 0          # bytes read and dropped while lingering
        self._held_refusal: tuple | None = None   # a 431 waiting for the answer before it
        self._cycles: list[Any] = []   # this connection's requests not yet answered
        self._write_deadline: asyncio.TimerHandle | None = None   # a stalled answer's cut-off
        self._stash: list[bytes] = []  # read while a pipelined request waits its turn
        self._num_stashed = 0          # bytes in the stash

    # ---- connection ------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport
            self._refuse(503, "UNAVAILABLE", f"the server holds its limit of "
                         f"{self.limits.max_connections} open connections; retry shortly",
                         "max_connections")
            return
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.limits.keep_alive_s, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._cancel_write_deadline()
        self._disconnect_cycles()
        if self._is_lingering:
            self.shared.num_lingering -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's data_received (0.54) with the lingering drop in front and a parser
        # callback's 431 (_HeadRefused) ending the read quietly
        if self._held_refusal is not None:
            return   # a refused head; reading is paused until the answer before it is out
        if self._is_lingering:
            self._num_dropped += len(data)
            if self._num_dropped > MAX_LINGER_BYTES:
                self.transport.close()
            else:
                self._linger()
            return
        if self.pipeline or self._stash:   # parsed when the waiting request's turn comes
            self._stash.append(data)
            self._num_stashed += len(data)
            if self._num_stashed > self.limits.max_header_bytes:
                self.flow.pause_reading()
            return
        if self._is_reading_head:
            self._head_bytes += len(data)
        # the keep-alive close is cancelled when a request begins (on_message_begin), not
        # by any byte: the blank lines httptools skips between requests kept it off forever
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._is_lingering or self._held_refusal is not None:
                return   # a callback refused the head: nothing more to parse
            # uvicorn answers text/plain; a refusal here has the app's JSON error shape
            self.logger.warning("invalid HTTP request received: %s", exc)
            self._refuse(400, "INVALID_ARGUMENT", f"invalid HTTP request: {exc}", "invalid_http")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if (self._is_reading_head and self._head_bytes > self.limits.max_header_bytes
                and not self._is_lingering and self._held_refusal is None
                and not self.transport.is_closing()):
            self._refuse_head()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_writes()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._watch_writes(restart=True)   # the client read: its clock starts again

    def _watch_writes(self, restart: bool = False) -> None:
        """While answer bytes wait in the transport's buffer (a handler waiting to write, or a
        close waiting for them to go out), cut the connection off if the client reads none
        of them for `body_timeout_s` (module docstring)."""
        if restart:
            self._cancel_write_deadline()
        if self._write_deadline is None and self.transport.get_write_buffer_size():
            self._write_deadline = self.loop.call_later(
                self.limits.body_timeout_s, self._write_timed_out,
                self.transport.get_write_buffer_size())

    def _cancel_write_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_timed_out(self, num_buffered: int) -> None:
        self._write_deadline = None
        left = self.transport.get_write_buffer_size()
        if left and left < num_buffered:   # the client reads, slowly: watch on
            self._watch_writes()
        elif left:
            self._count("write_timeout")
            self.transport.abort()   # close() would wait for the client to read them

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself (also ends a lingering refusal early)

    def on_response_complete(self) -> None:
        # the answer's end may wait in the buffer (a close waits for it); an answer written is
        # progress, so the clock starts again
        self._watch_writes(restart=True)
        super().on_response_complete()   # starts a pipelined request waiting its turn
        if self._stash and not self.pipeline:
            self.loop.call_soon(self._feed_stash)
        elif self._num_stashed > self.limits.max_header_bytes:
            self.flow.pause_reading()
        if self._held_refusal is not None:   # a refused head after this answer (_refuse_head)
            cycle = self.cycle
            if self.pipeline or not (cycle is None or cycle.response_complete):
                self.flow.pause_reading()   # a pipelined request still to answer first
                return
            refusal, self._held_refusal = self._held_refusal, None
            if not self.transport.is_closing():
                self._refuse(*refusal)
            return
        # lingering after the answer, or the next request's head or body already begun (its
        # own deadline runs): no keep-alive close
        if self._is_lingering or self._deadline is not None:
            self._unset_keepalive_if_required()

    # ---- parser callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._unset_keepalive_if_required()
        self._is_reading_head = True
        self._head_size = 0
        self._arm(self.limits.header_timeout_s, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._add_to_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._add_to_head(len(name) + len(value) + 4)   # "name: value\r\n"

    def on_headers_complete(self) -> None:
        # the request line's method, spaces and "HTTP/1.1\r\n", and the blank line
        self._add_to_head(len(self.parser.get_method()) + 13)
        self._is_reading_head = False
        self._head_bytes = 0
        previous = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not previous:   # a request begins, or waits its turn
            self._cycles = [c for c in self._cycles if not c.response_complete] + [cycle]
        if self.pipeline and not self._is_lingering:
            self.flow.resume_reading()   # uvicorn paused it: read on into the stash
        if cycle is not None and cycle.transport is self.transport:
            cycle.transport = _CycleTransport(self, cycle)
        self._arm(self.limits.body_timeout_s, self._body_timed_out)

    def _add_to_head(self, num_bytes: int) -> None:
        self._head_size += num_bytes
        if self._head_size > self.limits.max_header_bytes:
            self._refuse_head()
            raise _HeadRefused   # stops the parser: the rest of this read is dropped

    def on_message_complete(self) -> None:
        self._cancel_deadline()
        self._is_reading_head = True
        super().on_message_complete()

    # ---- deadlines --------------------------------------------------------------------

    def _arm(self, seconds: float, callback: Any) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(seconds, callback)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_timed_out(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # an earlier request of this connection is still being answered: a refusal now
            # would answer it with this 408; the next head's clock starts again
            self._arm(self.limits.header_timeout_s, self._head_timed_out)
            return
        if self._is_reading_head and not self.transport.is_closing():
            self._refuse(408, "DEADLINE_EXCEEDED", f"request head not received within "
                         f"{self.limits.header_timeout_s:g} s", "header_timeout")

    def _body_timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused or self.pipeline:  # the server holds the reading back
            self._arm(self.limits.body_timeout_s, self._body_timed_out)
            return
        cycle = self.cycle
        if cycle is not None and (cycle.response_started or cycle.disconnected):
            self._count("body_timeout")
            self.transport.close()  # answered already (e.g. 413): nothing more to say
            return
        self._refuse(408, "DEADLINE_EXCEEDED", f"request body not received within "
                     f"{self.limits.body_timeout_s:g} s", "body_timeout")

    # ---- refusal ----------------------------------------------------------------------

    def _refuse_head(self) -> None:
        refusal = (431, "PAYLOAD_TOO_LARGE", f"request line and headers are over the limit "
                   f"of {self.limits.max_header_bytes} bytes", "max_header_bytes")
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # an earlier request of this connection (a pipelining client's) is still being
            # answered: a refusal now would replace its answer, so the 431 follows it
            self._held_refusal = refusal
            self._cancel_deadline()
            self.flow.pause_reading()
            return
        self._refuse(*refusal)

    def _refuse(self, status: int, code: str, message: str, reason: str) -> None:
        """Answer `status` with the JSON error shape, then linger and close."""
        self._count(reason)
        self._disconnect_cycles()   # the app may be reading or answering them
        self.transport.write(_error_bytes(status, code, message, self.server_state.default_headers))
        self._linger_close()

    def _linger_close(self) -> None:
        """Shut the write side (after what is written), then read and drop what the client
        still sends until it closes or a linger limit passes (module docstring)."""
        self._cancel_deadline()
        self._unset_keepalive_if_required()
        self._is_lingering = True
        self.shared.num_lingering += 1
        self._watch_writes()   # the refusal may wait in the buffer
        if self.shared.num_lingering > self.limits.max_connections or not \
                self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        if self.flow is not None:
            self.flow.resume_reading()
        self._linger_until = self.loop.time() + MAX_LINGER_S
        self._linger()

    def _linger(self) -> None:
        """(Re)arm the close of a lingering connection: LINGER_S from now, MAX_LINGER_S at most."""
        self._cancel_deadline()
        delay = min(LINGER_S, self._linger_until - self.loop.time())
        self._deadline = self.loop.call_later(max(0.0, delay), self.transport.close)

    def _feed_stash(self) -> None:
        """Parse what was read while a pipelined request waited its turn (now begun)."""
        if self.transport.is_closing() or self.pipeline or not self._stash:
            return
        data = b"".join(self._stash)
        self._stash, self._num_stashed = [], 0
        self.data_received(data)

    def _disconnect_cycles(self) -> None:
        """Every request of this connection not yet answered sees a disconnect (the app
        cancels it): the newest, and with a pipelining client the one being answered."""
        cycles = [*self._cycles, self.cycle] if self.cycle is not None else self._cycles
        for cycle in cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        self._cycles = []

    def _count(self, reason: str) -> None:
        if self.shared.refusals is not None:
            self.shared.refusals.labels(reason).inc()


def _error_bytes(status: int, code: str, message: str,
                 default_headers: list[tuple[bytes, bytes]]) -> bytes:
    request_id = uuid.uuid4().hex
    body = json.dumps({"error": {"code": code, "message": message,
                                 "request_id": request_id}}).encode()
    headers = [*default_headers, (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
               (b"x-request-id", request_id.encode())]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    return b"".join([STATUS_LINE[status], *(b"%s: %s\r\n" % pair for pair in headers),
                     b"\r\n", body])
