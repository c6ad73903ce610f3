"""server/schemas.py without a server: body -> RecRequest, limits, errors (milliseconds).

The HTTP tests (test_server*.py) go through a real uvicorn; these pin the conversions
that the HTTP tests never vary, written against mutants that survived (issue 15).
"""

from __future__ import annotations

import base64
import json

import numpy as np
import orjson
import pytest

from xrec.api_types import RecCandidate, RecItem, RecResponse
from xrec.engine.responses import ResponseData
from xrec.errors import InvalidArgument, PayloadTooLarge
from xrec.server.schemas import (MAX_DIMENSION, MAX_REQUEST_ID_CHARS, NativeRequest,
                                 SchemaError, XllmRequest, check_value_count, native_request,
                                 native_response, parse_body, request_id_of, xllm_request,
                                 xllm_response)


def xllm(**fields):
    return xllm_request(parse_body(json.dumps({"token_ids": [1, 2], **fields}).encode(),
                                   XllmRequest), "rid")


def native(**fields):
    return native_request(parse_body(json.dumps({"token_ids": [1, 2], **fields}).encode(),
                                     NativeRequest), "rid")


@pytest.mark.parametrize("top_k, expected", [(0, None), (-1, None), (-7, None), (None, None),
                                             (1, 1), (32, 32)])
def test_xllm_top_k_zero_or_negative_means_the_default(top_k, expected):
    """xllm's -1 is "no cutoff", 0 unset: both leave top_k to the engine's default."""
    assert xllm(top_k=top_k).top_k == expected


def test_native_top_k_is_passed_through_for_the_engine_to_validate():
    assert native(top_k=0).top_k == 0
    assert native(top_k=5).top_k == 5


@pytest.mark.parametrize("fields, expected", [({"n": 3}, 3), ({"num_return_sequences": 3}, 3),
                                              ({"n": 3, "num_return_sequences": 3}, 3), ({}, None)])
def test_xllm_n_is_num_return_sequences(fields, expected):
    """OpenAI's `n` means N on /v1/completions as on chat; neither: the engine's default (W)."""
    assert xllm(**fields).num_return_sequences == expected


def test_xllm_fields_reach_the_request():
    request = xllm(beam_width=8, num_return_sequences=3, normalize="full", return_items=False,
                   timeout_ms=250.0, prompt="")
    assert (request.beam_width, request.num_return_sequences, request.normalize) == (8, 3, "full")
    assert request.return_items is False and request.timeout_ms == 250.0
    assert request.prompt is None and request.token_ids == [1, 2] and request.request_id == "rid"


def test_native_fields_reach_the_request():
    request = native(beam_width=4, num_return_sequences=2, normalize="allowed", temperature=0.5,
                     return_items=False, timeout_ms=10.0, seed=7)
    assert (request.beam_width, request.num_return_sequences, request.normalize) == (
        4, 2, "allowed")
    assert (request.temperature, request.return_items, request.timeout_ms, request.seed) == (
        0.5, False, 10.0, 7)
    assert native().temperature == 1.0 and native().return_items is True


@pytest.mark.parametrize("fields, words", [
    ({"n": 2, "num_return_sequences": 3}, "n: got 2 and num_return_sequences 3"),
    ({"n": 0}, "n: got 0, expected >= 1"),
    ({"max_tokens": -1}, "max_tokens: got -1"),
    ({"logprobs": -2}, "logprobs: got -2"),
    ({"input_tensors": [{"name": "x", "data_type": "FLOAT", "shape": [1, 1],
                         "contents": {"fp32_contents": [1.0]}}]}, "input_tensors[0].name: got 'x'"),
    ({"input_tensors": [{"name": "sparse_embedding", "data_type": "INT64", "shape": [1, 1],
                         "contents": {"fp32_contents": [1.0]}}]}, "data_type: got 'INT64'"),
    ({"input_tensors": [{"name": "sparse_embedding", "data_type": "FLOAT", "shape": [1, 1],
                         "contents": {}}]}, "fp32_contents: missing"),
    ({"input_tensors": [{"name": "sparse_embedding", "data_type": "FLOAT", "shape": [1, 1],
                         "contents": {"fp32_contents": [1.0], "bool_contents": [True]}}]},
     "got bool_contents for a FLOAT tensor"),
    ({"input_tensors": [{"name": "sparse_embedding", "data_type": "FLOAT", "shape": [1, 2],
                         "contents": {"fp32_contents": [1.0]}}]}, "got 1 values, shape [1, 2]"),
])
def test_bad_xllm_requests_name_the_field(fields, words):
    with pytest.raises(InvalidArgument) as info:
        xllm(**fields)
    assert words in str(info.value) and not isinstance(info.value, SchemaError)


def test_xllm_accepts_what_is_allowed_at_the_edges():
    assert xllm(max_tokens=0, logprobs=0, stream=False).token_ids == [1, 2]
    assert xllm(logprobs=True).token_ids == [1, 2]


def test_xllm_input_tensors_by_name_and_enum_number():
    tensor = {"name": "sparse_embedding", "data_type": 1, "shape": [2, 2],
              "contents": {"fp32_contents": [1.0, 2.0, 3.0, 4.0]}}
    context = dict(tensor, name="decoder_context_embedding", data_type="FLOAT", shape=[1, 4])
    request = xllm(input_tensors=[tensor, context])
    assert request.sparse_embedding.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert request.sparse_embedding.dtype == np.float32
    assert request.decoder_context_embedding.shape == (1, 4)
    with pytest.raises(InvalidArgument, match=r"input_tensors\[1\].name: 'sparse_embedding' "
                                              "given twice"):
        xllm(input_tensors=[tensor, tensor])


def test_native_embeddings_as_data_or_base64():
    values = np.arange(6, dtype="<f4")
    b64 = base64.b64encode(values.tobytes()).decode()
    by_data = native(sparse_embedding={"shape": [2, 3], "data": values.tolist()})
    by_b64 = native(decoder_context_embedding={"shape": [3, 2], "b64": b64})
    assert by_data.sparse_embedding.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert by_b64.decoder_context_embedding.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert by_b64.decoder_context_embedding.dtype == np.float32


@pytest.mark.parametrize("matrix, words", [
    ({"shape": [1, 1], "data": [1.0], "b64": "AAAAAA=="}, "exactly one of data / b64, got both"),
    ({"shape": [1, 1]}, "exactly one of data / b64, got neither"),
    ({"shape": [1, 1], "b64": "!!"}, "sparse_embedding.b64: not valid base64"),
    ({"shape": [1, 2], "b64": "AAAAAA=="}, "decodes to 4 bytes, shape [1, 2] needs 8"),
    ({"shape": [3], "data": [1.0]}, "sparse_embedding.shape: got [3]"),
    ({"shape": [1, 2, 3, 4, 5], "data": [1.0]}, "got a list of 5 integers"),
    ({"shape": [-1, 1], "data": [1.0]}, "got [-1, 1]"),
    ({"shape": [1, MAX_DIMENSION + 1], "data": [1.0]}, f"two integers in [0, {MAX_DIMENSION}]"),
])
def test_bad_native_embeddings_name_the_field(matrix, words):
    with pytest.raises(InvalidArgument) as info:
        native(sparse_embedding=matrix)
    assert words in str(info.value)


def test_shape_bounds_are_inclusive():
    assert native(sparse_embedding={"shape": [0, MAX_DIMENSION], "data": []}) \
        .sparse_embedding.shape == (0, MAX_DIMENSION)


def test_body_errors_are_400_for_bad_json_and_422_for_the_wrong_shape():
    with pytest.raises(InvalidArgument, match="malformed JSON body") as info:
        parse_body(b"{", NativeRequest)
    assert not isinstance(info.value, SchemaError)
    with pytest.raises(SchemaError, match="bogus: unknown field"):
        parse_body(b'{"bogus": 1}', NativeRequest)
    with pytest.raises(SchemaError, match=r"token_ids\[1\]: .*\(got 'x'\)") as info:
        parse_body(b'{"token_ids": [1, "x"]}', NativeRequest)
    assert info.value.http_status == 422


def test_schema_errors_name_three_fields_then_count_the_rest():
    body = json.dumps({f"f{i}": i for i in range(5)}).encode()
    with pytest.raises(SchemaError) as info:
        parse_body(body, NativeRequest)
    message = str(info.value)
    assert message.count("unknown field") == 3 and "(and 2 more)" in message


def test_long_wrong_values_are_cut_in_the_message():
    with pytest.raises(SchemaError) as info:
        parse_body(json.dumps({"prompt": list(range(100))}).encode(), NativeRequest)
    message = str(info.value)
    assert "..." in message and "99" not in message


def test_request_ids():
    assert request_id_of(NativeRequest(request_id="a-1")) == "a-1"
    assert request_id_of(NativeRequest(request_id="x" * MAX_REQUEST_ID_CHARS))
    fresh = request_id_of(NativeRequest())
    assert len(fresh) == 32 and fresh != request_id_of(NativeRequest())
    with pytest.raises(InvalidArgument, match="got 257 characters, expected 1 to 256"):
        request_id_of(NativeRequest(request_id="x" * (MAX_REQUEST_ID_CHARS + 1)))
    with pytest.raises(InvalidArgument, match="got 0 characters"):
        request_id_of(NativeRequest(request_id=""))
    with pytest.raises(InvalidArgument, match="U\\+0020 at position 1 is not allowed"):
        request_id_of(NativeRequest(request_id="a b"))
    with pytest.raises(InvalidArgument, match="U\\+00E9 at position 0"):
        request_id_of(NativeRequest(request_id="\u00e9"))


def test_value_count_limit_is_inclusive():
    check_value_count(b"[1,2,3]", 3)
    check_value_count(b"[1,2,3]", 100)            # short bodies are not counted
    with pytest.raises(PayloadTooLarge, match="up to 4 JSON values .* holds 3"):
        check_value_count(b"[1,2,3,4]", 3)


def _response() -> RecResponse:
    results = [RecCandidate(tokens=(5, 6), score=-1.5, token_logprobs=(-1.0, -0.5),
                            items=[RecItem(item_id=42)]),
               RecCandidate(tokens=(7, 8), score=-2.0, token_logprobs=(-1.5, -0.5))]
    return RecResponse(request_id="rid", results=results, usage={"input_tokens": 3},
                       timing={"run_ms": 1.0})


def test_xllm_response_with_items_on_and_off():
    on = xllm_response(_response(), "m", rounds=2, is_items_on=True)
    assert [c["text"] for c in on["choices"]] == ["5 6", "7 8"]
    assert on["choices"][1]["logprobs"] == {"tokens": ["7", "8"], "token_ids": [7, 8],
                                            "token_logprobs": [-1.5, -0.5]}
    rec, sku = on["output_tensors"]
    assert rec == {"name": "rec_result", "datatype": "INT64", "shape": [2],
                   "contents": {"int64_contents": [42, -1]}}
    assert sku["shape"] == [2, 2] and sku["contents"]["fp32_contents"] == [-1.0, -0.5, -1.5, -0.5]
    assert on["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    off = xllm_response(_response(), "m", rounds=2, is_items_on=False,
                        token_string=lambda t: f"<{t}>" if t != 8 else None)
    assert off["output_tensors"][0]["contents"] == {"int_contents": [5, 6, 7, 8]}
    assert off["output_tensors"][0]["datatype"] == "INT32"
    assert off["choices"][1]["logprobs"]["tokens"] == ["<7>", "8"]


def _data(is_extended: bool, has_text: bool) -> ResponseData:
    """Three results: two items, none, one (the first three rows of an extended catalog)."""
    return ResponseData(
        "rid", np.array([[5, 6], [7, 8], [9, 1]]), np.array([-1.5, -2.0, -2.25], np.float32),
        np.array([[-1.0, -0.5], [-1.5, -0.5], [-2.0, -0.25]], np.float32),
        np.array([42, 43, 44]), np.array([0, 2, 2, 3]),
        ["d42", "d43", "d44"] if is_extended else None, ["a", "b", "c"] if is_extended else None,
        ["<5><6>", "<7><8>", "<9><1>"] if has_text else None, {"input_tokens": 3},
        {"run_ms": 1.0}, "hash")


@pytest.mark.parametrize("is_extended, has_text", [(False, False), (True, True)])
def test_native_response_is_the_response_objects_as_json(is_extended, has_text):
    """The native answer is written from the arrays; its JSON is that of the `RecResponse`
    the Python API gives for the same answer (orjson writes a dataclass as its fields)."""
    data = _data(is_extended, has_text)
    response = data.to_response()
    body = native_response(data, "m")
    assert orjson.loads(orjson.dumps(body)) == orjson.loads(orjson.dumps(
        {"id": "rid", "model": "m", "results": response.results, "usage": response.usage,
         "timing": response.timing}))
    assert [len(r["items"]) for r in body["results"]] == [2, 0, 1]


# ---- written against the survivors of the first `make mutate` ----------------------------

def test_every_native_field_reaches_the_request():
    messages = [{"role": "user", "content": "hi"}]
    request = native(prompt="hello", messages=messages)
    assert (request.token_ids, request.prompt, request.messages) == ([1, 2], "hello", messages)
    assert request.request_id == "rid"
    assert xllm(prompt="hello").prompt == "hello"


@pytest.mark.parametrize("field", ["sparse_embedding", "decoder_context_embedding"])
def test_embedding_errors_name_the_field_and_the_part(field):
    with pytest.raises(InvalidArgument, match=rf"^{field}\.data: got 1 values, shape \[1, 2\]"):
        native(**{field: {"shape": [1, 2], "data": [1.0]}})
    with pytest.raises(InvalidArgument, match=rf"^{field}\.shape: got \[1\]"):
        native(**{field: {"shape": [1], "b64": "AAAAAA=="}})


def test_xllm_tensor_errors_name_the_tensor():
    tensor = {"name": "sparse_embedding", "data_type": "FLOAT", "shape": [1, 2],
              "contents": {"fp32_contents": [1.0]}}
    with pytest.raises(InvalidArgument, match=r"^input_tensors\[0\]\.contents\.fp32_contents: "
                                              r"got 1 values"):
        xllm(input_tensors=[tensor])


def test_overflowing_floats_become_inf_without_a_warning():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        request = native(sparse_embedding={"shape": [1, 1], "data": [1e39]})
    assert np.isinf(request.sparse_embedding).all()


def test_shapes_of_up_to_four_numbers_are_repeated_in_the_message():
    with pytest.raises(InvalidArgument, match=r"got \[1, 2, 3, 4\], expected"):
        native(sparse_embedding={"shape": [1, 2, 3, 4], "data": [1.0]})


def test_value_count_is_not_counted_for_a_body_no_longer_than_the_limit():
    check_value_count(b",,,", 3)              # 4 values by commas, but only 3 bytes
    with pytest.raises(PayloadTooLarge):
        check_value_count(b",,,,", 3)


def test_request_id_characters_from_bang_to_tilde_are_allowed():
    assert request_id_of(NativeRequest(request_id="!az~")) == "!az~"
    with pytest.raises(InvalidArgument, match="U\\+007F at position 0"):
        request_id_of(NativeRequest(request_id="\x7f"))


def test_schema_error_messages_exactly():
    with pytest.raises(SchemaError) as info:
        parse_body(b'{"a": 1, "b": 2, "c": 3}', NativeRequest)
    assert str(info.value) == "a: unknown field; b: unknown field; c: unknown field"
    with pytest.raises(SchemaError) as info:
        parse_body(b"[]", NativeRequest)
    assert str(info.value).startswith("body: ")
    with pytest.raises(SchemaError) as info:
        parse_body(b'{"token_ids": [1, "x"]}', NativeRequest)
    assert str(info.value).startswith("token_ids[1]: ")


@pytest.mark.parametrize("length, shown", [(58, None), (59, 60)])
def test_wrong_values_are_cut_after_60_characters(length, shown):
    value = "a" * length                            # its repr is length + 2 characters
    with pytest.raises(SchemaError) as info:
        parse_body(json.dumps({"token_ids": value}).encode(), NativeRequest)
    message = str(info.value)
    if shown is None:
        assert message.endswith(f"(got {value!r})")
    else:
        assert message.endswith(f"(got {repr(value)[:shown]}...)")


def test_xllm_response_fields_by_name():
    response = _response()
    off = xllm_response(response, "m", rounds=2, is_items_on=False)
    assert [c["index"] for c in off["choices"]] == [0, 1]
    assert off["output_tensors"][0]["name"] == "rec_result"
    assert off["output_tensors"][0]["shape"] == [2, 2]
    bare = RecResponse(request_id="rid", results=response.results, usage={}, timing={})
    assert xllm_response(bare, "m", rounds=2, is_items_on=True)["usage"]["prompt_tokens"] == 0



def _limits(accepts_embeddings: bool, d_model: int, is_constrained: bool = False):
    from xrec.api_types import SearchLimits
    return SearchLimits(vocab_size=100, d_model=d_model, max_input_len=10, max_beam_width=4,
                        max_top_k=4, default_beam_width=4, default_normalize="allowed",
                        accepts_embeddings=accepts_embeddings, is_constrained=is_constrained,
                        max_exclude_items=1000)


def test_body_limits_are_the_largest_valid_request():
    """Two [max_input_len, d_model] embeddings, or max_input_len tokens of prompt text,
    plus the margins; the larger of the two."""
    from xrec.server.schemas import max_body_bytes, max_json_values
    slack = 64 << 10
    # text: 10 tokens * (1 + 16) values, 10 * 256 bytes; embeddings: 2 * 10 * d_model values
    assert max_json_values(_limits(True, 2)) == 10 * 17 + 4096
    assert max_body_bytes(_limits(True, 2)) == 10 * 256 + slack          # 2560 > 2 * 20 * 32
    assert max_json_values(_limits(True, 64)) == 2 * 10 * 64 + 4096
    assert max_body_bytes(_limits(True, 64)) == 2 * 10 * 64 * 32 + slack
    assert max_json_values(_limits(False, 64)) == 10 * 17 + 4096       # no embeddings read
    assert max_body_bytes(_limits(False, 64)) == 10 * 256 + slack
    # a catalog constrains the search: room for max_exclude_items ids as well
    assert max_json_values(_limits(True, 64, True)) == 2 * 10 * 64 + 1000 + 4096
    assert max_body_bytes(_limits(True, 64, True)) == (2 * 10 * 64 + 1000) * 32 + slack
    assert max_body_bytes(_limits(False, 64, True)) == 10 * 256 + 1000 * 32 + slack


def test_filter_usage_reaches_the_openai_shaped_answers():
    response = _response()
    assert "excluded_items_unknown" not in xllm_response(response, "m", 2, False)["usage"]
    counted = RecResponse(request_id="rid", results=response.results,
                          usage={"input_tokens": 3, "excluded_items_unknown": 4}, timing={})
    assert xllm_response(counted, "m", rounds=2, is_items_on=False)["usage"] == \
        {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
         "excluded_items_unknown": 4}


def test_the_first_character_outside_bang_to_tilde_is_named():
    with pytest.raises(InvalidArgument, match="U\\+0020 at position 2 is not allowed"):
        request_id_of(NativeRequest(request_id="!~ x"))


def test_four_schema_errors_show_three_and_count_one():
    with pytest.raises(SchemaError) as info:
        parse_body(b'{"a": 1, "b": 2, "c": 3, "d": 4}', NativeRequest)
    assert str(info.value).endswith("c: unknown field (and 1 more)")
