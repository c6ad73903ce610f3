"""The app's OpenAPI 3.1 document (`GET /openapi.json`), built from the request models.

Bodies are parsed by hand (`schemas.parse_body`) for exact error statuses, so FastAPI
cannot see them; this document is written from the same pydantic models that parse
them (`NativeRequest`, `XllmRequest`, `ChatRequest`, strict: unknown fields refused),
and from the response models below, which describe what the routes answer (they
are documentation: the routes build their JSON directly, and
tests/test_server_fuzz.py checks every answer against them). Range checks that
depend on the served model (vocabulary, beam width, lengths) are not in the schema:
they are answered 400 with the allowed range. The item filters (`exclude_items`,
`item_types`, `exclude_history`) are described on each request model; a response's
`usage` then carries `excluded_items_unknown`. `/v1/completions` and
`/v1/chat/completions` answer `stream: true` with `text/event-stream` (stream.py); as
OpenAPI 3.1 has no stream schema, its `schema` describes one event, whose `data` is
`[DONE]` or a JSON chunk (`CompletionChunk`, `ChatChunk`: `contentSchema`).

Every route the app serves is here, the catalog administration (admin.py) and this document
included, with the statuses it answers: 408 and 431 (limits.py: a head or body not received
in time, a head over its limit) on every operation. A method a path does not list is 405
with `Allow` (`components.responses.MethodNotAllowed`; OpenAPI has no place for the methods
a path lacks).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from xrec.server import chat, schemas
from xrec.server.admin import CatalogLoadRequest

REF = "#/components/schemas/{model}"
ERROR_STATUSES = {"400": "malformed JSON or a value out of range", "401": "missing or wrong "
                  "API key", "404": "unknown model", "413": "body over the size limit",
                  "422": "body of the wrong shape (types, unknown or missing fields)",
                  "429": "queue full, or a request larger than a pipeline can hold",
                  "499": "the client went away", "503": "loading or draining",
                  "504": "the request's deadline passed"}
# what any request may be answered below the routes (limits.py); the connection closes
CONNECTION_STATUSES = {"408": "the request's head or body was not received in time",
                       "431": "request line and headers over the limit"}
AUTH = {"401": ERROR_STATUSES["401"]}   # the error every route but /health may answer
METHOD_NOT_ALLOWED = ("a method this path does not list (INVALID_ARGUMENT); `Allow` names "
                      "those it does")


class ErrorDetail(BaseModel):
    code: Literal["INVALID_ARGUMENT", "UNAUTHENTICATED", "NOT_FOUND", "PAYLOAD_TOO_LARGE",
                  "RESOURCE_EXHAUSTED", "CANCELLED", "INTERNAL", "UNAVAILABLE",
                  "DEADLINE_EXCEEDED"]
    message: str
    request_id: str


class ErrorBody(BaseModel):
    """Every error answer, of every route."""

    error: ErrorDetail


class Item(BaseModel):
    item_id: int
    did: str | None
    type: str | None


class Result(BaseModel):
    tokens: list[int]
    score: float
    token_logprobs: list[float]
    items: list[Item]
    text: str | None


USAGE = ("Counts of the request's work; with exclude_items also excluded_items_unknown, the "
         "excluded ids the catalog does not hold.")


class NativeResponse(BaseModel):
    id: str
    model: str
    results: list[Result]
    usage: dict[str, int] = Field(description=USAGE)
    timing: dict[str, float]


class XllmLogprobs(BaseModel):
    tokens: list[str]
    token_ids: list[int]
    token_logprobs: list[float]


class XllmChoice(BaseModel):
    index: int
    text: str
    logprobs: XllmLogprobs
    finish_reason: Literal["stop"]


class OutputTensor(BaseModel):
    name: Literal["rec_result", "sku_logprobs"]
    datatype: Literal["INT64", "INT32", "FLOAT"]
    shape: list[int]
    contents: dict[str, list[int] | list[float]]


class XllmResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[XllmChoice]
    usage: dict[str, int] = Field(description=USAGE)
    output_tensors: list[OutputTensor]


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: Literal["stop"]
    logprobs: dict[str, Any] | None
    token_ids: list[int]
    score: float
    items: list[Item]


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: dict[str, int] = Field(description=USAGE)


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: XllmLogprobs | None
    finish_reason: Literal["stop"] | None


class CompletionChunk(BaseModel):
    """An event of a streamed `/v1/completions` answer (stream.py)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: dict[str, int] | None = Field(None, description=USAGE)
    output_tensors: list[OutputTensor] | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: Literal["stop"] | None
    logprobs: dict[str, Any] | None
    token_ids: list[int] | None = None
    score: float | None = None
    items: list[Item] | None = None


class ChatChunk(BaseModel):
    """An event of a streamed `/v1/chat/completions` answer (stream.py)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: dict[str, int] | None = Field(None, description=USAGE)


class XrecCard(BaseModel):
    family: str
    dtype: str
    fused_kernels: bool


class ModelCard(BaseModel):
    """OpenAI's model object; `xrec` once the model is loaded."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    xrec: XrecCard | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]
    model: str


class CatalogVersion(BaseModel):
    """One loaded catalog (`xrec.api_types.CatalogVersion`)."""

    content_hash: str
    num_items: int
    loaded_at: float
    source: str | None
    is_extended: bool


class CatalogVersions(BaseModel):
    """The catalog serving new batches and the one a restore brings back."""

    current: CatalogVersion | None
    previous: CatalogVersion | None


# route -> request examples valid for any served model of the route's family
EXAMPLES = {
    "/v1/rec/completions": {
        "token_ids": {"value": {"token_ids": [1, 2, 3], "beam_width": 8, "top_k": 16,
                                "num_return_sequences": 4, "request_id": "req-1"}},
        "defaults": {"value": {"token_ids": [3, 1, 2]}}},
    "/v1/completions": {
        "token_ids": {"value": {"token_ids": [1, 2, 3], "beam_width": 8, "logprobs": True,
                                "max_tokens": 3, "routing": {"prefill_name": "p",
                                                             "decode_name": "d"}}},
        "streamed": {"value": {"token_ids": [1, 2, 3], "beam_width": 8, "n": 4, "stream": True,
                               "stream_options": {"include_usage": True}}}},
    "/v1/chat/completions": {
        "messages": {"value": {"messages": [{"role": "user", "content": "What next?"}],
                               "beam_width": 8, "n": 4, "logprobs": True}},
        "streamed": {"value": {"messages": [{"role": "user", "content": "What next?"}],
                               "beam_width": 8, "n": 2, "stream": True,
                               "stream_options": {"include_usage": True}}}},
}

# route -> the chunk of its answer to `stream: true` (server-sent events, stream.py)
STREAMED = {"/v1/completions": CompletionChunk, "/v1/chat/completions": ChatChunk}
STREAM_EVENTS = ("; with stream: true, server-sent events (text/event-stream), each `data: "
                 "<JSON chunk>`: one chunk per choice, best first (finish_reason null), then "
                 "one chunk with every choice's finish_reason, then with "
                 "stream_options.include_usage a chunk with empty choices and the usage, then "
                 "`data: [DONE]`")

# route -> (summary, request model, response model)
COMPLETIONS = {
    "/v1/rec/completions": ("Recommend (native)", schemas.NativeRequest, NativeResponse),
    "/v1/completions": ("Recommend (xllm-compatible)", schemas.XllmRequest, XllmResponse),
    "/v1/chat/completions": ("Recommend from a chat (models with a chat template)",
                             chat.ChatRequest, ChatResponse),
}


# answers of the routes other than the completions
ANSWERS = (ModelList, ModelCard, Health, CatalogVersions)


@lru_cache(maxsize=1)
def _components() -> dict:
    models = [(m, "validation") for m in (*(m for _, m, _ in COMPLETIONS.values()),
                                          CatalogLoadRequest)]
    models += [(m, "serialization") for m in (ErrorBody, *(r for _, _, r in COMPLETIONS.values()),
                                              *STREAMED.values(), *ANSWERS)]
    _, defs = models_json_schema(models, ref_template=REF)
    return defs["$defs"]


def _event(chunk: dict) -> dict:
    """One server-sent event (OpenAPI before 3.2: `schema` is an event): `data` is `[DONE]`
    or the JSON of `chunk`."""
    data = {"type": "string", "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json", "contentSchema": chunk}}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def _json(description: str, model: type[BaseModel] | None = None) -> dict:
    """A response of `model`'s JSON (None: any JSON object)."""
    schema = {"type": "object"} if model is None else _ref(model)
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(statuses: dict[str, str]) -> dict:
    """Error responses (`ErrorBody`) for these statuses and those of the connection limits."""
    return {status: _json(text, ErrorBody)
            for status, text in {**statuses, **CONNECTION_STATUSES}.items()}


def _completions() -> dict:
    paths = {}
    for path, (summary, request, response) in COMPLETIONS.items():
        ok = _json("results, best first", response)
        if path in STREAMED:
            ok["description"] += STREAM_EVENTS
            ok["content"]["text/event-stream"] = {"schema": _event(_ref(STREAMED[path]))}
        paths[path] = {"post": {
            "summary": summary,
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref(request),
                                                             "examples": EXAMPLES[path]}}},
            "responses": {"200": ok, **_errors(ERROR_STATUSES)}}}
    return paths


def _catalog_admin() -> dict:
    """The catalog routes (admin.py): each answers both versions after its change."""
    versions = _json("the current and the previous catalog version", CatalogVersions)
    busy = {"503": "loading or draining, or a process-isolated engine's child does not answer"}
    load = {"required": True, "content": {"application/json": {
        "schema": _ref(CatalogLoadRequest),
        "examples": {"load": {"value": {"path": "items-2026-12-01.bin"}}}}}}
    load_errors = {"400": "malformed JSON, a path outside the catalog directory, not a "
                          "regular file, over the size limit, or a catalog that fails its "
                          "checks", **AUTH,
                   "404": "loads are off: the server has no catalog directory (--catalog-dir)",
                   "413": "body over the size limit", "422": ERROR_STATUSES["422"],
                   "503": busy["503"] + ", or a batch still runs on the previous catalog"}
    return {
        "/v1/admin/catalog": {
            "get": {"summary": "The catalog versions",
                    "responses": {"200": versions, **_errors({**AUTH, **busy})}},
            "post": {"summary": "Load a catalog file from the catalog directory",
                     "requestBody": load, "responses": {"200": versions, **_errors(load_errors)}}},
        "/v1/admin/catalog/restore": {"post": {
            "summary": "Make the previous catalog current again",
            "responses": {"200": versions, **_errors({**AUTH, "404": "no previous version to "
                                                                     "restore", **busy})}}}}


def _other_routes() -> dict:
    return {
        "/v1/models": {"get": {"summary": "The served model", "responses": {
            "200": _json("the served model, in OpenAI's list shape", ModelList),
            **_errors(AUTH)}}},
        "/v1/models/{name}": {"get": {
            "summary": "One model",
            "responses": {"200": _json("the model", ModelCard),
                          **_errors({**AUTH, "404": "not the served model"})},
            "parameters": [{"name": "name", "in": "path", "required": True,
                            "schema": {"type": "string"}}]}},
        "/health": {"get": {
            "summary": "200 serving, 503 loading, draining, or the engine cannot serve",
            "security": [], "responses": {
                "200": _json("serving", Health),
                **_errors({"503": "loading, draining, or the engine takes no new work"})}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "Prometheus text", "content": {"text/plain": {}}},
            **_errors(AUTH)}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": _json("OpenAPI 3.1"), **_errors(AUTH)}}},
    }


def document(is_auth_on: bool, title: str = "xrec", version: str = "0") -> dict:
    """The OpenAPI 3.1 document of the app's routes (bearer auth when `is_auth_on`)."""
    paths = {**_completions(), **_other_routes(), **_catalog_admin()}
    components: dict[str, Any] = {
        "schemas": _components(),
        "responses": {"MethodNotAllowed": _json(METHOD_NOT_ALLOWED, ErrorBody)}}
    out = {"openapi": "3.1.0", "info": {"title": title, "version": version,
                                        "description": f"405: {METHOD_NOT_ALLOWED}."},
           "paths": paths, "components": components}
    if is_auth_on:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        out["security"] = [{"bearer": []}]
    return out
