"""HTTP server tests against a real uvicorn server on 127.0.0.1 (xrec.server).

One tiny random model (module fixture) behind an in-process uvicorn server on
a free port; a second engine for the drain test; a subprocess `xrec serve`
for SIGTERM. No wall-time assertions: every wait is a bounded poll.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
np = pytest.importorskip("numpy")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from xrec import Engine  # noqa: E402
from xrec.demo import write_random_model  # noqa: E402
from xrec.server.app import create_app  # noqa: E402
from xrec.cli import build_parser  # noqa: E402
from xrec.server.run import DrainingServer, serve  # noqa: E402

D_MODEL, VOCAB, ROUNDS = 32, 64, 3        # the "tiny" size
BODY_LIMIT = 64 << 10
API_KEY = "test-key-123"
VALID = {"token_ids": [1, 2, 3], "beam_width": 4}
WAIT_S = 30.0


# ---- helpers -------------------------------------------------------------------

def wait_until(condition, timeout: float = WAIT_S, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


class ServerThread:
    """A uvicorn server for `app` in a thread, on a socket bound to a free port."""

    def __init__(self, app, server_class=uvicorn.Server, config=None, **kwargs):
        """`config`: uvicorn's settings (default: plain uvicorn, quiet, no lifespan)."""
        # proto=IPPROTO_TCP, or asyncio leaves Nagle on (40 ms delayed-ACK stalls per answer)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = config or uvicorn.Config(app, log_level="warning", lifespan="off",
                                          access_log=False)
        self.server = server_class(config, **kwargs)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        assert wait_until(lambda: self.server.started or not self.thread.is_alive())
        assert self.server.started, "uvicorn did not start"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "uvicorn did not stop"


class Gate:
    """Executor fault hook: request ids starting "boom" raise; "slow" wait for `release`."""

    def __init__(self):
        self.release, self.entered = threading.Event(), threading.Event()

    def __call__(self, batch) -> None:
        ids = [r.request_id for r in batch.requests]
        if any(i.startswith("boom") for i in ids):
            raise RuntimeError("injected fault")
        if any(i.startswith("slow") for i in ids):
            self.entered.set()
            self.release.wait(WAIT_S)


def scrape(url: str) -> list:
    """The samples of one /metrics scrape."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=WAIT_S).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def sample_value(samples: list, name: str, **labels) -> float:
    """The first of `samples` named `name` with `labels` (0 when absent)."""
    return next((s.value for s in samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())), 0.0)


def metric(url: str, name: str, **labels) -> float:
    """One sample of /metrics (0 when absent)."""
    return sample_value(scrape(url), name, **labels)


def raw_post(port: int, head: str, body: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.sendall(head.encode() + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, json.loads(response.read())


def post_in_thread(url: str, body: dict, results: list, headers=None) -> threading.Thread:
    def run():
        try:
            results.append(httpx.post(url, json=body, headers=headers, timeout=WAIT_S * 2))
        except httpx.HTTPError as e:
            results.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def embedding(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, D_MODEL)).astype(np.float32)


def b64(array: np.ndarray) -> str:
    return base64.b64encode(array.astype("<f4").tobytes()).decode()


def assert_error(response, status: int, code: str = "INVALID_ARGUMENT") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["request_id"], error
    return error


# ---- fixtures --------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0,
                              num_items=500)


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu")
    engine.executor.fault = gate = Gate()
    engine.test_gate = gate
    yield engine
    gate.release.set()
    engine.close(5)


@pytest.fixture(scope="module")
def server(engine):
    running = ServerThread(create_app(engine, max_body_bytes=BODY_LIMIT))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
        yield client


@pytest.fixture
def gate(engine):
    gate = engine.test_gate
    gate.release.clear()
    gate.entered.clear()
    yield gate
    gate.release.set()


# ---- endpoints -------------------------------------------------------------------

def test_head_answers_as_get_without_a_body(client):
    """RFC 9110 9.3.2: a server that answers GET answers HEAD too. Probes that send
    `HEAD /health` (curl -I, HAProxy's `http-check send meth HEAD`) got 405 and marked a
    serving replica down; HEAD now has GET's status and headers, without the body."""
    for path in ("/health", "/metrics", "/v1/models", "/v1/models/tiny", "/openapi.json"):
        get, head = client.get(path), client.head(path)
        assert (head.status_code, head.content) == (get.status_code, b""), path
        assert head.headers["content-type"] == get.headers["content-type"], path
    assert client.head("/v1/models/other").status_code == 404


def test_health_models_metrics(client):
    assert client.get("/health").json() == {"status": "ok", "model": "tiny"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["object"] == "model"
    assert models["data"][0]["xrec"] == {"family": "onerec", "dtype": "float32",   # what serves
                                         "fused_kernels": False}
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert_error(client.get("/v1/models/other"), 404, "NOT_FOUND")
    assert_error(client.get("/no/such/path"), 404, "NOT_FOUND")
    assert_error(client.get("/v1/rec/completions"), 405)
    assert client.post("/v1/rec/completions", json=VALID).status_code == 200
    text = client.get("/metrics").text
    for name in ("xrec_request_latency_seconds", "xrec_queue_wait_seconds", "xrec_step_seconds",
                 "xrec_round_seconds", "xrec_batch_size_requests", "xrec_batch_size_beams",
                 "xrec_input_length_tokens", "xrec_requests_waiting", "xrec_batches_running",
                 "xrec_pipelines_busy", "xrec_workspace_bytes_in_use",
                 "xrec_workspace_bytes_budget", "xrec_requests_total", "xrec_input_tokens_total",
                 "xrec_cpu_threads"):
        assert f"\n{name}" in text, name
    assert 'xrec_requests_total{api="native",code="OK"}' in text
    assert 'xrec_model_info{dtype="float32",family="onerec"} 1.0' in text


def test_native_token_ids(client):
    body = {**VALID, "request_id": "native-1", "model": "tiny"}
    response = client.post("/v1/rec/completions", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["id"] == "native-1" == response.headers["x-request-id"] and out["model"] == "tiny"
    assert 1 <= len(out["results"]) <= 4
    scores = [r["score"] for r in out["results"]]
    assert scores == sorted(scores, reverse=True)
    for r in out["results"]:
        assert set(r) == {"tokens", "score", "token_logprobs", "items", "text"}
        assert r["text"] is None   # an encoder-decoder model without a tokenizer
        assert len(r["tokens"]) == ROUNDS == len(r["token_logprobs"])
        assert math.isclose(sum(r["token_logprobs"]), r["score"], rel_tol=1e-4, abs_tol=1e-4)
        assert r["items"] and set(r["items"][0]) == {"item_id", "did", "type"}
    assert out["usage"] == {"input_tokens": 3, "beams": 4}
    assert set(out["timing"]) >= {"queue_ms", "run_ms"}
    no_items = client.post("/v1/rec/completions", json={**VALID, "return_items": False}).json()
    assert all(r["items"] == [] for r in no_items["results"])


def test_a_burst_is_answered_and_leaves_no_wakeup_held(server, engine):
    """Each event-loop iteration holds the scheduler's wake-ups while it accepts requests
    (so a burst can share a batch); every hold must be released."""
    results: list = []
    threads = [post_in_thread(server.url + "/v1/rec/completions",
                              {**VALID, "request_id": f"burst-{i}"}, results) for i in range(8)]
    for thread in threads:
        thread.join(WAIT_S * 2)
    assert sorted(r.json()["id"] for r in results) == sorted(f"burst-{i}" for i in range(8))
    assert wait_until(lambda: engine.scheduler._num_holds == 0)


def test_native_embedding_data_and_b64_agree(client):
    emb, ctx = embedding(5), embedding(2, seed=1)
    common = {"beam_width": 8, "num_return_sequences": 8, "top_k": 16}
    by_data = client.post("/v1/rec/completions", json={
        **common, "sparse_embedding": {"shape": [5, D_MODEL], "data": emb.ravel().tolist()},
        "decoder_context_embedding": {"shape": [2, D_MODEL], "data": ctx.ravel().tolist()}})
    by_b64 = client.post("/v1/rec/completions", json={
        **common, "sparse_embedding": {"shape": [5, D_MODEL], "b64": b64(emb)},
        "decoder_context_embedding": {"shape": [2, D_MODEL], "b64": b64(ctx)}})
    assert by_data.status_code == 200 == by_b64.status_code, (by_data.text, by_b64.text)
    a, b = by_data.json()["results"], by_b64.json()["results"]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert np.allclose([r["score"] for r in a], [r["score"] for r in b], atol=1e-5)
    assert by_data.json()["usage"]["input_tokens"] == 5


def _check_xllm(out: dict, num: int, items_on: bool) -> None:
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    assert isinstance(out["created"], int)
    choices = out["choices"]
    assert len(choices) == num and [c["index"] for c in choices] == list(range(num))
    for c in choices:
        ids = c["logprobs"]["token_ids"]
        assert len(ids) == ROUNDS == len(c["logprobs"]["token_logprobs"])
        assert c["text"] == " ".join(map(str, ids)) and c["finish_reason"] == "stop"
    tensors = {t["name"]: t for t in out["output_tensors"]}
    rec, lps = tensors["rec_result"], tensors["sku_logprobs"]
    if items_on:
        assert rec["datatype"] == "INT64" and rec["shape"] == [num]
        assert len(rec["contents"]["int64_contents"]) == num
    else:
        assert rec["datatype"] == "INT32" and rec["shape"] == [num, ROUNDS]
        assert rec["contents"]["int_contents"] == [t for c in choices
                                                   for t in c["logprobs"]["token_ids"]]
    assert lps["datatype"] == "FLOAT" and lps["shape"] == [num, ROUNDS]
    assert np.allclose(lps["contents"]["fp32_contents"],
                       [x for c in choices for x in c["logprobs"]["token_logprobs"]])
    assert out["usage"]["completion_tokens"] == num * ROUNDS


def test_xllm_completions(client):
    emb = embedding(6)
    tensor = {"name": "sparse_embedding", "data_type": "FLOAT", "shape": [6, D_MODEL],
              "contents": {"fp32_contents": emb.ravel().tolist()}}
    ctx = {"name": "decoder_context_embedding", "data_type": "FLOAT", "shape": [1, D_MODEL],
           "contents": {"fp32_contents": embedding(1, seed=2).ravel().tolist()}}
    cases = [
        ({"model": "tiny", "token_ids": [5, 6, 7], "routing": {"prefill_name": "p",
          "decode_name": "d"}, "beam_width": 4, "logprobs": 5, "max_tokens": 3}, True),
        ({"token_ids": [5, 6, 7], "beam_width": 4, "request_id": "x-1"}, True),
        ({"input_tensors": [tensor, ctx], "beam_width": 8, "num_return_sequences": 8,
          "temperature": 0.0, "top_p": 1.0, "n": 8}, True),
        ({"token_ids": [5, 6, 7], "beam_width": 4, "return_items": False}, False),
    ]
    for body, items_on in cases:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, (body, response.text)
        out = response.json()
        _check_xllm(out, len(out["choices"]), items_on)
        assert len(out["choices"]) >= 1
    assert client.post("/v1/completions", json=cases[1][0]).json()["id"] == "x-1"
    # the same request through both routes gives the same results
    native = client.post("/v1/rec/completions", json={"token_ids": [5, 6, 7], "beam_width": 4})
    xllm = client.post("/v1/completions", json={"token_ids": [5, 6, 7], "beam_width": 4})
    assert [r["tokens"] for r in native.json()["results"]] == \
        [c["logprobs"]["token_ids"] for c in xllm.json()["choices"]]
    assert [r["items"][0]["item_id"] for r in native.json()["results"]] == \
        xllm.json()["output_tensors"][0]["contents"]["int64_contents"]


def test_xllm_rec_result_marks_results_without_items():
    from xrec.api_types import RecCandidate, RecItem, RecResponse
    from xrec.server.schemas import xllm_response
    results = [RecCandidate((1, 2, 3), -1.0, (-0.5, -0.5, 0.0), [RecItem(7), RecItem(8)]),
               RecCandidate((4, 5, 6), -2.0, (-1.0, -1.0, 0.0), [])]
    out = xllm_response(RecResponse("r", results, {"input_tokens": 2, "beams": 2}, {}), "m", 3,
                        is_items_on=True)
    rec, lps = out["output_tensors"]
    assert rec == {"name": "rec_result", "datatype": "INT64", "shape": [2],
                   "contents": {"int64_contents": [7, -1]}}
    assert lps["shape"] == [2, 3] and lps["contents"]["fp32_contents"] == [-0.5, -0.5, 0.0,
                                                                           -1.0, -1.0, 0.0]
    empty = xllm_response(RecResponse("r", [], {"input_tokens": 2, "beams": 2}, {}), "m", 3, False)
    assert [t["shape"] for t in empty["output_tensors"]] == [[0, 3], [0, 3]]


def test_loading_state_without_engine():
    async def run():
        app = create_app(None, served_model_name="later")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            assert_error(await c.get("/health"), 503, "UNAVAILABLE")
            assert_error(await c.post("/v1/rec/completions", json=VALID), 503, "UNAVAILABLE")
            assert (await c.get("/v1/models")).json()["data"][0]["id"] == "later"
    asyncio.run(run())


# ---- malformed requests ------------------------------------------------------------

EMB1 = embedding(1).ravel().tolist()
ZEROS = ",".join(["0"] * (D_MODEL - 1))
XT = {"name": "sparse_embedding", "data_type": "FLOAT", "shape": [1, D_MODEL],
      "contents": {"fp32_contents": EMB1}}
NATIVE, XLLM = "/v1/rec/completions", "/v1/completions"

MALFORMED = [
    # (id, path, body: dict | bytes, status, code)
    ("bad-json", NATIVE, b"{bad", 400, "INVALID_ARGUMENT"),
    ("empty-body", NATIVE, b"", 400, "INVALID_ARGUMENT"),
    ("not-utf8", NATIVE, b"\xff\xfe{}", 400, "INVALID_ARGUMENT"),
    ("array-body", NATIVE, b"[1, 2]", 422, "INVALID_ARGUMENT"),
    ("string-body", NATIVE, b'"token_ids"', 422, "INVALID_ARGUMENT"),
    ("ids-string", NATIVE, {"token_ids": "1,2,3"}, 422, "INVALID_ARGUMENT"),
    ("ids-float", NATIVE, {"token_ids": [1.5, 2]}, 422, "INVALID_ARGUMENT"),
    ("ids-mixed", NATIVE, {"token_ids": [1, "2"]}, 422, "INVALID_ARGUMENT"),
    ("ids-nested", NATIVE, {"token_ids": [[1, 2]]}, 422, "INVALID_ARGUMENT"),
    ("both-inputs", NATIVE, {"token_ids": [1], "sparse_embedding":
                             {"shape": [1, D_MODEL], "data": EMB1}}, 400, "INVALID_ARGUMENT"),
    ("neither-input", NATIVE, {"beam_width": 4}, 400, "INVALID_ARGUMENT"),
    ("empty-object", NATIVE, {}, 400, "INVALID_ARGUMENT"),
    ("ids-empty", NATIVE, {"token_ids": []}, 400, "INVALID_ARGUMENT"),
    ("id-out-of-vocab", NATIVE, {"token_ids": [1, VOCAB]}, 400, "INVALID_ARGUMENT"),
    ("id-negative", NATIVE, {"token_ids": [-1]}, 400, "INVALID_ARGUMENT"),
    ("id-huge", NATIVE, {"token_ids": [10**30]}, 400, "INVALID_ARGUMENT"),
    ("emb-wrong-width", NATIVE, {"sparse_embedding": {"shape": [2, D_MODEL - 1],
                                 "data": [0.0] * (2 * D_MODEL - 2)}}, 400, "INVALID_ARGUMENT"),
    ("emb-count-mismatch", NATIVE, {"sparse_embedding": {"shape": [2, D_MODEL],
                                    "data": [0.0] * (2 * D_MODEL - 1)}}, 400, "INVALID_ARGUMENT"),
    ("emb-1d-shape", NATIVE, {"sparse_embedding": {"shape": [D_MODEL], "data": EMB1}},
     400, "INVALID_ARGUMENT"),
    ("emb-negative-shape", NATIVE, {"sparse_embedding": {"shape": [-1, D_MODEL], "data": []}},
     400, "INVALID_ARGUMENT"),
    ("emb-no-data", NATIVE, {"sparse_embedding": {"shape": [1, D_MODEL]}}, 400,
     "INVALID_ARGUMENT"),
    ("emb-data-and-b64", NATIVE, {"sparse_embedding": {"shape": [1, D_MODEL], "data": EMB1,
                                  "b64": b64(embedding(1))}}, 400, "INVALID_ARGUMENT"),
    ("emb-bad-b64", NATIVE, {"sparse_embedding": {"shape": [1, D_MODEL], "b64": "!!not*b64"}},
     400, "INVALID_ARGUMENT"),
    ("emb-b64-length", NATIVE, {"sparse_embedding": {"shape": [1, D_MODEL],
                                "b64": b64(embedding(1)[:, :-1])}}, 400, "INVALID_ARGUMENT"),
    ("emb-b64-nan", NATIVE, {"sparse_embedding": {"shape": [1, D_MODEL], "b64": b64(
        np.full((1, D_MODEL), np.nan, np.float32))}}, 400, "INVALID_ARGUMENT"),
    ("emb-nan-literal", NATIVE, ('{"sparse_embedding": {"shape": [1, %d], "data": [NaN, %s]}}'
                                 % (D_MODEL, ZEROS)).encode(), 400, "INVALID_ARGUMENT"),
    ("emb-nan-string", NATIVE, {"sparse_embedding": {"shape": [1, D_MODEL],
                                "data": ["NaN"] + [0.0] * (D_MODEL - 1)}}, 422, "INVALID_ARGUMENT"),
    ("emb-inf-overflow", NATIVE, ('{"sparse_embedding": {"shape": [1, %d], "data": [1e999, %s]}}'
                                  % (D_MODEL, ZEROS)).encode(), 400, "INVALID_ARGUMENT"),
    ("emb-float32-overflow", NATIVE, {"sparse_embedding": {"shape": [1, D_MODEL],
                                      "data": [1e39] + [0.0] * (D_MODEL - 1)}}, 400,
     "INVALID_ARGUMENT"),
    ("ctx-wrong-width", NATIVE, {"token_ids": [1], "decoder_context_embedding":
                                 {"shape": [1, 3], "data": [0.0] * 3}}, 400, "INVALID_ARGUMENT"),
    ("beam-zero", NATIVE, {"token_ids": [1], "beam_width": 0}, 400, "INVALID_ARGUMENT"),
    ("beam-too-wide", NATIVE, {"token_ids": [1], "beam_width": 513}, 400, "INVALID_ARGUMENT"),
    ("beam-string", NATIVE, {"token_ids": [1], "beam_width": "4"}, 422, "INVALID_ARGUMENT"),
    ("beam-float", NATIVE, {"token_ids": [1], "beam_width": 4.0}, 422, "INVALID_ARGUMENT"),
    ("topk-below-w", NATIVE, {"token_ids": [1], "beam_width": 4, "top_k": 2}, 400,
     "INVALID_ARGUMENT"),
    ("topk-too-big", NATIVE, {"token_ids": [1], "beam_width": 4, "top_k": 5000}, 400,
     "INVALID_ARGUMENT"),
    ("n-zero", NATIVE, {"token_ids": [1], "beam_width": 4, "num_return_sequences": 0}, 400,
     "INVALID_ARGUMENT"),
    ("n-too-big", NATIVE, {"token_ids": [1], "beam_width": 4, "num_return_sequences": 5000},
     400, "INVALID_ARGUMENT"),
    ("normalize-unknown", NATIVE, {"token_ids": [1], "normalize": "sometimes"}, 400,
     "INVALID_ARGUMENT"),
    ("unknown-field", NATIVE, {"token_ids": [1], "beam_widht": 4}, 422, "INVALID_ARGUMENT"),
    ("return-items-string", NATIVE, {"token_ids": [1], "return_items": "yes"}, 422,
     "INVALID_ARGUMENT"),
    ("timeout-negative", NATIVE, {"token_ids": [1], "timeout_ms": -5}, 400, "INVALID_ARGUMENT"),
    ("request-id-empty", NATIVE, {"token_ids": [1], "request_id": ""}, 400, "INVALID_ARGUMENT"),
    ("request-id-number", NATIVE, {"token_ids": [1], "request_id": 7}, 422, "INVALID_ARGUMENT"),
    ("unknown-model", NATIVE, {"token_ids": [1], "model": "other"}, 404, "NOT_FOUND"),
    ("x-bad-json", XLLM, b'{"token_ids": [1,', 400, "INVALID_ARGUMENT"),
    ("x-tensor-name", XLLM, {"input_tensors": [{**XT, "name": "dense"}]}, 400,
     "INVALID_ARGUMENT"),
    ("x-tensor-type", XLLM, {"input_tensors": [{**XT, "data_type": "INT32"}]}, 400,
     "INVALID_ARGUMENT"),
    ("x-tensor-width", XLLM, {"input_tensors": [{**XT, "shape": [2, D_MODEL // 2]}]}, 400,
     "INVALID_ARGUMENT"),
    ("x-tensor-count", XLLM, {"input_tensors": [{**XT, "shape": [2, D_MODEL]}]}, 400,
     "INVALID_ARGUMENT"),
    ("x-tensor-3d", XLLM, {"input_tensors": [{**XT, "shape": [1, 1, D_MODEL]}]}, 400,
     "INVALID_ARGUMENT"),
    ("x-int-contents", XLLM, {"input_tensors": [{**XT, "contents": {"int_contents": [1]}}]},
     400, "INVALID_ARGUMENT"),
    ("x-tensor-twice", XLLM, {"input_tensors": [XT, XT]}, 400, "INVALID_ARGUMENT"),
    ("x-both-inputs", XLLM, {"token_ids": [1], "input_tensors": [XT]}, 400, "INVALID_ARGUMENT"),
    ("x-neither-input", XLLM, {"beam_width": 4}, 400, "INVALID_ARGUMENT"),
    ("x-n-disagrees", XLLM, {"token_ids": [1], "n": 2, "num_return_sequences": 3}, 400,
     "INVALID_ARGUMENT"),
    ("x-prompt", XLLM, {"prompt": "hello"}, 400, "INVALID_ARGUMENT"),
    ("x-unknown-field", XLLM, {"token_ids": [1], "foo": 1}, 422, "INVALID_ARGUMENT"),
    ("x-tensors-object", XLLM, {"input_tensors": XT}, 422, "INVALID_ARGUMENT"),
    ("x-routing-type", XLLM, {"token_ids": [1], "routing": {"decode_name": 5}}, 422,
     "INVALID_ARGUMENT"),
    ("x-logprobs-negative", XLLM, {"token_ids": [1], "logprobs": -1}, 400, "INVALID_ARGUMENT"),
    ("x-beam-too-wide", XLLM, {"token_ids": [1], "beam_width": 10_000}, 400,
     "INVALID_ARGUMENT"),
    ("x-unknown-model", XLLM, {"token_ids": [1], "model": "other"}, 404, "NOT_FOUND"),
]


@pytest.mark.parametrize("path, body, status, code",
                         [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_malformed_request(client, path, body, status, code):
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = client.post(path, json=body)
    assert_error(response, status, code)
    # a valid request right after still succeeds, on both routes
    assert client.post(path, json=VALID).status_code == 200


def test_error_carries_client_request_id(client):
    error = assert_error(client.post(NATIVE, json={"token_ids": [VOCAB], "request_id": "mine"}),
                         400)
    assert error["request_id"] == "mine" and str(VOCAB) in error["message"]


# ---- auth and body limit -------------------------------------------------------------

def test_auth(engine):
    running = ServerThread(create_app(engine, api_key=API_KEY, served_model_name="named"))
    try:
        url = running.url + NATIVE
        assert_error(httpx.post(url, json=VALID), 401, "UNAUTHENTICATED")
        wrong = {"Authorization": "Bearer nope"}
        assert_error(httpx.post(url, json=VALID, headers=wrong), 401, "UNAUTHENTICATED")
        assert_error(httpx.post(url, json=VALID, headers={"Authorization": API_KEY}), 401,
                     "UNAUTHENTICATED")
        right = {"Authorization": f"Bearer {API_KEY}"}
        response = httpx.post(url, json={**VALID, "model": "named"}, headers=right)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "named"
        assert httpx.post(running.url + XLLM, json=VALID, headers=right).status_code == 200
        assert httpx.get(running.url + "/health").status_code == 200          # open
        assert_error(httpx.get(running.url + "/metrics"), 401, "UNAUTHENTICATED")
        assert_error(httpx.get(running.url + "/v1/models"), 401, "UNAUTHENTICATED")
        assert httpx.get(running.url + "/v1/models", headers=right).status_code == 200
        # over 1 MiB: parsed and checked on a worker thread (default body limit: the model's
        # largest valid request; 250,000 ids are fewer values than its two embeddings)
        body = json.dumps({"token_ids": [1] * 250_000}, indent=2)
        assert len(body) > 1 << 20
        big = httpx.post(url, content=body, headers=right, timeout=WAIT_S)
        assert "max_input_len" in assert_error(big, 400)["message"]
        assert metric(running.url, "xrec_requests_total", api="native",
                      code="UNAUTHENTICATED") == 3
    finally:
        running.stop()


def test_body_limit(server, client):
    # declared over the limit: refused on the header, before any byte of body is read
    sock = raw_post(server.port, f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    f"application/json\r\nContent-Length: {10**9}\r\n\r\n")
    with sock:
        status, body = read_response(sock)
    assert status == 413 and body["error"]["code"] == "PAYLOAD_TOO_LARGE"
    # chunked: counted while read
    chunk = b"[" + b" " * BODY_LIMIT + b"]"
    head = (f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    sock = raw_post(server.port, head, b"%x\r\n" % len(chunk) + chunk + b"\r\n")
    with sock:
        status, body = read_response(sock)
    assert status == 413 and body["error"]["code"] == "PAYLOAD_TOO_LARGE"
    # just under the limit is parsed (and refused for its content, not its size)
    padded = json.dumps({"token_ids": [1] * ((BODY_LIMIT - 100) // 3)}).encode()
    assert len(padded) < BODY_LIMIT
    assert_error(client.post(NATIVE, content=padded), 400)
    assert client.post(NATIVE, json=VALID).status_code == 200
    # a chunked body within the limit is served
    chunked = client.post(NATIVE, content=iter([b'{"token_ids": [1, 2', b', 3], "beam_width": 4}']))
    assert chunked.status_code == 200, chunked.text
    # a client that goes away mid-body is counted as cancelled, and nothing else happens
    before = metric(server.url, "xrec_requests_total", api="native", code="CANCELLED")
    sock = raw_post(server.port, f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Length: 100"
                    "\r\n\r\n", b'{"token_ids": [')
    sock.close()
    assert wait_until(lambda: metric(server.url, "xrec_requests_total", api="native",
                                     code="CANCELLED") == before + 1, interval=0.05)


# ---- failures, disconnects, deadlines -------------------------------------------------

def test_batch_fault_fails_only_that_batch(server, client, gate):
    failed_before = metric(server.url, "xrec_batches_total", outcome="failed")
    error = assert_error(client.post(NATIVE, json={**VALID, "request_id": "boom-1"}), 500,
                         "INTERNAL")
    assert "injected fault" in error["message"] and error["request_id"] == "boom-1"
    assert client.post(NATIVE, json=VALID).status_code == 200
    assert_error(client.post(XLLM, json={**VALID, "request_id": "boom-2"}), 500, "INTERNAL")
    assert client.post(XLLM, json=VALID).status_code == 200
    assert metric(server.url, "xrec_batches_total", outcome="failed") == failed_before + 2


def test_client_disconnect_frees_request(server, engine, gate):
    cancelled_before = metric(server.url, "xrec_requests_total", api="native", code="CANCELLED")
    slow: list = []
    slow_thread = post_in_thread(server.url + NATIVE, {**VALID, "request_id": "slow-1"}, slow)
    assert gate.entered.wait(WAIT_S), "the slow batch never started"
    body = json.dumps({**VALID, "request_id": "gone-1"}).encode()
    sock = raw_post(server.port, f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    f"application/json\r\nContent-Length: {len(body)}\r\n\r\n", body)
    assert wait_until(lambda: engine.scheduler.num_waiting == 1), "request never queued"
    sock.close()  # the client goes away while its request waits
    assert wait_until(lambda: engine.scheduler.num_waiting == 0), "cancelled request not dropped"
    assert wait_until(lambda: metric(server.url, "xrec_requests_total", api="native",
                                     code="CANCELLED") == cancelled_before + 1, interval=0.05)
    # a request whose deadline passes while it waits is answered 504
    late = httpx.post(server.url + NATIVE, json={**VALID, "timeout_ms": 50}, timeout=WAIT_S)
    assert_error(late, 504, "DEADLINE_EXCEEDED")
    gate.release.set()
    slow_thread.join(WAIT_S)
    assert slow and not isinstance(slow[0], Exception) and slow[0].status_code == 200
    assert httpx.post(server.url + NATIVE, json=VALID).status_code == 200


def test_a_cancelled_handler_cancels_the_request_its_parse_submits(engine, gate, monkeypatch):
    """A body over 1 MiB is parsed and submitted on a worker thread, which a cancelled
    handler cannot stop (uvicorn cancels handlers when its graceful shutdown times out, as
    here; Ray Serve's proxy when the client goes away). The request that thread submits is
    cancelled; before, it waited, ran, and was answered to nobody."""
    app = create_app(engine, max_body_bytes=4 << 20)
    config = uvicorn.Config(app, log_level="critical", lifespan="off", access_log=False,
                            timeout_graceful_shutdown=1)
    running = ServerThread(app, config=config)
    slow: list = []
    parsing, parsed = threading.Event(), threading.Event()
    try:
        slow_thread = post_in_thread(running.url + NATIVE, {**VALID, "request_id": "slow-c"}, slow)
        assert gate.entered.wait(WAIT_S), "the slow batch never started"
        validate, submit_valid, submitted = engine.validate, engine.submit_valid, []

        def held_validate(request):   # the parse thread waits here until the handler is gone
            parsing.set()
            assert parsed.wait(WAIT_S)
            return validate(request)

        def recorded_submit(*args, **kwargs):
            submitted.append(submit_valid(*args, **kwargs))
            return submitted[-1]
        monkeypatch.setattr(engine, "validate", held_validate)
        monkeypatch.setattr(engine, "submit_valid", recorded_submit)
        body = json.dumps(VALID)[:-1] + " " * (1 << 20) + "}"   # valid JSON, over 1 MiB
        sock = raw_post(running.port, f"POST {NATIVE} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        f"application/json\r\nContent-Length: {len(body)}\r\n\r\n", body.encode())
        assert parsing.wait(WAIT_S), "the body was not parsed on a worker thread"
        running.server.should_exit = True   # 1 s later uvicorn cancels both handlers
        assert wait_until(lambda: app.state.xrec.num_in_flight == 0), "handlers not cancelled"
        parsed.set()                          # the parse thread goes on and submits
        assert wait_until(lambda: len(submitted) == 1)
        assert wait_until(lambda: submitted[0].cancelled()), "the abandoned request was kept"
        assert wait_until(lambda: engine.scheduler.num_waiting == 0)
        sock.close()
    finally:
        parsed.set()
        gate.release.set()
        running.thread.join(WAIT_S)
    slow_thread.join(WAIT_S)
    assert not running.thread.is_alive()


@contextlib.contextmanager
def stopped_by_the_drain(engine: Engine, gate: Gate, running: ServerThread) -> Iterator[None]:
    """The test's body; then the server has stopped by itself (the drain ended it). In any
    case the gate opens, the server stops and the engine closes."""
    try:
        yield
        running.thread.join(WAIT_S)
        assert not running.thread.is_alive(), "server did not stop after the drain"
    finally:
        gate.release.set()
        if running.thread.is_alive():
            running.stop()
        engine.close(5)


def test_drain_finishes_in_flight_requests(model_dir):
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu", request_queue_size=1)
    gate = engine.executor.fault = Gate()
    app = create_app(engine)
    running = ServerThread(app, DrainingServer, service=app.state.xrec, grace_s=WAIT_S)
    with stopped_by_the_drain(engine, gate, running):
        url = running.url
        results: list = []
        threads = [post_in_thread(url + NATIVE, {**VALID, "request_id": "slow-d"}, results)]
        assert gate.entered.wait(WAIT_S)
        threads.append(post_in_thread(url + XLLM, {**VALID, "request_id": "queued-d"}, results))
        assert wait_until(lambda: engine.scheduler.num_waiting == 1)
        full = httpx.post(url + NATIVE, json=VALID, timeout=WAIT_S)   # queue of 1 is full
        assert_error(full, 429, "RESOURCE_EXHAUSTED")
        assert full.headers["retry-after"] == "1"
        running.server.handle_exit(signal.SIGTERM, None)
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 503)
        assert_error(httpx.post(url + NATIVE, json=VALID), 503, "UNAVAILABLE")
        gate.release.set()
        for thread in threads:
            thread.join(WAIT_S)
        assert [getattr(r, "status_code", r) for r in results] == [200, 200]


def test_answers_given_while_draining_close_their_connection(model_dir):
    """A kept-alive connection answered during the drain (its in-flight request's 200, a new
    request's 503) stayed open, so its client sent the next request on it; when the drain
    ended uvicorn closed the idle connection and that request was lost unanswered (a reset:
    2 to 4 of 8 kept-alive clients per SIGTERM under load). Such answers carry `Connection:
    close` and the server closes the connection after them."""
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu")
    gate = engine.executor.fault = Gate()
    app = create_app(engine)
    running = ServerThread(app, DrainingServer, service=app.state.xrec, grace_s=WAIT_S)
    with stopped_by_the_drain(engine, gate, running):
        with httpx.Client(base_url=running.url, timeout=WAIT_S) as slow_client, \
                httpx.Client(base_url=running.url, timeout=WAIT_S) as client:
            assert client.get("/health").headers.get("connection") != "close"   # kept alive
            results: list = []
            slow = threading.Thread(target=lambda: results.append(
                slow_client.post(NATIVE, json={**VALID, "request_id": "slow-k"})), daemon=True)
            slow.start()
            assert gate.entered.wait(WAIT_S), "the slow batch never started"
            running.server.handle_exit(signal.SIGTERM, None)   # the drain waits for that batch
            refused = client.post(NATIVE, json=VALID)
            assert_error(refused, 503, "UNAVAILABLE")
            assert refused.headers["connection"] == "close"
            assert client.get("/health").status_code == 503   # on a new connection
            gate.release.set()
            slow.join(WAIT_S)
            assert results[0].status_code == 200 and results[0].headers["connection"] == "close"


# ---- the real process: xrec serve + SIGTERM ---------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_reports_a_model_that_does_not_load(tmp_path):
    args = build_parser().parse_args(["serve", "--model", str(tmp_path / "missing"),
                                      "--port", "0", "--grace-s", "1"])
    with pytest.raises(ValueError, match="config.json"):
        serve(args, args.model, {"device": "cpu"})


def start_serve(args: list[str], env: dict, log_path: Path) -> tuple[subprocess.Popen, str, int]:
    """`xrec serve ARGS` on a free port of 127.0.0.1, its output in `log_path`, waited until
    /health answers 200: (process, base url, port). The caller ends the process."""
    port = _free_port()
    command = [sys.executable, "-m", "xrec.cli", "serve", "--port", str(port), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None
    if not (wait_until(healthy, timeout=90, interval=0.1) and proc.poll() is None):
        proc.kill()
        proc.wait()
        pytest.fail("xrec serve did not become healthy:\n" + log_path.read_text())
    return proc, url, port


def test_sigterm_drains_subprocess(model_dir, tmp_path):
    env = {**os.environ, "XREC_HOME": str(tmp_path / "home"), "XREC_API_KEY": API_KEY}
    log_path = tmp_path / "serve.log"
    proc, url, _ = start_serve(["--model", str(model_dir), "--device", "cpu",
                                "--max-seqs-per-batch", "1", "--grace-s", str(WAIT_S)], env, log_path)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    try:
        assert httpx.post(url + NATIVE, json=VALID).status_code == 401      # key from env
        length = 1024  # 0.1-0.4 s a request on 2 cores, one at a time: the drain has work
        heavy = {"token_ids": [i % VOCAB for i in range(length)], "beam_width": 512}
        num_requests = 8
        results: list = []
        threads = [post_in_thread(url + NATIVE, {**heavy, "request_id": f"heavy-{i}"}, results,
                                  headers=auth) for i in range(num_requests)]
        last: list = []

        def all_accepted() -> bool:
            last[:] = scrape(url)
            return sample_value(last, "xrec_input_tokens_total") >= num_requests * length
        assert wait_until(all_accepted, interval=0.02), "the requests were not all accepted"
        # from the same scrape as the acceptance, so no request can finish in between
        in_flight = (sample_value(last, "xrec_requests_waiting")
                     + sample_value(last, "xrec_batches_running"))
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(WAIT_S * 2)
        assert [getattr(r, "status_code", repr(r)) for r in results] == [200] * num_requests, \
            log_path.read_text()
        assert proc.wait(timeout=WAIT_S * 2) == 0, log_path.read_text()
        assert in_flight >= 1, "nothing was in flight at SIGTERM: the drain was not exercised"
        text = log_path.read_text()
        assert "listening on http://127.0.0.1" in text and "workspace" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
