"""Item filters over HTTP (issue 25): `exclude_items`, `item_types` and `exclude_history` on
the native route, `/v1/completions` and `/v1/chat/completions`, against real uvicorn servers
on 127.0.0.1 with `xrec serve`'s settings (test_server_hostile's `limited_server`).

Three engines, one server each (module scope):

- `typed`: the tiny encoder-decoder model with its 500-item catalog, each item typed
  "live" or "video" (an extended catalog), max_input_len 64 and the default
  max_exclude_items (100,000), so that the largest exclude list is most of a body;
- `sid`: a tiny random Qwen3 model with a chat template and an untyped catalog;
- `bare`: the tiny model serving without a catalog constraint (filters are refused).

The oracle for "passed on" is the engine: a route answers what the same request answers
on the native route, refusals carry `Engine.validate`'s message. No wall-time assertions;
every wait is bounded.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("tokenizers")

from test_server import assert_error  # noqa: E402
from test_server_decoder_only import Served, _serve  # noqa: E402
from test_server_hostile import limited_server  # noqa: E402

from xrec import InvalidArgument, RecRequest  # noqa: E402
from xrec.catalog import ItemCatalog  # noqa: E402
from xrec.demo import write_random_model  # noqa: E402
from xrec.server import chat, openapi, schemas  # noqa: E402

NATIVE, XLLM, CHAT = "/v1/rec/completions", "/v1/completions", "/v1/chat/completions"
VOCAB, SID_VOCAB = 64, 768
MAX_EXCLUDE_ITEMS = 100_000           # the engine option's default
MESSAGES = [{"role": "user", "content": "What should I watch next?"}]


# ---- fixtures --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("tiny") / "tiny", "tiny", seed=0,
                              num_items=500)


@pytest.fixture(scope="module")
def typed_catalog(tiny_dir) -> ItemCatalog:
    plain = ItemCatalog.from_model_dir(tiny_dir, VOCAB)
    types = ["video" if i % 2 else "live" for i in range(plain.num_items)]
    return ItemCatalog.from_arrays(plain.item_ids, plain.triples, VOCAB,
                                   dids=[f"d{i}" for i in range(plain.num_items)], types=types)


@pytest.fixture(scope="module")
def typed(tiny_dir, typed_catalog):
    yield from _serve(tiny_dir, limited_server, catalog=typed_catalog, max_input_len=64)


@pytest.fixture(scope="module")
def sid(tmp_path_factory):
    model_dir = write_random_model(tmp_path_factory.mktemp("sid") / "sid", "qwen3-sid-test", 0,
                                   2000)
    yield from _serve(model_dir, limited_server, generation_prefix="<|sid_begin|>")


@pytest.fixture(scope="module")
def bare(tiny_dir):
    yield from _serve(tiny_dir, limited_server, constrained=False, max_input_len=64)


# ---- helpers ---------------------------------------------------------------------------

def unknown_ids(catalog: ItemCatalog, count: int, seed: int = 0) -> list[int]:
    """`count` distinct ids the catalog does not hold."""
    ids = np.random.default_rng(seed).choice(np.int64(1) << 62, count + 1000, replace=False)
    return ids[~np.isin(ids, catalog.item_ids)][:count].tolist()


def answer(path: str, out: dict) -> list[tuple[list[int], list[int]]]:
    """(tokens, item ids) per result, best first, of a route's answer. xllm's answer names
    the first item of each result only (rec_result)."""
    if path == NATIVE:
        return [(r["tokens"], [i["item_id"] for i in r["items"]]) for r in out["results"]]
    if path == CHAT:
        return [(c["token_ids"], [i["item_id"] for i in c["items"]]) for c in out["choices"]]
    first = out["output_tensors"][0]["contents"]["int64_contents"]
    return [(c["logprobs"]["token_ids"], [item] if item >= 0 else [])
            for c, item in zip(out["choices"], first, strict=True)]


def items_of_triples(catalog: ItemCatalog, triples: list[list[int]]) -> list[int]:
    """Every catalog item whose semantic ID is one of `triples`."""
    named = np.asarray(triples, dtype=np.int64)  # [T, 3]
    is_named = (catalog.triples[:, None, :] == named[None]).all(axis=2).any(axis=1)  # [n]
    return catalog.item_ids[is_named].tolist()


def body_for(path: str, served: Served, **fields) -> dict:
    """A valid request for the route and model, with `fields`."""
    if path == CHAT:
        return {"messages": MESSAGES, "beam_width": 8, **fields}
    if served.engine.tokenizer is not None:
        return {"prompt": MESSAGES[0]["content"], "beam_width": 8, **fields}
    return {"token_ids": [1, 2, 3], "beam_width": 8, **fields}


# ---- the bodies' fields become the request's ---------------------------------------------

def test_each_route_puts_the_filters_on_the_request():
    filters = {"exclude_items": [9, 3, 9], "item_types": ["video"], "exclude_history": True}
    native = schemas.native_request(schemas.parse_body(json.dumps(
        {"token_ids": [1], **filters}).encode(), schemas.NativeRequest), "r")
    xllm = schemas.xllm_request(schemas.parse_body(json.dumps(
        {"prompt": "x", **filters}).encode(), schemas.XllmRequest), "r")
    conversation = chat.chat_request(schemas.parse_body(json.dumps(
        {"messages": MESSAGES, **filters}).encode(), chat.ChatRequest), "r")
    for request in (native, xllm, conversation):
        assert (request.exclude_items, request.item_types, request.exclude_history) == \
            ([9, 3, 9], ["video"], True)
    plain = schemas.native_request(schemas.NativeRequest(token_ids=[1]), "r")
    assert (plain.exclude_items, plain.item_types, plain.exclude_history) == (None, None, False)


def test_the_openapi_document_describes_the_filters():
    components = openapi.document(is_auth_on=False)["components"]["schemas"]
    for model in ("NativeRequest", "XllmRequest", "ChatRequest"):
        fields = components[model]["properties"]
        assert {"type": "array", "items": {"type": "integer"}} in fields["exclude_items"]["anyOf"]
        assert {"type": "array", "items": {"type": "string"}} in fields["item_types"]["anyOf"]
        assert fields["exclude_history"]["type"] == "boolean"
        assert "max_exclude_items" in fields["exclude_items"]["description"]
    assert "excluded_items_unknown" in components["NativeResponse"]["properties"]["usage"][
        "description"]


# ---- filters through the routes (need the search part of issue 25) ------------------------

@pytest.mark.parametrize("path", [NATIVE, XLLM])
def test_excluded_items_are_never_recommended(typed, path):
    body = {"token_ids": [5, 17, 9], "beam_width": 16}
    plain = typed.post(NATIVE, body)
    assert "excluded_items_unknown" not in plain["usage"]     # no filter: today's keys
    results = plain["results"]
    gone = [item["item_id"] for item in results[0]["items"]]  # every item of the best SID
    some = [results[3]["items"][0]["item_id"]]
    unknown = unknown_ids(typed.engine.catalog, 3)
    excluded = gone + some + unknown + gone[:1]               # a repeated id counts once
    out = typed.post(path, {**body, "exclude_items": excluded})
    got = answer(path, out)
    assert got and not {i for _, items in got for i in items} & set(excluded)
    assert results[0]["tokens"] not in [tokens for tokens, _ in got]
    assert out["usage"]["excluded_items_unknown"] == 3
    native = answer(NATIVE, typed.post(NATIVE, {**body, "exclude_items": excluded}))
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in native]
    assert [items[:1] for _, items in got] == [items[:1] for _, items in native]


def test_item_types_keep_only_those_types(typed):
    body = {"token_ids": [5, 17, 9], "beam_width": 16}
    types = {r["items"][0]["type"] for r in typed.post(NATIVE, body)["results"]}
    assert types == {"live", "video"}
    out = typed.post(NATIVE, {**body, "item_types": ["video"]})
    assert out["results"] and all(i["type"] == "video" for r in out["results"]
                                  for i in r["items"])
    assert "excluded_items_unknown" not in out["usage"]
    xllm = answer(XLLM, typed.post(XLLM, {**body, "item_types": ["video"]}))
    assert xllm == [(r["tokens"], r["items"] and [r["items"][0]["item_id"]])
                    for r in out["results"]]


def test_chat_excludes_items_and_the_items_it_names(sid):
    """`exclude_history`: every item whose semantic ID the conversation names is left out,
    the same answer as excluding those items by id."""
    base = sid.post(CHAT, {"messages": MESSAGES, "beam_width": 32, "n": 20})
    named = [c["token_ids"] for c in base["choices"]]
    messages = [{"role": "user", "content": "I watched " + ", ".join(
        c["message"]["content"] for c in base["choices"]) + ". What next?"}]
    body = {"messages": messages, "beam_width": 64}
    plain = [tokens for tokens, _ in answer(CHAT, sid.post(CHAT, body))]
    assert any(tokens in named for tokens in plain)   # unfiltered, it recommends them again
    filtered = sid.post(CHAT, {**body, "exclude_history": True})
    assert filtered["choices"] and not any(c["token_ids"] in named for c in filtered["choices"])
    by_ids = sid.post(CHAT, {**body, "exclude_items": items_of_triples(sid.engine.catalog, named)})
    assert answer(CHAT, by_ids) == answer(CHAT, filtered)
    assert by_ids["usage"]["excluded_items_unknown"] == 0
    assert "excluded_items_unknown" not in filtered["usage"]


def test_item_types_on_a_catalog_without_types_is_400(sid):
    for path in (NATIVE, XLLM, CHAT):
        error = assert_error(sid.client.post(path, json=body_for(path, sid,
                                                                  item_types=["video"])), 400)
        assert error["message"].startswith("item_types"), error
    sid.post(NATIVE, body_for(NATIVE, sid))   # nothing else affected


# ---- bad input: 4xx naming the field ------------------------------------------------------

BAD = [  # (route, fields, status, the message's start); the typed server unless "sid"
    (NATIVE, {"exclude_items": [7, -2 ** 63 - 1]}, 400,
     "exclude_items[1]: got -9223372036854775809,"),
    (NATIVE, {"exclude_items": [2 ** 64]}, 400, "exclude_items[0]: got 18446744073709551616,"),
    (NATIVE, {"exclude_items": [1.5]}, 422, "exclude_items[0]: Input should be a valid integer"),
    (NATIVE, {"exclude_items": [True]}, 422, "exclude_items[0]: Input should be a valid integer"),
    (NATIVE, {"exclude_items": "1,2"}, 422, "exclude_items: Input should be a valid"),
    (NATIVE, {"item_types": "video"}, 422, "item_types: Input should be a valid"),
    (NATIVE, {"item_types": ["video", 3]}, 422, "item_types[1]: Input should be a valid string"),
    (NATIVE, {"exclude_history": "yes"}, 422, "exclude_history: Input should be a valid boolean"),
    (NATIVE, {"exclude_history": True}, 400, "exclude_history: needs a decoder-only model"),
    (XLLM, {"exclude_items": [2 ** 63]}, 400, "exclude_items[0]: got 9223372036854775808,"),
    (XLLM, {"item_types": [None]}, 422, "item_types[0]: Input should be a valid string"),
    (XLLM, {"exclude_history": True}, 400, "exclude_history: needs a decoder-only model"),
    ("sid" + CHAT, {"exclude_items": [4, -2 ** 63 - 4]}, 400,
     "exclude_items[1]: got -9223372036854775812,"),
    ("sid" + CHAT, {"exclude_items": [[4]]}, 422, "exclude_items[0]: Input should be a valid"),
    ("sid" + CHAT, {"item_types": "video"}, 422, "item_types: Input should be a valid"),
    ("sid" + CHAT, {"exclude_history": 1}, 422, "exclude_history: Input should be a valid"),
]


@pytest.mark.parametrize("where,fields,status,start", BAD,
                         ids=[f"{w}-{json.dumps(f)[:40]}" for w, f, _, _ in BAD])
def test_bad_filters_are_4xx_naming_the_field(request, where, fields, status, start):
    served = request.getfixturevalue("sid" if where.startswith("sid") else "typed")
    path = where.removeprefix("sid")
    body = body_for(path, served, **fields)
    error = assert_error(served.client.post(path, json=body), status)
    assert error["message"].startswith(start), error
    if status == 400 and path == NATIVE:   # the Python API's own refusal, word for word
        with pytest.raises(InvalidArgument) as info:
            served.engine.validate(RecRequest(**body))
        assert error["message"] == info.value.message
    served.post(path, body_for(path, served))   # nothing else affected


def test_more_than_max_exclude_items_is_400_not_413(typed):
    assert typed.engine.limits.max_exclude_items == MAX_EXCLUDE_ITEMS
    ids = list(range(MAX_EXCLUDE_ITEMS + 1))
    error = assert_error(typed.client.post(NATIVE, json={"token_ids": [1], "exclude_items": ids}),
                         400)
    assert error["message"] == (f"exclude_items: {MAX_EXCLUDE_ITEMS + 1} ids, more than "
                                f"max_exclude_items={MAX_EXCLUDE_ITEMS}")


def test_filters_need_an_engine_that_constrains_to_a_catalog(bare):
    for path, fields in ((NATIVE, {"exclude_items": [1]}), (XLLM, {"item_types": ["video"]})):
        error = assert_error(bare.client.post(path, json=body_for(path, bare, **fields)), 400)
        field = next(iter(fields))
        assert error["message"].startswith(f"{field}: filters restrict the catalog's items"), error
    service = bare.server.server.config.app.state.xrec
    assert service.max_json_values == schemas.max_json_values(bare.engine.limits)
    assert service.max_json_values < MAX_EXCLUDE_ITEMS   # no room kept for ids it refuses


# ---- the body limits admit the largest exclude list -----------------------------------------

def _service(served: Served):
    return served.server.server.config.app.state.xrec


def test_the_largest_exclude_list_is_served_not_413(typed):
    """max_exclude_items ids of up to 19 digits, pretty-printed beside the largest input the model takes
    (two [max_input_len, d_model] embeddings): under the derived limits, answered 200. The
    limits without room for the ids would refuse it 413."""
    limits, service = typed.engine.limits, _service(typed)
    ids = unknown_ids(typed.engine.catalog, MAX_EXCLUDE_ITEMS - 2) + \
        typed.engine.catalog.item_ids[:2].tolist()
    rows = limits.max_input_len
    full = np.random.default_rng(0).standard_normal(rows * limits.d_model).tolist()
    largest = json.dumps({"sparse_embedding": {"shape": [rows, limits.d_model], "data": full},
                          "decoder_context_embedding": {"shape": [rows, limits.d_model],
                                                        "data": full},
                          "beam_width": 4, "request_id": "r" * 256, "exclude_items": ids},
                         indent=1).encode()
    num_values = largest.count(b",") + 1
    assert len(largest) <= service.max_body_bytes and num_values <= service.max_json_values
    without_ids = replace(limits, is_constrained=False)   # today's limits, before the filters
    assert len(largest) > schemas.max_body_bytes(without_ids)
    assert num_values > schemas.max_json_values(without_ids)
    response = typed.client.post(NATIVE, content=largest,
                                 headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text[:500]
    assert len(response.json()["results"]) == 4


def test_a_large_exclude_list_counts_its_unknown_ids(typed):
    catalog = typed.engine.catalog
    known = catalog.item_ids[::7].tolist()
    ids = unknown_ids(catalog, 50_000, seed=1) + known
    out = typed.post(XLLM, {"token_ids": [3, 1, 2], "beam_width": 16, "exclude_items": ids})
    assert out["usage"]["excluded_items_unknown"] == 50_000
    assert not {i for _, items in answer(XLLM, out) for i in items} & set(known)
