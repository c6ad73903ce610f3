"""The server when its engine misbehaves or its catalog routes are busy (second review of
2026-12-06): a process-isolated engine's child stopped (SIGSTOP) or killed (SIGKILL), a
catalog whose file name is not UTF-8, loads queued behind a running batch, reads that
straddle a restore, and answers checked against the served OpenAPI document.

Real uvicorn servers on 127.0.0.1 (test_server's `ServerThread`), real engines and real
child processes. A hang shows as a client timeout far above what the fixed server takes;
no test asserts wall time.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")

from test_server import WAIT_S, Gate, ServerThread, metric, wait_until  # noqa: E402
from test_server_admin import catalog_of, model_dir  # noqa: E402, F401 (a fixture)
from test_server_hostile import limited_app_server  # noqa: E402

from xrec import Engine  # noqa: E402
from xrec.server.app import create_app  # noqa: E402

VALID = {"token_ids": [1, 2, 3], "beam_width": 4}
# A hang of the old code shows as a client timeout this long; the fixed server answers in
# at most the engine's read timeout (isolated.READ_TIMEOUT_S, 2 s).
ANSWER_S = 20.0


@pytest.fixture
def process_engine(model_dir):
    """A process-isolated engine whose child the test may stop or kill."""
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    yield engine
    try:
        os.kill(engine.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    engine.close(5)


def _served(engine, **options) -> ServerThread:
    return ServerThread(create_app(engine, **options))


def _in_thread(call):
    """Run `call()` on a thread of its own; its future."""
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(call)
    pool.shutdown(wait=False)
    return future


# ---- a process-isolated engine's child stopped or gone -------------------------------

def test_a_stopped_child_never_stalls_the_event_loop(process_engine):
    """One /metrics scrape (or admin GET) waited on the stopped child on the event loop with
    no bound: every route froze, /health and deadlines included, until SIGCONT."""
    server = _served(process_engine)
    try:
        with httpx.Client(base_url=server.url, timeout=ANSWER_S) as client:
            assert client.get("/metrics").status_code == 200
            os.kill(process_engine.pid, signal.SIGSTOP)
            scrape = _in_thread(lambda: client.get("/metrics"))
            time.sleep(0.2)    # ordering only: the scrape is in before the others
            assert client.get("/health").status_code == 200     # a stopped child still counts
            late = client.post("/v1/rec/completions", json={**VALID, "timeout_ms": 300})
            assert late.status_code == 504, late.text
            scraped = scrape.result(ANSWER_S)
            assert scraped.status_code == 200
            assert "xrec_ready 0.0" in scraped.text and "xrec_model_info{" in scraped.text
            versions = client.get("/v1/admin/catalog")
            assert versions.status_code == 503 and "did not answer" in versions.text
            os.kill(process_engine.pid, signal.SIGCONT)
            assert wait_until(lambda: metric(server.url, "xrec_ready") == 1.0)
            assert client.post("/v1/rec/completions", json=VALID).status_code == 200
    finally:
        server.stop()


def test_a_dead_child_is_reported_by_metrics_and_health(process_engine):
    """A killed child: /metrics was a plain-text 500 (the engine's Unavailable escaped the
    collector) and /health 200."""
    server = _served(process_engine)
    try:
        os.kill(process_engine.pid, signal.SIGKILL)
        with httpx.Client(base_url=server.url, timeout=ANSWER_S) as client:
            assert wait_until(lambda: client.post("/v1/rec/completions",
                                                  json=VALID).status_code == 503)
            scraped = client.get("/metrics")
            assert scraped.status_code == 200, scraped.text
            assert metric(server.url, "xrec_ready") == 0.0
            assert metric(server.url, "xrec_requests_total", api="native",
                          code="UNAVAILABLE") >= 1
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "UNAVAILABLE"
    finally:
        server.stop()


# ---- catalog routes ---------------------------------------------------------------

def test_a_catalog_reached_by_a_name_that_is_not_utf8_is_served_and_reported(model_dir,
                                                                             tmp_path):
    """A symlink to `caf\\xe9.bin` (latin-1): the load swapped but answered 500, and every
    later GET /v1/admin/catalog and /metrics was 500 (the version's `source` held
    surrogates, which neither JSON nor the metrics text can encode)."""
    directory = tmp_path / "catalogs"
    directory.mkdir()
    odd = os.path.join(os.fsencode(directory), b"caf\xe9.bin")
    catalog_of(1).write(os.fsdecode(odd))
    os.symlink(odd, os.path.join(os.fsencode(directory), b"today.bin"))
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as engine:
        server = _served(engine, catalog_dir=directory)
        try:
            with httpx.Client(base_url=server.url, timeout=ANSWER_S) as client:
                loaded = client.post("/v1/admin/catalog", json={"path": "today.bin"})
                assert loaded.status_code == 200, loaded.text
                current = loaded.json()["current"]
                assert current["content_hash"] == catalog_of(1).content_hash()
                assert current["source"].endswith("/caf\\xe9.bin")     # the byte, as text
                assert client.get("/v1/admin/catalog").json()["current"] == current
                assert client.get("/metrics").status_code == 200
                assert metric(server.url, "xrec_catalog_info", source=current["source"]) == 1
                assert metric(server.url, "xrec_catalog_changes_total", action="load",
                              code="OK") == 1
        finally:
            server.stop()


def test_queued_catalog_loads_leave_large_bodies_a_thread(model_dir, tmp_path):
    """Loads ran on asyncio's default pool, where bodies over 1 MiB are parsed: loads queued
    behind one waiting for a running batch held every thread of it, and a 1.1 MB request
    waited until that batch ended (29 s in the review)."""
    directory = tmp_path / "catalogs"
    directory.mkdir()
    catalog_of(1).write(directory / "c1.bin")
    catalog_of(2).write(directory / "c2.bin")
    pool_size = min(32, (os.cpu_count() or 1) + 4)    # asyncio's default executor
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu",
                                    max_concurrency=2)
    engine.executor.fault = gate = Gate()
    app = create_app(engine, catalog_dir=directory, max_body_bytes=8 << 20)
    server = ServerThread(app)
    threads = []
    try:
        def post(path: str, body: dict) -> None:
            threads.append(threading.Thread(target=httpx.post, args=(server.url + path,),
                                            kwargs={"json": body, "timeout": WAIT_S * 2},
                                            daemon=True))
            threads[-1].start()

        post("/v1/rec/completions", {**VALID, "request_id": "slow-held"})
        assert gate.entered.wait(WAIT_S)            # a batch runs on the first catalog...
        assert httpx.post(server.url + "/v1/admin/catalog", json={"path": "c1.bin"},
                          timeout=WAIT_S).status_code == 200   # ...which is now the previous
        for index in range(pool_size):             # the first waits for that batch to end
            post("/v1/admin/catalog", {"path": f"c{1 + index % 2}.bin"})
        assert wait_until(lambda: app.state.xrec.num_in_flight == 1 + pool_size)
        big = json.dumps(VALID).encode() + b" " * (1100 << 10)
        answer = httpx.post(server.url + "/v1/rec/completions", content=big, timeout=ANSWER_S,
                            headers={"Content-Type": "application/json"})
        assert answer.status_code == 200, answer.text
        assert not gate.release.is_set() and app.state.xrec.num_in_flight >= pool_size
    finally:
        gate.release.set()
        for thread in threads:
            thread.join(WAIT_S)
        server.stop()
        engine.close(5)


def test_catalog_versions_are_read_at_once(process_engine, tmp_path):
    """GET /v1/admin/catalog read `current` and `previous` in two round trips to the child; a
    restore between them named one version as both. Here the restore's message reaches the
    stopped child right after the GET's first read."""
    directory = tmp_path / "catalogs"
    directory.mkdir()
    catalog_of(1).write(directory / "c1.bin")
    server = _served(process_engine, catalog_dir=directory)
    try:
        with httpx.Client(base_url=server.url, timeout=ANSWER_S) as client:
            assert client.post("/v1/admin/catalog", json={"path": "c1.bin"}).status_code == 200
            for _ in range(3):
                os.kill(process_engine.pid, signal.SIGSTOP)
                read = _in_thread(lambda: client.get("/v1/admin/catalog"))
                time.sleep(0.2)     # ordering only: the GET's read is sent first
                restore = _in_thread(process_engine.restore_catalog)
                time.sleep(0.2)
                os.kill(process_engine.pid, signal.SIGCONT)
                body = read.result(ANSWER_S).json()
                assert restore.result(ANSWER_S) is not None
                assert body["current"]["content_hash"] != body["previous"]["content_hash"], body
    finally:
        server.stop()


# ---- the served OpenAPI document ------------------------------------------------------

def _check_against(document: dict, method: str, path: str, response: httpx.Response) -> None:
    """`response` is a status, content type and JSON body that `document` gives `path`."""
    operation = document["paths"][path][method]
    documented = operation["responses"].get(str(response.status_code))
    assert documented is not None, (method, path, response.status_code, response.text)
    content_type = response.headers["content-type"].split(";")[0]
    assert content_type in documented["content"], (method, path, content_type)
    schema = documented["content"][content_type].get("schema")
    if content_type == "application/json":
        assert schema is not None, (method, path, response.status_code)
        jsonschema.validate(response.json(), {**schema, "components": document["components"]},
                            cls=jsonschema.Draft202012Validator)


@pytest.fixture
def documented(model_dir, tmp_path):
    """(server, its GET /openapi.json): catalog loads on, short head limits."""
    directory = tmp_path / "catalogs"
    directory.mkdir()
    catalog_of(1).write(directory / "c1.bin")
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as engine:
        server = limited_app_server(create_app(engine, catalog_dir=directory),
                                    header_timeout_s=0.5, max_header_bytes=4096)
        try:
            yield server, httpx.get(server.url + "/openapi.json", timeout=ANSWER_S).json()
        finally:
            server.stop()


def test_every_route_answers_as_the_served_document_says(documented):
    """The document lacked the catalog routes and /openapi.json, and had no schema for the
    /v1/models and /health answers."""
    server, document = documented
    with httpx.Client(base_url=server.url, timeout=ANSWER_S) as client:
        for method, path, body, route in (
                ("get", "/openapi.json", None, "/openapi.json"),
                ("get", "/health", None, "/health"),
                ("get", "/v1/models", None, "/v1/models"),
                ("get", "/v1/models/tiny", None, "/v1/models/{name}"),
                ("get", "/v1/models/other", None, "/v1/models/{name}"),
                ("get", "/v1/admin/catalog", None, "/v1/admin/catalog"),
                ("post", "/v1/admin/catalog/restore", None, "/v1/admin/catalog/restore"),  # 404
                ("post", "/v1/admin/catalog", {"path": "c1.bin"}, "/v1/admin/catalog"),
                ("post", "/v1/admin/catalog", {"path": "../c1.bin"}, "/v1/admin/catalog"),
                ("post", "/v1/admin/catalog", {"paths": "c1.bin"}, "/v1/admin/catalog"),
                ("post", "/v1/admin/catalog", {"path": "x" * (65 << 10)}, "/v1/admin/catalog"),
                ("post", "/v1/admin/catalog/restore", None, "/v1/admin/catalog/restore")):
            _check_against(document, method, route, client.request(method, path, json=body))


def test_refusals_below_the_routes_and_wrong_methods_are_documented(documented):
    """431 (head over its limit), 408 (head not received in time) and 405 were nowhere in the
    document; a 405 on /v1/admin/catalog named only GET in `Allow` (the fuzz test found it
    once the catalog routes were in the document)."""
    server, document = documented
    big_head = httpx.get(server.url + "/health", headers={"X-Big": "a" * 8192},
                         timeout=ANSWER_S)
    assert big_head.status_code == 431
    _check_against(document, "get", "/health", big_head)
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")    # the head never ends
        slow = http.client.HTTPResponse(sock)
        slow.begin()
        assert slow.status == 408
        _check_against(document, "get", "/v1/models", httpx.Response(
            408, headers=slow.getheaders(), content=slow.read()))
    wrong = httpx.get(server.url + "/v1/admin/catalog/restore", timeout=ANSWER_S)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    both = httpx.request("OPTIONS", server.url + "/v1/admin/catalog", timeout=ANSWER_S)
    assert both.status_code == 405      # Allow named GET alone (one route per method)
    assert sorted(both.headers["allow"].split(", ")) == ["GET", "POST"]
    schema = document["components"]["responses"]["MethodNotAllowed"]["content"][
        "application/json"]["schema"]
    jsonschema.validate(wrong.json(), {**schema, "components": document["components"]},
                        cls=jsonschema.Draft202012Validator)


def test_a_handler_cancelled_while_serving_counts_as_the_clients_cancel(model_dir):
    """Ray Serve's proxy cancels the handler's task when its client goes away; that was
    counted (and answered) UNAVAILABLE "server is shutting down". Only a drain is."""
    import asyncio

    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu")
    engine.executor.fault = gate = Gate()   # the "slow" request's batch waits for the gate
    app = create_app(engine)
    body = json.dumps({**VALID, "request_id": "slow-1"}).encode()

    async def cancelled_call() -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/rec/completions",
                 "raw_path": b"/v1/rec/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            return messages.pop(0) if messages else await asyncio.Event().wait()

        async def send(message: dict) -> None:
            pass

        task = asyncio.create_task(app(scope, receive, send))
        await asyncio.to_thread(gate.entered.wait, WAIT_S)   # its batch is running
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(cancelled_call())
    finally:
        gate.release.set()
        engine.close(5)
    text = app.state.xrec.metrics.render().decode()
    assert 'xrec_requests_total{api="native",code="CANCELLED"} 1.0' in text, text
    assert 'code="UNAVAILABLE"' not in text
