"""Request parsing and response building for the two HTTP shapes: native and xllm-compatible.

Parsing is two-stage. The body is parsed and type-checked by pydantic in
strict mode (`parse_body`): malformed JSON is INVALID_ARGUMENT with HTTP 400,
a schema error (wrong JSON type, unknown or missing field) is
INVALID_ARGUMENT with HTTP 422. The request is then turned into a
`RecRequest` (`native_request`, `xllm_request`): embedding shapes, base64 and
content sizes are checked here (400); everything else (both / neither input,
ids out of vocab, NaN / Inf, W / K / N ranges, `normalize`) is checked by the
engine's own `validate` (400).

Decisions where docs/serving.md leaves a choice:

- Unknown fields are refused (422): on the native route any name not listed
  below; on the xllm route any name that is not a field of xllm's
  `CompletionRequest` proto or one of the xrec extensions
  (`num_return_sequences`, `normalize`, `return_items`, `timeout_ms` and the
  filters `exclude_items`, `item_types`, `exclude_history`). Proto
  fields that mean nothing here (`temperature`, `top_p`, `best_of`, `echo`, ...)
  are accepted and ignored. A non-empty `prompt` is text for a model with a
  tokenizer (decoder-only); an empty one is absent.
- `n` (OpenAI's, and xllm's proto field) and `num_return_sequences` both mean N,
  the number of results, as on the chat route; given both, they must agree (400).
  Neither: N = beam_width, every result the search kept (docs/serving.md, "N").
- `stream: true` answers the same choices as OpenAI's server-sent events (stream.py),
  `stream_options.include_usage` adding the usage chunk; without `stream`,
  `stream_options` is ignored.
- Prompt length: a `prompt` or `messages` that cannot fit `max_input_len` is refused
  before it is tokenized (the engine's validation, `api_types.check_prompt_bound`); BPE on
  a prompt near the body limit takes most of a second, on the event loop.
- A JSON number must be a number: `"NaN"` (a string) is a schema error (422);
  the non-standard literals `NaN` / `Infinity` and overflowing numbers such as
  `1e999` parse and are refused by the engine (400). An integer stays an integer in a
  number field (`temperature`, `timeout_ms`: `Number`), so a refusal quotes it as sent and
  as the Python API does (`got -2`, not `got -2.0`; `10**400`, not `inf`).
- A string escaping a lone UTF-16 surrogate (`"\\ud800"`: the JSON grammar allows it, and
  `json.dumps` writes it for a str holding one) is read by Python's `json` where pydantic's
  parser refuses it, so the engine names the field and the character as the Python API does
  (`prompt: character 6 is a lone surrogate`), not "malformed JSON".
- `request_id`: 1 to 256 visible ASCII characters (0x21-0x7E), as it is echoed in the
  `X-Request-Id` header; anything else is 400 and the id is not repeated (the answer
  carries a fresh one).
- Embedding shapes: each dimension an integer in [0, 2**24] (400 otherwise, before any
  array is made).
- Memory at parsing: pydantic holds tens of bytes per JSON value while it parses
  (docs/decisions.md, HTTP server), so a body is refused 413 before parsing when it
  holds more values (commas) than the largest valid request for the served model
  (`max_json_values`). The default body limit is that request's size at 32 bytes a
  value (`max_body_bytes`): 35 MiB for onerec-0.015b (L = 4096, d_model = 128, and
  100,000 excluded ids).
- Filters (`exclude_items`, `item_types`, `exclude_history`; docs/beam-search.md,
  "Filters") on all three routes (xllm and chat: as xrec extensions): the schema checks
  the JSON types (422: a list of integers, a list of strings, a boolean); ids below 0 or
  above 2**63 - 1, more than the engine's `max_exclude_items`, or a filter the served
  model cannot apply are the engine's 400. The body limits admit `max_exclude_items`
  ids on an engine that constrains to a catalog (filters need one). With
  `exclude_items`, `usage` carries `excluded_items_unknown` (the ids the batch's
  catalog does not hold) on every route.
- Native embeddings: `{"shape": [L, D], "data": [L*D floats, row-major]}` or
  `{"shape": [L, D], "b64": base64 of L*D little-endian float32}`; exactly one
  of `data` / `b64`.
- xllm `input_tensors`: `data_type` is `"FLOAT"` (or its enum number 1), the
  values are in `contents.fp32_contents` (row-major), names are
  `sparse_embedding` / `decoder_context_embedding`, each at most once.
  `routing` (`prefill_name`, `decode_name`) is accepted and ignored:
  `token_ids` are used with or without it (xllm uses them only with it).
  `top_k` <= 0 means "the default" (xllm's and vLLM's -1 = no cutoff), on
  `/v1/chat/completions` too (`openai_top_k`); the native route refuses it.
- xllm response: `choices[i].text` is the semantic ID as text when the model
  has a tokenizer (`"<s_a_1><s_b_2><s_c_3>"`), else its decimal token ids
  joined by spaces (`"12 7 99"`); `logprobs` (`tokens`, `token_ids`,
  `token_logprobs`) is always filled, whatever the request's `logprobs`
  says, as xllm's rec path does with `enable_rec_score_output`; its
  `tokens` are the token strings (`"<s_a_1>"`, joined they are `text`) when
  the model has a tokenizer, else the decimal ids.
  `usage.completion_tokens` = N * R (and `usage.excluded_items_unknown` with
  `exclude_items`). Output tensors use xllm's JSON names
  (`name`, `datatype`, `shape`, `contents.{int64,int,fp32}_contents`).
  With items on (the engine has a catalog and `return_items` is true),
  `rec_result` is INT64 `[N]`: the first item of each result (xllm's default
  single-item mode), -1 for a result with no item, so that `rec_result[i]`,
  `sku_logprobs[i]` and `choices[i]` describe the same result. Items off:
  INT32 `[N, R]` tokens. `sku_logprobs` is FLOAT `[N, R]`.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import re
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator

from xrec.api_types import RecRequest, RecResponse, SearchLimits
from xrec.errors import InvalidArgument, PayloadTooLarge

if TYPE_CHECKING:
    from xrec.engine.responses import ResponseData

EMBEDDING_NAMES = ("sparse_embedding", "decoder_context_embedding")
STRICT = ConfigDict(strict=True, extra="forbid")
MAX_REQUEST_ID_CHARS = 256
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")   # "\ud800" to "\udfff" in JSON text
MAX_DIMENSION = 1 << 24
BYTES_PER_VALUE = 32      # "-2.2250738585072014e-308, " is 26; pretty-printed JSON adds more
BYTES_PER_TOKEN = 256     # prompt / messages text: a token's characters, JSON-escaped
VALUES_PER_TOKEN = 16     # commas of a prompt's text per token (counted as JSON values)
BODY_SLACK_BYTES = 64 << 10
USAGE_FILTER_KEYS = ("excluded_items_unknown",)   # usage keys the filters add (engine)
# the filter fields of the three request models (OpenAPI descriptions)
EXCLUDE_ITEMS = ("Catalog item ids never to recommend (int64 integers, at most the engine's "
                 "max_exclude_items); ids the catalog does not hold are ignored and counted in "
                 "usage.excluded_items_unknown. Engines that constrain to a catalog.")
ITEM_TYPES = ("Recommend only items of these types (an allow-list of the catalog's `type` "
              "strings; extended catalogs).")
EXCLUDE_HISTORY = ("Exclude every catalog item whose semantic ID appears in the prompt "
                   "(decoder-only models with a tokenizer and a catalog).")
N_RESULTS = ("Results (choices) to return, best first: OpenAI's `n`, the same as "
             "`num_return_sequences` (given both, they must agree). Default: beam_width.")
STREAM = ("true: the choices as server-sent events (text/event-stream) in OpenAI's chunk "
          "format, one chunk per choice, then a chunk with finish_reason, then `data: [DONE]`.")
INCLUDE_USAGE = "With stream: true, a last chunk with empty choices and the usage."
STREAM_OPTIONS = "OpenAI's stream options; ignored without stream: true."


def _as_sent(value: Any, handler: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value   # however large: the engine refuses what no float holds
    return handler(value)   # a JSON number (strict: not a boolean, not a string)


# A JSON number as sent: an integer stays an int (pydantic's `float` made -1 into -1.0, so a
# refusal quoted another value than the body's and the Python API's); the schema says "number".
Number = Annotated[float, WrapValidator(_as_sent)]


class SchemaError(InvalidArgument):
    """A body that is JSON but not of the request's shape: HTTP 422."""

    http_status = 422


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`."""

    model_config = STRICT
    include_usage: bool | None = Field(None, description=INCLUDE_USAGE)
    # accepted and ignored: OpenAI's padding of deltas, vLLM's usage in every chunk
    include_obfuscation: Any = None
    continuous_usage_stats: Any = None


class Matrix(BaseModel):
    model_config = STRICT
    shape: list[int]
    data: list[float] | None = None
    b64: str | None = None


class RecExtensions(BaseModel):
    """The fields of xrec's own that every request route takes, beyond its wire format's:
    the result count, the search's normalisation, items in the answer, a deadline and the
    filters."""

    model_config = STRICT
    num_return_sequences: int | None = None
    normalize: str | None = None
    return_items: bool = True
    timeout_ms: Number | None = None
    exclude_items: list[int] | None = Field(None, description=EXCLUDE_ITEMS)
    item_types: list[str] | None = Field(None, description=ITEM_TYPES)
    exclude_history: bool = Field(False, description=EXCLUDE_HISTORY)


class NativeRequest(RecExtensions):
    model: str | None = None
    token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    sparse_embedding: Matrix | None = None
    decoder_context_embedding: Matrix | None = None
    beam_width: int | None = None
    top_k: int | None = None
    temperature: Number | None = None
    seed: int | None = None
    request_id: str | None = None


class TensorContents(BaseModel):
    """xllm's `InferTensorContents`; only `fp32_contents` is used (FLOAT tensors)."""

    model_config = STRICT
    fp32_contents: list[float] | None = None
    bool_contents: list[Any] | None = None
    int_contents: list[Any] | None = None
    int64_contents: list[Any] | None = None
    uint_contents: list[Any] | None = None
    uint64_contents: list[Any] | None = None
    fp64_contents: list[Any] | None = None
    bytes_contents: list[Any] | None = None


class InputTensor(BaseModel):
    model_config = STRICT
    name: str
    data_type: str | int
    shape: list[int]
    contents: TensorContents


class Routing(BaseModel):
    model_config = STRICT
    prefill_name: str = ""
    decode_name: str = ""


class XllmRequest(RecExtensions):
    """xllm's `CompletionRequest` (completion.proto) as JSON, plus xrec extensions."""

    model: str | None = None
    prompt: str | None = None
    token_ids: list[int] | None = None
    routing: Routing | None = None
    input_tensors: list[InputTensor] | None = None
    beam_width: int | None = None
    top_k: int | None = None
    logprobs: bool | int | None = None
    max_tokens: int | None = None
    request_id: str | None = None
    service_request_id: str | None = None
    n: int | None = Field(None, description=N_RESULTS)
    stream: bool | None = Field(None, description=STREAM)
    stream_options: StreamOptions | None = Field(None, description=STREAM_OPTIONS)
    # proto fields accepted and ignored (OpenAI sampling knobs, serving hints)
    best_of: Any = None
    temperature: Any = None
    top_p: Any = None
    echo: Any = None
    stop: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    skip_special_tokens: Any = None
    ignore_eos: Any = None
    user: Any = None
    stop_token_ids: Any = None
    repetition_penalty: Any = None
    offline: Any = None
    slo_ms: Any = None
    priority: Any = None


def max_json_values(limits: SearchLimits) -> int:
    """JSON values (bounded by commas) the largest valid request for `limits` holds: two
    [max_input_len, d_model] embeddings when the model reads embeddings, else token ids
    and prompt text; plus `max_exclude_items` ids when the engine constrains to a catalog
    (filters need one); plus a margin for the other fields."""
    tokens = limits.max_input_len * (1 + VALUES_PER_TOKEN)
    embeddings = 2 * limits.max_input_len * limits.d_model if limits.accepts_embeddings else 0
    return max(tokens, embeddings) + _max_exclude_items(limits) + 4096


def max_body_bytes(limits: SearchLimits) -> int:
    """The default body limit: the largest valid request for `limits` in bytes."""
    text = limits.max_input_len * BYTES_PER_TOKEN
    embeddings = 2 * limits.max_input_len * limits.d_model * BYTES_PER_VALUE \
        if limits.accepts_embeddings else 0
    ids = _max_exclude_items(limits) * BYTES_PER_VALUE   # "9223372036854775807, " is 21
    return max(text, embeddings) + ids + BODY_SLACK_BYTES


def _max_exclude_items(limits: SearchLimits) -> int:
    return limits.max_exclude_items if limits.is_constrained else 0


def check_value_count(body: bytes, max_values: int) -> None:
    """PayloadTooLarge (413) when `body` may hold more than `max_values` JSON values,
    before parsing (which would hold tens of bytes per value: docs/decisions.md, HTTP server)."""
    if len(body) <= max_values:
        return  # fewer bytes than values allowed: nothing to count
    num_values = body.count(b",") + 1
    if num_values > max_values:
        raise PayloadTooLarge(f"body holds up to {num_values} JSON values (commas); the largest "
                              f"valid request for this model holds {max_values}")


def request_id_of(parsed: Any) -> str:
    """The client's `request_id` when it is valid (1 to 256 visible ASCII characters),
    else a fresh one; InvalidArgument (400) for an invalid one, without repeating it."""
    rid = parsed.request_id
    if rid is None:
        return uuid.uuid4().hex
    if not rid or len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id: got {len(rid)} characters, expected 1 to "
                              f"{MAX_REQUEST_ID_CHARS}")
    if not (rid.isascii() and rid.isprintable() and " " not in rid):
        position, char = next((i, c) for i, c in enumerate(rid)
                              if not ("!" <= c <= "~"))
        raise InvalidArgument(f"request_id: character U+{ord(char):04X} at position {position} "
                              "is not allowed; allowed: visible ASCII (0x21-0x7E)")
    return rid


def parse_body(body: bytes, schema: type[BaseModel]) -> Any:
    """JSON bytes -> `schema`; InvalidArgument (400) for bad JSON, SchemaError (422) otherwise."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if any(err["type"] == "json_invalid" for err in errors):
            return _parse_lone_surrogates(body, schema, errors[0]["msg"])
        raise SchemaError(_describe(errors)) from None


def _parse_lone_surrogates(body: bytes, schema: type[BaseModel], message: str) -> Any:
    """A body pydantic's parser refuses and Python's `json` reads: a string holding a lone
    UTF-16 surrogate ("\\ud800"), which the JSON grammar allows and `json.dumps` writes for
    such a str. Parsed, so that the engine names the field and character as the Python API
    does; any other malformed body is InvalidArgument (400) with the parser's `message`."""
    malformed = InvalidArgument(f"malformed JSON body: {message}")
    if SURROGATE_ESCAPE.search(body) is None:
        raise malformed from None   # not parsed twice
    try:
        parsed = json.loads(body.decode())   # UTF-8 only, as pydantic reads it
    except (ValueError, RecursionError):   # UnicodeDecodeError is a ValueError
        raise malformed from None
    try:
        return schema.model_validate(parsed)
    except ValidationError as e:
        raise SchemaError(_describe(e.errors(include_url=False))) from None


def _describe(errors: list[dict]) -> str:
    parts = []
    for err in errors[:3]:
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        where = loc or "body"
        if err["type"] == "extra_forbidden":
            parts.append(f"{where}: unknown field")
        else:
            got = repr(err.get("input"))
            parts.append(f"{where}: {err['msg']} (got {got[:60]}{'...' if len(got) > 60 else ''})")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more


# ---- requests ----------------------------------------------------------------

def native_request(req: NativeRequest, request_id: str) -> RecRequest:
    return RecRequest(
        token_ids=req.token_ids, prompt=req.prompt, messages=req.messages,
        sparse_embedding=_matrix("sparse_embedding", req.sparse_embedding),
        decoder_context_embedding=_matrix("decoder_context_embedding",
                                          req.decoder_context_embedding),
        beam_width=req.beam_width, top_k=req.top_k, num_return_sequences=req.num_return_sequences,
        normalize=req.normalize, temperature=1.0 if req.temperature is None else req.temperature,
        return_items=req.return_items, timeout_ms=req.timeout_ms, request_id=request_id,
        seed=req.seed, **filters_of(req))


def filters_of(req: RecExtensions) -> dict:
    """The filter fields of a parsed body (native, xllm or chat) as `RecRequest` keyword
    arguments; the engine checks them."""
    return {"exclude_items": req.exclude_items, "item_types": req.item_types,
            "exclude_history": req.exclude_history}


def num_results(n: int | None, num_return_sequences: int | None) -> int | None:
    """N from OpenAI's `n` and xrec's `num_return_sequences` (None: the engine's default, W)."""
    if n is not None and num_return_sequences is not None and n != num_return_sequences:
        raise InvalidArgument(f"n: got {n} and num_return_sequences {num_return_sequences}; "
                              "they mean the same (results), give one")
    if n is not None and n < 1:
        raise InvalidArgument(f"n: got {n}, expected >= 1 (results per request)")
    return num_return_sequences if n is None else n


def openai_top_k(top_k: int | None) -> int | None:
    """`top_k` of an OpenAI-style body (`/v1/completions`, `/v1/chat/completions`): <= 0 is
    vLLM's and xllm's "no cutoff" (-1, or 0), which for a beam search is the default (W)."""
    return top_k if top_k is not None and top_k > 0 else None


def xllm_request(req: XllmRequest, request_id: str) -> RecRequest:
    if req.max_tokens is not None and req.max_tokens < 0:
        raise InvalidArgument(f"max_tokens: got {req.max_tokens}, expected >= 0 (it is ignored)")
    if isinstance(req.logprobs, int) and not isinstance(req.logprobs, bool) and req.logprobs < 0:
        raise InvalidArgument(f"logprobs: got {req.logprobs}, expected >= 0 or a boolean")
    tensors: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(req.input_tensors or []):
        where = f"input_tensors[{index}]"
        if tensor.name not in EMBEDDING_NAMES:
            raise InvalidArgument(f"{where}.name: got {tensor.name!r}, allowed: "
                                  f"{', '.join(EMBEDDING_NAMES)}")
        if tensor.name in tensors:
            raise InvalidArgument(f"{where}.name: {tensor.name!r} given twice")
        if tensor.data_type not in ("FLOAT", 1):
            raise InvalidArgument(f"{where}.data_type: got {tensor.data_type!r}, "
                                  "allowed: \"FLOAT\"")
        contents = tensor.contents
        others = [name for name, value in contents if name != "fp32_contents" and value]
        if others:
            raise InvalidArgument(f"{where}.contents: got {others[0]} for a FLOAT tensor; "
                                  "use fp32_contents")
        if contents.fp32_contents is None:
            raise InvalidArgument(f"{where}.contents.fp32_contents: missing")
        tensors[tensor.name] = _from_floats(where, tensor.shape, contents.fp32_contents,
                                            "contents.fp32_contents")
    return RecRequest(
        token_ids=req.token_ids, prompt=req.prompt or None,
        sparse_embedding=tensors.get("sparse_embedding"),
        decoder_context_embedding=tensors.get("decoder_context_embedding"),
        beam_width=req.beam_width, top_k=openai_top_k(req.top_k),
        num_return_sequences=num_results(req.n, req.num_return_sequences),
        normalize=req.normalize, return_items=req.return_items, timeout_ms=req.timeout_ms,
        request_id=request_id, **filters_of(req))


def _matrix(name: str, matrix: Matrix | None) -> np.ndarray | None:
    if matrix is None:
        return None
    if (matrix.data is None) == (matrix.b64 is None):
        raise InvalidArgument(f"{name}: give exactly one of data / b64, got "
                              + ("both" if matrix.data is not None else "neither"))
    if matrix.data is not None:
        return _from_floats(name, matrix.shape, matrix.data, "data")
    rows, cols = _shape(name, matrix.shape)
    try:
        raw = base64.b64decode(matrix.b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidArgument(f"{name}.b64: not valid base64 ({e})") from None
    expected = rows * cols * 4
    if len(raw) != expected:
        raise InvalidArgument(f"{name}.b64: decodes to {len(raw)} bytes, shape {[rows, cols]} "
                              f"needs {expected} (little-endian float32)")
    return np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(rows, cols)  # [L, D]


def _from_floats(name: str, shape: list[int], values: list[float], field: str) -> np.ndarray:
    rows, cols = _shape(name, shape)
    if len(values) != rows * cols:
        raise InvalidArgument(f"{name}.{field}: got {len(values)} values, shape {[rows, cols]} "
                              f"needs {rows * cols}")
    with np.errstate(over="ignore"):  # float32 overflow becomes inf; the engine refuses it
        return np.asarray(values, dtype=np.float32).reshape(rows, cols)  # [L, D]


def _shape(name: str, shape: list[int]) -> tuple[int, int]:
    if len(shape) != 2 or not all(0 <= d <= MAX_DIMENSION for d in shape):
        got = shape if len(shape) <= 4 else f"a list of {len(shape)} integers"
        raise InvalidArgument(f"{name}.shape: got {got}, expected [length, d_model] "
                              f"(two integers in [0, {MAX_DIMENSION}])")
    return shape[0], shape[1]


# ---- responses ---------------------------------------------------------------

def native_response(data: ResponseData, model: str) -> dict:
    """The native answer, written from the answer's arrays: each result is an object of
    `RecCandidate`'s fields (tokens, score, token_logprobs, items of item_id/did/type,
    text), the shape `tests/test_server.py` checks. These dicts are cheaper than the
    `RecCandidate` objects, which the server never needs (docs/decisions.md, HTTP server)."""
    ids, bounds = data.item_ids.tolist(), data.item_offsets.tolist()
    dids, types = data.dids or itertools.repeat(None), data.types or itertools.repeat(None)
    items = [{"item_id": i, "did": did, "type": t} for i, did, t in zip(ids, dids, types)]
    results = [{"tokens": tokens, "score": score, "token_logprobs": logprobs,
                "items": items[start:end], "text": text}
               for tokens, score, logprobs, start, end, text in zip(
                   data.tokens.tolist(), data.scores.tolist(), data.token_logprobs.tolist(),
                   bounds, bounds[1:], data.texts or itertools.repeat(None))]
    return {"id": data.request_id, "model": model, "results": results, "usage": data.usage,
            "timing": data.timing}


def xllm_response(response: RecResponse, model: str, rounds: int, is_items_on: bool,
                  token_string: Any = None) -> dict:
    """`token_string(id)` names a token (the tokenizer's); None: tokens are decimal ids."""
    results = response.results
    choices, item_ids, tokens, logprobs = [], [], [], []
    for index, r in enumerate(results):
        ids, lps = list(r.tokens), list(r.token_logprobs)
        names = [str(t) for t in ids] if token_string is None else \
            [token_string(t) or str(t) for t in ids]
        choices.append({"index": index, "text": r.text or " ".join(map(str, ids)),
                        "logprobs": {"tokens": names, "token_ids": ids,
                                     "token_logprobs": lps},
                        "finish_reason": "stop"})
        item_ids.append(r.items[0].item_id if r.items else -1)
        tokens.extend(ids)
        logprobs.extend(lps)
    num = len(results)
    if is_items_on:
        rec_result = _tensor("rec_result", "INT64", [num], "int64_contents", item_ids)
    else:
        rec_result = _tensor("rec_result", "INT32", [num, rounds], "int_contents", tokens)
    prompt_tokens = int(response.usage.get("input_tokens", 0))
    return {
        "id": response.request_id, "object": "text_completion", "created": int(time.time()),
        "model": model, "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": num * rounds,
                  "total_tokens": prompt_tokens + num * rounds, **filter_usage(response.usage)},
        "output_tensors": [
            rec_result, _tensor("sku_logprobs", "FLOAT", [num, rounds], "fp32_contents", logprobs)]}


def filter_usage(usage: dict) -> dict:
    """The filters' usage keys (`excluded_items_unknown`) of an answer that has them, for the
    OpenAI-shaped `usage` of the xllm and chat answers."""
    return {key: usage[key] for key in USAGE_FILTER_KEYS if key in usage}


def _tensor(name: str, datatype: Literal["INT64", "INT32", "FLOAT"], shape: list[int],
            field: str, values: list) -> dict:
    return {"name": name, "datatype": datatype, "shape": shape, "contents": {field: values}}
