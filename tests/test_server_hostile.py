"""Hostile and careless clients against a real server (issue 12), one test per reproduction.

In-process uvicorn servers on 127.0.0.1 run `xrec serve`'s own settings
(`server_config`: the limited protocol of xrec.server.limits) around the tiny
random model; raw sockets play the clients. Signals, exit codes and start-up
refusals run `python -m xrec serve` in a subprocess. No wall-time assertions:
every wait is bounded (a socket timeout, `wait_until`), so a server that never
answers fails instead of hanging.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

httpx = pytest.importorskip("httpx")
np = pytest.importorskip("numpy")

from test_server import (API_KEY, D_MODEL, NATIVE, VALID, WAIT_S, XLLM, Gate,  # noqa: E402
                         ServerThread, assert_error, b64, embedding, engine, gate,  # noqa: F401
                         metric, model_dir, post_in_thread, raw_post, read_response,
                         start_serve, stopped_by_the_drain, wait_until)

from xrec import Engine  # noqa: E402
from xrec.demo import write_random_model  # noqa: E402
from xrec.server import schemas  # noqa: E402
from xrec.server.app import create_app  # noqa: E402
from xrec.server.limits import MAX_LINGER_BYTES, ConnectionLimits  # noqa: E402
from xrec.server.run import DrainingServer, server_config  # noqa: E402

CHAT = "/v1/chat/completions"


# ---- helpers ---------------------------------------------------------------------------

def limited_server(engine, grace_s: float | None = None, **limits) -> ServerThread:
    """`engine` behind `xrec serve`'s uvicorn settings with `limits`; with `grace_s`, the
    `xrec serve` drain (DrainingServer) too."""
    app = create_app(engine)
    config = server_config(app, ConnectionLimits(**limits))
    if grace_s is None:
        return ServerThread(app, config=config)
    return ServerThread(app, DrainingServer, config=config, service=app.state.xrec,
                        grace_s=grace_s)


def limited_app_server(app, **limits) -> ServerThread:
    """`app` behind `xrec serve`'s uvicorn settings with `limits`."""
    return ServerThread(app, config=server_config(app, ConnectionLimits(**limits)))


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)


def read_answer(sock: socket.socket) -> tuple[int, dict, dict]:
    """(status, headers in lower case, JSON body) of the next response on `sock`."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    body = response.read()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(body)


class _OneBuffer:
    """`sock` for `read_answer`, whose answers are read one after another from one buffer:
    each http.client response reads ahead into its own, losing an answer that came with it."""

    def __init__(self, sock: socket.socket):
        self._file = sock.makefile("rb")

    def makefile(self, mode: str) -> _OneBuffer:
        return self

    def close(self) -> None:
        pass   # the next answer is still to be read from the buffer

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def assert_error_shape(body: dict, headers: dict, code: str) -> None:
    error = body["error"]
    assert set(error) == {"code", "message", "request_id"} and error["code"] == code, body
    assert error["message"] and headers["x-request-id"] == error["request_id"]


def assert_closed_by_server(sock: socket.socket) -> None:
    """The server closes the connection: recv sees the end (bounded by the socket timeout)."""
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass  # closed with unread bytes: also closed


def refusals(url: str, reason: str) -> float:
    return metric(url, "xrec_http_refusals_total", reason=reason)


@pytest.fixture(scope="module")
def served(engine):
    """The default limits (16 KiB head, 10 / 60 / 5 s, 1024 connections)."""
    running = limited_server(engine)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def impatient(engine):
    """Short deadlines, so that slow and idle clients are closed in a test's time."""
    running = limited_server(engine, header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=0.5)
    yield running
    running.stop()


# ---- 1. unbounded headers --------------------------------------------------------------------

def test_oversized_head_is_431_and_the_server_keeps_serving(served):
    with connect(served.port) as sock:
        # the whole head first, then read: the refusal must survive the unread bytes
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (8 << 20))
        status, headers, body = read_answer(sock)
        assert status == 431 and headers["connection"] == "close"
        assert_error_shape(body, headers, "PAYLOAD_TOO_LARGE")
        assert "16384 bytes" in body["error"]["message"]
        assert_closed_by_server(sock)
    # everyone else is served; a head just under the limit too
    assert httpx.get(served.url + "/health", timeout=WAIT_S).status_code == 200
    near = httpx.get(served.url + "/health", headers={"X-Big": "a" * 15_000}, timeout=WAIT_S)
    assert near.status_code == 200
    assert refusals(served.url, "max_header_bytes") == 1


def _head(*headers: bytes, target: bytes = b"/health") -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n" + b"".join(headers) + b"\r\n"


# heads that end inside one read (or two): `on_headers_complete` reset the count before the
# check, so all of these were 200
WHOLE_HEADS = {
    "17-kb-header": [_head(b"X-Big: " + b"a" * 17_000 + b"\r\n")],
    "40-kb-header": [_head(b"X-Big: " + b"a" * 40_000 + b"\r\n")],
    "100-kb-header": [_head(b"X-Big: " + b"a" * 100_000 + b"\r\n")],
    "5000-small-headers": [_head(*(b"X-H%d: v\r\n" % i for i in range(5000)))],
    "20-kb-url": [_head(target=b"/health?q=" + b"a" * 20_000)],
    "20-kb-in-two-writes": [(head := _head(b"X-Big: " + b"a" * 20_000 + b"\r\n"))[:10_000],
                            head[10_000:]],
}


@pytest.mark.parametrize("writes", WHOLE_HEADS.values(), ids=WHOLE_HEADS.keys())
def test_a_head_over_the_limit_is_431_also_when_it_ends_inside_a_read(served, writes):
    before = refusals(served.url, "max_header_bytes")
    with connect(served.port) as sock:
        for data in writes:
            sock.sendall(data)
            time.sleep(0.05)   # separate reads, most of the time (either way: 431)
        status, headers, body = read_answer(sock)
        assert status == 431 and headers["connection"] == "close", body
        assert_error_shape(body, headers, "PAYLOAD_TOO_LARGE")
        assert_closed_by_server(sock)
    assert refusals(served.url, "max_header_bytes") == before + 1


def test_a_head_under_the_limit_with_its_body_in_the_same_read_is_served(served):
    """The head is measured, not the read: 15 KB of head and a body in one write is 200."""
    body = json.dumps({**VALID, "request_id": "r" * 200}).encode()
    with connect(served.port) as sock:
        sock.sendall(f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nX-Pad: {'a' * 15_000}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"\r\n".encode() + body)
        status, _, answer = read_answer(sock)
    assert status == 200 and answer["id"] == "r" * 200


# ---- 2. timeouts, idle connections, the connection cap ----------------------------------------

def test_slow_head_and_slow_body_get_408(impatient):
    with connect(impatient.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")    # the head never ends
        status, headers, body = read_answer(sock)
        assert status == 408
        assert_error_shape(body, headers, "DEADLINE_EXCEEDED")
        assert_closed_by_server(sock)
    with connect(impatient.port) as sock:
        sock.sendall(f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: 100\r\n\r\n{\"token_ids\": [".encode())
        status, headers, body = read_answer(sock)
        assert status == 408 and "body" in body["error"]["message"]
        assert_error_shape(body, headers, "DEADLINE_EXCEEDED")
        assert_closed_by_server(sock)
    assert httpx.post(impatient.url + NATIVE, json=VALID, timeout=WAIT_S).status_code == 200
    assert refusals(impatient.url, "header_timeout") == 1
    assert refusals(impatient.url, "body_timeout") == 1


def test_the_body_deadline_is_the_body_timeout_and_the_head_deadline_the_head_timeout(engine):
    """Each deadline is armed with its own timeout: a body sent slowly, past a short head
    timeout but within a long body timeout, is served; a head sent slowly within a long
    head timeout is read, and its body then gets 408 after the short body timeout (with
    the timeouts swapped, that 408 would come only after WAIT_S * 4: past the socket's
    timeout, and the test fails)."""
    data = json.dumps(VALID).encode()
    head = (f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    short, long = 0.5, WAIT_S * 4
    running = limited_server(engine, header_timeout_s=short, body_timeout_s=long)
    try:
        with connect(running.port) as sock:
            sock.sendall(head)
            for start in range(0, len(data), 8):
                time.sleep(short / 3)   # the whole body takes several head timeouts
                sock.sendall(data[start:start + 8])
            status, _, answer = read_answer(sock)
            assert status == 200, answer
    finally:
        running.stop()
    running = limited_server(engine, header_timeout_s=long, body_timeout_s=short)
    try:
        with connect(running.port) as sock:
            for start in range(0, len(head), 16):
                sock.sendall(head[start:start + 16])
                time.sleep(short / 3)   # the head takes several body timeouts
            sock.sendall(data[:5])        # and the body never ends
            status, headers, body = read_answer(sock)
            assert status == 408 and body["error"]["message"] == (
                f"request body not received within {short:g} s"), body
            assert_error_shape(body, headers, "DEADLINE_EXCEEDED")
        assert refusals(running.url, "body_timeout") == 1
        assert refusals(running.url, "header_timeout") == 0
    finally:
        running.stop()


def test_idle_connections_are_closed(impatient):
    idle = [connect(impatient.port) for _ in range(20)]   # never send a byte
    for sock in idle:
        with sock:
            assert_closed_by_server(sock)
    with connect(impatient.port) as sock:   # idle after an answer (keep-alive)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = read_answer(sock)
        assert status == 200 and body["status"] == "ok"
        assert_closed_by_server(sock)


@pytest.mark.parametrize("raw", [b"POST /health HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                                 b"\x00\x01 not http\r\n\r\n"], ids=["negative-length", "binary"])
def test_bytes_that_are_not_http_get_a_json_400(served, raw):
    """uvicorn answered these in text/plain; every refusal has the JSON error shape."""
    with connect(served.port) as sock:
        sock.sendall(raw)
        status, headers, body = read_answer(sock)
        assert status == 400 and body["error"]["message"].startswith("invalid HTTP request: ")
        assert_error_shape(body, headers, "INVALID_ARGUMENT")
        assert headers["connection"] == "close"
        assert_closed_by_server(sock)
    assert _health(served.url) == 200


def test_blank_lines_do_not_keep_a_connection_open(impatient):
    """The parser skips CRLFs between requests without beginning one; uvicorn stopped the
    keep-alive close at any byte, so a lone CRLF held a connection (and a slot of
    max_connections) open for good."""
    with connect(impatient.port) as sock:   # before any request
        sock.sendall(b"\r\n")
        assert_closed_by_server(sock)
    with connect(impatient.port) as sock:   # after an answer, and dripped
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_answer(sock)[0] == 200
        with pytest.raises(OSError):   # broken pipe or reset once the server has closed
            for _ in range(int(WAIT_S / 0.1)):
                sock.sendall(b"\r\n")
                time.sleep(0.1)


def send_slow_request(sock, gate, request_id: str) -> None:
    """Send a valid request on `sock` and wait until its batch holds at `gate`."""
    data = json.dumps({**VALID, "request_id": request_id})
    sock.sendall(f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(data)}\r\n\r\n{data}".encode())
    assert gate.entered.wait(WAIT_S), "the slow batch never started"


def test_a_pipelined_head_waits_while_the_request_before_it_is_answered(engine, gate):
    """A client that sends its next request's first bytes while the one before is still
    being answered: that answer is its own, however long it takes (before, the head
    timeout answered it with the next head's 408), then the next head's clock starts."""
    running = limited_server(engine, header_timeout_s=0.5)
    try:
        with connect(running.port) as sock:
            send_slow_request(sock, gate, "slow-pipelined")
            sock.sendall(b"GET /hea")   # the next head begins, and stops
            time.sleep(1.5)              # three head timeouts while the request runs
            gate.release.set()
            status, _, answer = read_answer(sock)
            assert status == 200 and answer["results"], answer
            status, headers, body = read_answer(sock)   # then the unfinished head's 408
            assert status == 408 and "head" in body["error"]["message"], body
            assert_error_shape(body, headers, "DEADLINE_EXCEEDED")
        assert refusals(running.url, "header_timeout") == 1
    finally:
        running.stop()


def test_a_pipelined_head_over_the_limit_is_refused_after_the_answer_before_it(engine, gate):
    """A client that sends its next request's head, over the head limit, while the one
    before is still being answered: that answer is its own, then the 431 and the close
    (before, the 431 was written at once in its place and the answer was dropped)."""
    running = limited_server(engine)
    try:
        with connect(running.port) as sock:
            send_slow_request(sock, gate, "slow-431")
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (32 << 10)
                         + b"\r\n\r\n")
            connections = running.server.server_state.connections
            assert wait_until(lambda: refusals(running.url, "max_header_bytes") == 1 or any(
                getattr(c, "_held_refusal", None) for c in list(connections)))   # head read
            gate.release.set()
            answers = _OneBuffer(sock)   # the 431 follows at once: http.client reads ahead
            status, _, answer = read_answer(answers)
            assert status == 200 and answer["id"] == "slow-431" and answer["results"], answer
            status, headers, body = read_answer(answers)
            assert status == 431 and headers["connection"] == "close", body
            assert_error_shape(body, headers, "PAYLOAD_TOO_LARGE")
            assert_closed_by_server(sock)
        assert refusals(running.url, "max_header_bytes") == 1
    finally:
        gate.release.set()
        running.stop()


def test_a_pipelining_client_that_leaves_cancels_its_request(engine, gate):
    """A client that leaves while its request waits, with its next request pipelined behind
    it: the waiting one is cancelled (dropped from the queue, counted CANCELLED) as for any
    client that leaves. Before, uvicorn told only the pipelined request, which never started:
    the one waiting stayed queued, ran, and counted OK, with nobody to read it."""
    running = limited_server(engine)
    slow: list = []
    try:
        slow_thread = post_in_thread(running.url + NATIVE, {**VALID, "request_id": "slow-left"},
                                     slow)
        assert gate.entered.wait(WAIT_S), "the slow batch never started"
        cancelled = metric(running.url, "xrec_requests_total", api="native", code="CANCELLED")
        data = json.dumps(VALID)
        request = (f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(data)}\r\n\r\n{data}").encode()
        connections = running.server.server_state.connections
        with connect(running.port) as sock:
            sock.sendall(request)
            assert wait_until(lambda: engine.scheduler.num_waiting == 1), "never queued"
            sock.sendall(request)   # the next request, pipelined behind the waiting one
            assert wait_until(lambda: any(c.pipeline for c in list(connections)))
        assert wait_until(lambda: engine.scheduler.num_waiting == 0), "the request still waits"
        assert wait_until(lambda: metric(running.url, "xrec_requests_total", api="native",
                                         code="CANCELLED") == cancelled + 1, interval=0.05)
        gate.release.set()
        slow_thread.join(WAIT_S)
        assert slow and getattr(slow[0], "status_code", slow[0]) == 200
        assert wait_until(lambda: _service(running).num_in_flight == 0)
    finally:
        gate.release.set()
        running.stop()


def test_connections_over_the_cap_are_refused_cleanly(engine):
    running = limited_server(engine, max_connections=4, keep_alive_s=WAIT_S * 4)
    held: list[socket.socket] = []
    try:
        for _ in range(4):   # the cap is held by kept-alive connections
            sock = connect(running.port)
            held.append(sock)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_answer(sock)[0] == 200
        for _ in range(40):  # each of these sends its request at once, then reads
            with connect(running.port) as sock:
                sock.sendall(f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Length: "
                             f"{len(json.dumps(VALID))}\r\n\r\n{json.dumps(VALID)}".encode())
                status, headers, body = read_answer(sock)
                assert status == 503 and headers["retry-after"] == "1"
                assert_error_shape(body, headers, "UNAVAILABLE")
                assert "4 open connections" in body["error"]["message"]
                assert_closed_by_server(sock)
        assert_error(httpx.get(running.url + "/health", timeout=WAIT_S), 503, "UNAVAILABLE")
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: _health(running.url) == 200), "slots were not freed"
    assert refusals(running.url, "max_connections") == 41
    running.stop()


@pytest.mark.parametrize("num_requests, beam_width, connection", [
    (20, 512, "keep-alive"),   # ~2 MB of answers: the handler waits to write
    (1, 256, "close"),         # ~47 KB, under the write buffer's high-water mark: the close waits
])
def test_a_client_that_reads_nothing_of_its_answers_is_cut_off(engine, num_requests, beam_width,
                                                                connection):
    """A client that sent its requests and read none of the answers held its connection for
    good, whether the handler waited to write more or the answer was all written and the
    close waited for it to go out: no deadline covered a write, so such clients could hold
    every slot of `--max-connections` (here the only one: every other client 503). The
    answer may wait for the client for the body timeout, then the connection is aborted."""
    running = limited_server(engine, max_connections=1, body_timeout_s=0.5)
    running.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)   # connections inherit it
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # takes little in
        sock.settimeout(WAIT_S)
        sock.connect(("127.0.0.1", running.port))
        body = json.dumps({"token_ids": [1, 2, 3], "beam_width": beam_width}).encode()
        request = (f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nConnection: {connection}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                   ).encode() + body
        sock.sendall(request * num_requests)
        assert wait_until(lambda: _health(running.url) == 200), "the slot was never freed"
        assert running.server.config.app.state.xrec.num_in_flight == 0
        assert refusals(running.url, "write_timeout") == 1
    finally:
        sock.close()
        running.stop()


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=WAIT_S).status_code
    except httpx.HTTPError:
        return 0


# ---- 3. request ids --------------------------------------------------------------------------

BAD_IDS = {"non-latin-1": "日本", "crlf": "a\r\nX-Injected: 1", "lf": "a\nb", "nul": "nul\x00",
           "del": "del\x7f", "space": "a b", "empty": "", "1-mib": "x" * (1 << 20)}


@pytest.mark.parametrize("path", [NATIVE, XLLM, CHAT])
def test_bad_request_ids_are_400_and_never_reflected(served, path):
    before = metric(served.url, "xrec_requests_total", api=_api(path), code="INVALID_ARGUMENT")
    for name, rid in BAD_IDS.items():
        body = {**VALID, "request_id": rid} if path != CHAT else \
            {"messages": [{"role": "user", "content": "hi"}], "request_id": rid}
        response = httpx.post(served.url + path, json=body, timeout=WAIT_S)
        error = assert_error(response, 400)
        assert "request_id" in error["message"], (name, error)
        assert len(error["message"]) < 200 and (not rid or rid not in error["message"]), name
        assert error["request_id"] != rid and len(error["request_id"]) == 32
        assert response.headers["x-request-id"] == error["request_id"]
    after = metric(served.url, "xrec_requests_total", api=_api(path), code="INVALID_ARGUMENT")
    assert after == before + len(BAD_IDS)   # the metrics say what the clients saw


def _api(path: str) -> str:
    return {NATIVE: "native", XLLM: "xllm", CHAT: "chat"}[path]


def test_a_bad_request_id_keeps_the_connection(served):
    bad, good = ({**VALID, "request_id": rid} for rid in ("日本", "req-7:a/b"))
    with connect(served.port) as sock:
        for body, status in ((bad, 400), (good, 200)):
            data = json.dumps(body).encode()
            sock.sendall(f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
            got, headers, answer = read_answer(sock)
            assert got == status and headers.get("connection") != "close"
    assert answer["id"] == "req-7:a/b" == headers["x-request-id"]


# ---- 5. memory: body limit and values before parsing --------------------------------------------

def test_body_limit_is_the_largest_valid_request(served, engine):
    service = _service(served)
    assert service.max_body_bytes == schemas.max_body_bytes(engine.limits) < 64 << 20
    # the largest valid request (two embeddings of max_input_len rows, JSON floats) fits
    rows = engine.limits.max_input_len
    full = embedding(rows).ravel().tolist()
    largest = json.dumps({"sparse_embedding": {"shape": [rows, D_MODEL], "data": full},
                          "decoder_context_embedding": {"shape": [rows, D_MODEL], "data": full},
                          "beam_width": 4, "request_id": "r" * 256}, indent=1)
    assert len(largest) < service.max_body_bytes
    assert largest.count(",") + 1 <= service.max_json_values
    # declared over the limit: refused before reading
    with connect(served.port) as sock:
        sock.sendall(f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Length: {60 << 20}\r\n\r\n"
                     .encode())
        status, headers, body = read_answer(sock)
    assert status == 413 and body["error"]["code"] == "PAYLOAD_TOO_LARGE"
    # one embedding of max_input_len rows is served
    half = {"sparse_embedding": {"shape": [rows, D_MODEL], "b64": b64(embedding(rows))},
            "beam_width": 2}
    assert httpx.post(served.url + NATIVE, json=half, timeout=WAIT_S * 2).status_code == 200


def _answer_head(sock: socket.socket) -> tuple[int, dict]:
    """(status, headers in lower case) of the next response on `sock`, its body read."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    return response.status, {k.lower(): v for k, v in response.getheaders()}


def _service(running: ServerThread):
    return running.server.config.app.state.xrec


def test_a_body_over_the_limit_is_a_413_that_clients_can_read(engine):
    """A 30 MB body to a server whose limit is 8 MiB: urllib (which sends its whole body,
    with `Connection: close`, before reading) saw ConnectionResetError instead of the 413.
    The server now reads and drops what is still coming (bounded) after answering."""
    running = limited_app_server(create_app(engine, max_body_bytes=8 << 20))
    try:
        body = b'{"token_ids": [' + b"1," * (15 << 20) + b"1]}"   # 30 MiB of JSON
        for chunked in (False, True):
            data = iter([body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)]) \
                if chunked else body
            request = urllib.request.Request(running.url + NATIVE, data=data,
                                             headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(request, timeout=WAIT_S)
            assert info.value.code == 413
            error = json.loads(info.value.read())["error"]
            assert error["code"] == "PAYLOAD_TOO_LARGE" and "8388608 bytes" in error["message"]
        response = httpx.post(running.url + NATIVE, content=body, timeout=WAIT_S,
                              headers={"Content-Type": "application/json"})
        assert_error(response, 413, "PAYLOAD_TOO_LARGE")
        assert httpx.post(running.url + NATIVE, json=VALID, timeout=WAIT_S).status_code == 200
    finally:
        running.stop()


@pytest.mark.parametrize("keep_alive, api_key", [(False, None), (True, None), (True, API_KEY)],
                         ids=["413-connection-close", "413-kept-alive", "401-kept-alive"])
def test_the_drain_after_an_early_answer_is_bounded_in_bytes(engine, keep_alive, api_key):
    """A client that keeps sending after its 413 (or a 401: no key) is cut off once
    MAX_LINGER_BYTES are dropped: it read the answer and then its sends fail. On a
    kept-alive connection the answer closes it (before, the server read and dropped the
    declared terabyte until the body timeout)."""
    running = limited_app_server(create_app(engine, max_body_bytes=1 << 20, api_key=api_key))
    try:
        with connect(running.port) as sock:
            sock.sendall(f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\n"
                         f"{'' if keep_alive else 'Connection: close' + chr(13) + chr(10)}"
                         f"Content-Length: {1 << 40}\r\n\r\n".encode())
            status, headers = _answer_head(sock)
            assert status == (413 if api_key is None else 401)
            assert headers["connection"] == "close"
            chunk, num_sent = b"0" * (1 << 20), 0
            with pytest.raises(OSError):   # reset or broken pipe once the server has closed
                while num_sent < 8 * MAX_LINGER_BYTES:
                    sock.sendall(chunk)
                    num_sent += len(chunk)
            assert num_sent >= MAX_LINGER_BYTES // 2, num_sent
    finally:
        running.stop()


def test_a_body_of_many_small_values_is_refused_before_parsing(served, engine):
    service = _service(served)
    count = 2 * service.max_json_values
    zeros = b'{"sparse_embedding": {"shape": [1, 128], "data": [' + b"0," * count + b"0]}}"
    assert len(zeros) < service.max_body_bytes      # under the body limit
    before = metric(served.url, "xrec_requests_total", api="native", code="PAYLOAD_TOO_LARGE")
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(httpx.post(
        served.url + NATIVE, content=zeros, timeout=WAIT_S * 2)), daemon=True) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 2)
    assert len(results) == 6
    for response in results:
        assert "JSON values" in assert_error(response, 413, "PAYLOAD_TOO_LARGE")["message"]
    assert metric(served.url, "xrec_requests_total", api="native",
                  code="PAYLOAD_TOO_LARGE") == before + 6
    assert httpx.post(served.url + NATIVE, json=VALID, timeout=WAIT_S).status_code == 200


# ---- 6. huge shapes ------------------------------------------------------------------------------

HUGE = [
    ("data-2**64", NATIVE, {"sparse_embedding": {"shape": [2**64, 0], "data": []}}),
    ("data-cols-2**64", NATIVE, {"sparse_embedding": {"shape": [0, 2**64], "data": []}}),
    ("b64-2**63", NATIVE, {"sparse_embedding": {"shape": [2**63, 0], "b64": ""}}),
    ("context-2**63", NATIVE, {"token_ids": [1], "decoder_context_embedding":
                               {"shape": [2**63, 0], "data": []}}),
    ("xllm-2**64", XLLM, {"input_tensors": [{"name": "sparse_embedding", "data_type": "FLOAT",
                                             "shape": [2**64, 0],
                                             "contents": {"fp32_contents": []}}]}),
    ("long-shape", NATIVE, {"sparse_embedding": {"shape": [1] * 10_000, "data": [0.0]}}),
]


@pytest.mark.parametrize("path, body", [c[1:] for c in HUGE], ids=[c[0] for c in HUGE])
def test_huge_shapes_are_400(served, path, body):
    error = assert_error(httpx.post(served.url + path, json=body, timeout=WAIT_S), 400)
    assert "shape" in error["message"] and len(error["message"]) < 200


# ---- 7. shutdown past the grace period -----------------------------------------------------------

def test_requests_unfinished_after_the_grace_period_get_503_json(model_dir):
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu")
    gate = engine.executor.fault = Gate()
    running = limited_server(engine, grace_s=0.2)
    with stopped_by_the_drain(engine, gate, running):
        results: list = []
        threads = [post_in_thread(running.url + NATIVE, {**VALID, "request_id": "slow-g"},
                                  results)]
        assert gate.entered.wait(WAIT_S), "the slow batch never started"
        threads.append(post_in_thread(running.url + XLLM, {**VALID, "request_id": "queued-g"},
                                      results))
        assert wait_until(lambda: engine.scheduler.num_waiting == 1)
        running.server.handle_exit(signal.SIGTERM, None)   # the batch outlasts the grace period
        # its round ends only once the grace period is over and the pipelines are stopping
        assert wait_until(lambda: engine.executor.is_stopping)
        gate.release.set()
        for thread in threads:
            thread.join(WAIT_S * 2)
        assert len(results) == 2
        for response in results:
            assert response.headers["content-type"] == "application/json", response.text
            assert_error(response, 503, "UNAVAILABLE")
        assert sorted(r.json()["error"]["request_id"] for r in results) == ["queued-g", "slow-g"]


def test_a_body_still_arriving_when_the_drain_ends_gets_503_at_once(model_dir, caplog):
    """A client whose body was still arriving when the drain ended (a slow or stalled
    upload) held the shutdown: the drain waited its HTTP tail for that request (10 s, then
    "1 HTTP request(s) still open after the drain"), uvicorn its graceful timeout (10 s
    more), and only then was the handler cancelled. It is answered 503 when the drain
    ends, as a request waiting for its answer is, and the server stops."""
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu")
    running = limited_server(engine, grace_s=0.2)
    try:
        body = json.dumps(VALID).encode()
        sock = raw_post(running.port, f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        f"application/json\r\nContent-Length: {len(body)}\r\n\r\n", body[:5])
        assert wait_until(lambda: running.server.service.num_in_flight == 1)   # reading it
        running.server.handle_exit(signal.SIGTERM, None)
        status, answer = read_response(sock)
        assert status == 503 and answer["error"]["code"] == "UNAVAILABLE", answer
        assert "body" in answer["error"]["message"]
        sock.close()
        running.thread.join(WAIT_S)
        assert not running.thread.is_alive(), "server did not stop after the drain"
        assert "still open after the drain" not in caplog.text
    finally:
        if running.thread.is_alive():
            running.stop()
        engine.close(5)


def test_the_process_answers_503_and_exits_0_when_a_batch_outlasts_the_grace_period(tmp_path):
    """The issue's run, smaller: one big batch (32 x 1024 tokens, W=512) is running at
    SIGTERM with no grace period: its clients get 503 JSON and `xrec serve` exits 0 without
    waiting for it (interpreter shutdown with torch on a pipeline thread aborted, 134)."""
    model = write_random_model(tmp_path / "m", "onerec-0.015b", seed=0, num_items=1000)
    log_path = tmp_path / "serve.log"
    proc, url, _ = start_serve(["--model", str(model), "--device", "cpu", "--grace-s", "0",
                                "--max-tokens-per-batch", "300000", "--max-beams-per-batch",
                                "16384", "--batch-wait-ms", "2000"], _env(tmp_path), log_path)
    try:
        results: list = []
        heavy = {"token_ids": [i % 8000 for i in range(1024)], "beam_width": 512}
        threads = [post_in_thread(url + NATIVE, heavy, results) for _ in range(32)]
        assert wait_until(lambda: metric(url, "xrec_batches_running") >= 1, interval=0.02)
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(WAIT_S * 2)
        assert len(results) == 32
        statuses = [getattr(r, "status_code", repr(r)) for r in results]
        assert set(statuses) <= {200, 503} and 503 in statuses, statuses
        for response in results:
            if response.status_code == 503:
                assert response.headers["content-type"] == "application/json"
                assert_error(response, 503, "UNAVAILABLE")
        assert proc.wait(timeout=WAIT_S * 2) == 0, log_path.read_text()
        assert "Traceback" not in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- 8, 9, 12, python -m xrec: the process -----------------------------------------------------

def _env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XREC_API_KEY"}
    return {**env, "XREC_HOME": str(tmp_path / "home"), **extra}


def test_a_second_sigterm_while_exiting_is_ignored(model_dir, tmp_path):
    proc, url, _ = start_serve(["--model", str(model_dir), "--device", "cpu", "--grace-s", "1"],
                               _env(tmp_path), tmp_path / "serve.log")
    try:
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WAIT_S
        num_sent = 1
        while proc.poll() is None and time.monotonic() < deadline:
            try:   # signals all through the drain and the exit
                proc.send_signal(signal.SIGTERM)
                num_sent += 1
            except ProcessLookupError:
                break
            time.sleep(0.005)
        assert proc.wait(timeout=WAIT_S) == 0, (tmp_path / "serve.log").read_text()
        assert num_sent > 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _xrec(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xrec", *args], capture_output=True, text=True,
                          env=env, timeout=WAIT_S * 4)


def test_a_busy_port_is_one_line_and_exit_1(model_dir, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = _xrec(["serve", "--model", str(model_dir), "--device", "cpu", "--port",
                      str(port)], _env(tmp_path))
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"xrec serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_a_grace_period_out_of_range_is_refused_at_start_up(model_dir, tmp_path):
    """`--grace-s inf` started, then SIGTERM overflowed the drain's waits (exit 1)."""
    for value in ("inf", "nan", "1e10", "-1"):
        done = _xrec(["serve", "--model", str(model_dir), "--device", "cpu", "--port", "0",
                      "--grace-s", value], _env(tmp_path))
        assert done.returncode == 1, done.stderr
        assert f"--grace-s: got {float(value)}, expected seconds in [0, 86400]" in done.stderr, \
            done.stderr


def test_an_empty_api_key_is_refused_at_start_up(model_dir, tmp_path, engine):
    for args, extra in ((["--api-key", ""], {}), ([], {"XREC_API_KEY": ""})):
        done = _xrec(["serve", "--model", str(model_dir), "--device", "cpu", "--port", "0",
                      *args], _env(tmp_path, **extra))
        assert done.returncode == 1, done.stderr
        assert "--api-key / XREC_API_KEY: got an empty string" in done.stderr, done.stderr
    for key in ("", "two words", "ключ"):
        with pytest.raises(ValueError, match="api key"):
            create_app(engine, api_key=key)
    assert create_app(engine, api_key=API_KEY).state.xrec.api_key == API_KEY.encode()


def test_python_m_xrec_is_the_xrec_command(tmp_path):
    done = _xrec(["--help"], _env(tmp_path))
    assert done.returncode == 0 and done.stdout.startswith("usage: xrec")
    assert "serve" in done.stdout and "recommend" in done.stdout
