"""Request validation through a real server (issue 12, items 4 and 10): the HTTP routes refuse
what the Python API refuses, with the same message, as the JSON error shape.

A tiny random model behind uvicorn on 127.0.0.1 (test_server's `ServerThread`).
"""

from __future__ import annotations

import math

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import ServerThread  # noqa: E402

from xrec import Engine, InvalidArgument, RecRequest  # noqa: E402
from xrec.api_types import MIN_TEMPERATURE  # noqa: E402
from xrec.demo import write_random_model  # noqa: E402
from xrec.server.app import create_app  # noqa: E402

WAIT_S = 60.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    directory = write_random_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0,
                                   num_items=500)
    engine = Engine.from_pretrained(directory, isolation="thread", device="cpu")
    yield engine
    engine.close(5)


@pytest.fixture(scope="module")
def client(engine):
    server = ServerThread(create_app(engine))
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
        yield client
    server.stop()


def refused_like_the_engine(client, engine, body: dict, request: RecRequest) -> str:
    response = client.post("/v1/rec/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    with pytest.raises(InvalidArgument) as info:
        engine.submit(request)
    assert error["message"] == info.value.message
    return error["message"]


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324, MIN_TEMPERATURE / 2])
def test_tiny_temperature_is_400_with_the_allowed_range(client, engine, temperature):
    """Was: 200 with "results": [] (logits / 1e-38 overflowed float32)."""
    body = {"token_ids": [1, 2, 3], "beam_width": 8, "temperature": temperature}
    message = refused_like_the_engine(client, engine, body, RecRequest(**body))
    assert "temperature" in message and f"{MIN_TEMPERATURE:g}" in message


@pytest.mark.parametrize("temperature", [0, MIN_TEMPERATURE, 1e-3, 1.0, 1e30])
def test_temperatures_in_range_give_every_result(client, temperature):
    body = {"token_ids": [1, 2, 3], "beam_width": 8, "temperature": temperature}
    response = client.post("/v1/rec/completions", json=body)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == 8 and all(math.isfinite(r["score"]) for r in results)


@pytest.mark.parametrize("value", [2 ** 63, 2 ** 64 - 1, 2 ** 64, 10 ** 30])
def test_out_of_range_token_id_is_named_as_sent(client, engine, value):
    """Was: 400 saying "got -9223372036854775808" for 2**63."""
    body = {"token_ids": [1, value]}
    message = refused_like_the_engine(client, engine, body, RecRequest(**body))
    assert f"token_ids[1]: got {value}," in message and "-9223372036854775808" not in message


@pytest.mark.parametrize("field, value", [("temperature", -2), ("timeout_ms", 0),
                                          ("timeout_ms", 10 ** 400), ("temperature", -2.5)])
def test_an_integer_number_is_named_as_sent(client, engine, field, value):
    """Was: "temperature: got -2.0", "timeout_ms: got 0.0" and "got inf" for 10**400 (the
    body's integer read as a float); the Python API says "got -2", "got 0", "got 1000...".
    Found by the differential hunt of HTTP against `Engine.recommend` (2026-12-06)."""
    body = {"token_ids": [1, 2, 3], field: value}
    message = refused_like_the_engine(client, engine, body, RecRequest(**body))
    assert message.startswith(f"{field}: got {str(value)[:20]}")
