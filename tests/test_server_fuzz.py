"""Schema-driven fuzzing of the HTTP API from the app's own OpenAPI document (issue 12).

schemathesis reads `GET /openapi.json` of a real server (xrec.server.openapi,
written from the request models) and generates, for every operation, bodies
that follow the schema and bodies that break it (wrong types, missing and
unknown fields), through Hypothesis. Every answer must be a documented status,
never a 5xx, in the JSON error shape (`ErrorBody`) or a valid result (the
route's response schema), with `X-Request-Id` equal to the body's id. Two
servers: the tiny encoder-decoder model and a tiny decoder-only model with a
chat template (so that chat and prompt requests can succeed), each with catalog loads on
over an empty catalog directory (the admin routes' path checks answer every load).
Derandomized, so that CI runs the same examples each time.
"""

from __future__ import annotations

import json

import pytest

schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis import checks  # noqa: E402
from test_server import WAIT_S  # noqa: E402
from test_server_hostile import limited_app_server  # noqa: E402

from xrec import Engine  # noqa: E402
from xrec.demo import write_random_model  # noqa: E402
from xrec.server import openapi  # noqa: E402
from xrec.server.app import create_app  # noqa: E402

MODELS = {"onerec": ("tiny", {}),
          "decoder-only": ("qwen3-sid-test", {"generation_prefix": "<|sid_begin|>",
                                              "max_input_len": 64})}


@pytest.fixture(scope="module", params=sorted(MODELS))
def fuzzed(request, tmp_path_factory):
    size, options = MODELS[request.param]
    model_dir = write_random_model(tmp_path_factory.mktemp(request.param) / size, size, 0, 500)
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu", **options)
    catalog_dir = tmp_path_factory.mktemp(f"{request.param}-catalogs")
    running = limited_app_server(create_app(engine, catalog_dir=catalog_dir))
    yield running
    running.stop()
    engine.close(5)


# The document the app serves (checked below to be what GET /openapi.json answers); built at
# import time because schemathesis parametrizes a test per operation at collection.
schema = schemathesis.openapi.from_dict(openapi.document(is_auth_on=False))


def test_the_fuzzed_document_is_the_served_one(fuzzed):
    served = httpx.get(fuzzed.url + "/openapi.json", timeout=WAIT_S).json()
    assert served == json.loads(json.dumps(openapi.document(is_auth_on=False)))
    assert set(served["paths"]) == {"/v1/rec/completions", "/v1/completions",
                                    "/v1/chat/completions", "/health", "/metrics",
                                    "/v1/models", "/v1/models/{name}", "/openapi.json",
                                    "/v1/admin/catalog", "/v1/admin/catalog/restore"}


@schema.parametrize()
@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_every_answer_is_documented_and_never_5xx(case, fuzzed):
    response = case.call(base_url=fuzzed.url, timeout=WAIT_S)
    assert response.status_code < 500, (case.body, response.text)
    # schemathesis's checks: documented status and content type, the body matches the
    # status's schema (a result, or ErrorBody), 405 names the allowed methods, a body
    # that breaks the schema is refused. Not "a schema-valid body is accepted": the model's
    # ranges (vocabulary, beam width, lengths) are 400s that the schema does not express.
    case.validate_response(response, excluded_checks=[checks.positive_data_acceptance])
    content_type = response.headers.get("content-type", [""])[0]
    if content_type.startswith("application/json"):
        body = response.json()
        rid = body["error"]["request_id"] if "error" in body else body.get("id")
        if rid is not None:
            assert response.headers["x-request-id"] == [rid]
