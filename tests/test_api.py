"""The Python API at the edge: request validation, public names, engine lifecycle.

Every malformed request raises `xrec.InvalidArgument` (code INVALID_ARGUMENT) whose message
names the offending field, before anything is queued, and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

import xrec
from oracles.weights import random_state_dict, save_checkpoint
from bounded import recommend_within
from xrec import Engine, InvalidArgument, RecCandidate, RecItem, RecRequest, RecResponse
from xrec.catalog import ItemCatalog
from xrec.config import ModelConfig

TIMEOUT_S = 60.0
VOCAB, D_MODEL = 64, 32
MAX_INPUT_LEN, MAX_BEAM_WIDTH, MAX_TOP_K = 16, 8, 16

CFG = ModelConfig(d_model=D_MODEL, d_ff=64, num_encoder_layers=1, num_decoder_layers=1, num_heads=4,
                  head_dim=8, num_kv_heads=2, decoder_num_heads=4, decoder_head_dim=8,
                  decoder_num_kv_heads=2, vocab_size=VOCAB, relative_attention_num_buckets=16,
                  relative_attention_max_distance=20, torch_dtype="float32")


def wait(future, timeout: float = TIMEOUT_S):
    try:
        return future.result(timeout=timeout)
    except TimeoutError:  # concurrent.futures.TimeoutError is TimeoutError on 3.11+
        pytest.fail(f"no answer within {timeout} s")


def recommend(engine: Engine, requests, timeout: float = TIMEOUT_S):
    return recommend_within(engine, requests, timeout)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = save_checkpoint(tmp_path_factory.mktemp("model"), CFG, random_state_dict(CFG, seed=3))
    # every (t0, t1) prefix has 8 last tokens: W=8 beams reach N=16 items
    triples = [(a, b, c) for a in range(3, 11) for b in range(20, 24) for c in range(40, 48)]
    item_ids = np.random.default_rng(1).choice(1 << 40, size=len(triples), replace=False) + 1
    ItemCatalog.from_arrays(item_ids, triples, VOCAB).write(directory / "items.bin")
    (directory / "tokenizer_config.json").write_text('{"vocab_file": "items.bin"}')
    return directory


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = Engine.from_pretrained(model_dir, isolation="thread",
                                    device="cpu", dtype="float32", max_input_len=MAX_INPUT_LEN,
                                    max_beam_width=MAX_BEAM_WIDTH, max_top_k=MAX_TOP_K, default_beam_width=4)
    assert engine.catalog is not None and engine.step.tables is not None
    yield engine
    engine.close()


def good_request(**kw) -> RecRequest:
    return RecRequest(token_ids=[5, 17, 9], **kw)


def emb(rows: int, width: int = D_MODEL) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((rows, width)).astype(np.float32)


def with_value(array: np.ndarray, value: float, at=(1, 2)) -> np.ndarray:
    array = array.copy()
    array[at] = value
    return array


def assert_still_serving(engine: Engine) -> None:
    response, = recommend(engine, [good_request(beam_width=4)])
    assert isinstance(response, RecResponse) and len(response.results) == 4
    assert all(c.items for c in response.results)


# (id, RecRequest kwargs, words the message must contain)
BAD_REQUESTS = [
    ("both-inputs", dict(token_ids=[1, 2], sparse_embedding=emb(2)), ["token_ids", "sparse_embedding", "both"]),
    ("neither-input", dict(), ["token_ids", "sparse_embedding", "neither"]),
    ("embedding-width", dict(sparse_embedding=emb(3, D_MODEL - 1)), ["sparse_embedding", str(D_MODEL)]),
    ("embedding-1d", dict(sparse_embedding=emb(1)[0]), ["sparse_embedding"]),
    ("embedding-3d", dict(sparse_embedding=emb(3)[None]), ["sparse_embedding"]),
    ("embedding-text", dict(sparse_embedding=[["a"] * D_MODEL]), ["sparse_embedding"]),
    ("embedding-nan", dict(sparse_embedding=with_value(emb(3), math.nan)), ["sparse_embedding", "NaN"]),
    ("embedding-inf", dict(sparse_embedding=with_value(emb(3), math.inf)), ["sparse_embedding", "Inf"]),
    ("embedding-neg-inf", dict(sparse_embedding=with_value(emb(3), -math.inf)), ["sparse_embedding"]),
    ("embedding-float32-overflow", dict(sparse_embedding=with_value(emb(3).astype(np.float64), 1e39)),
     ["sparse_embedding", "float32"]),
    ("context-nan", dict(token_ids=[1, 2], decoder_context_embedding=with_value(emb(2), math.nan)),
     ["decoder_context_embedding"]),
    ("context-inf", dict(token_ids=[1, 2], decoder_context_embedding=with_value(emb(2), math.inf, (0, 0))),
     ["decoder_context_embedding"]),
    ("context-width", dict(token_ids=[1, 2], decoder_context_embedding=emb(2, D_MODEL + 3)),
     ["decoder_context_embedding", str(D_MODEL)]),
    ("context-1d", dict(token_ids=[1, 2], decoder_context_embedding=emb(1)[0]), ["decoder_context_embedding"]),
    ("context-empty", dict(token_ids=[1, 2], decoder_context_embedding=np.zeros((0, D_MODEL), np.float32)),
     ["decoder_context_embedding"]),
    ("context-too-long", dict(token_ids=[1, 2], decoder_context_embedding=emb(MAX_INPUT_LEN + 1)),
     ["decoder_context_embedding", "max_input_len"]),
    ("id-negative", dict(token_ids=[3, -1, 4]), ["token_ids", "-1"]),
    ("id-vocab", dict(token_ids=[3, VOCAB]), ["token_ids", str(VOCAB)]),
    ("id-huge", dict(token_ids=[10 ** 12]), ["token_ids"]),
    ("id-beyond-int64", dict(token_ids=[2 ** 70]), ["token_ids", str(2 ** 70)]),
    ("id-int64-wrap", dict(token_ids=[2 ** 63]), ["token_ids[0]", str(2 ** 63)]),
    ("id-mixed-wide", dict(token_ids=[1, -1, 2 ** 63]), ["token_ids[1]", "-1"]),
    ("ids-empty", dict(token_ids=[]), ["token_ids", "empty"]),
    ("embedding-empty", dict(sparse_embedding=np.zeros((0, D_MODEL), np.float32)), ["sparse_embedding"]),
    ("ids-too-long", dict(token_ids=[1] * (MAX_INPUT_LEN + 1)), ["token_ids", "max_input_len"]),
    ("embedding-too-long", dict(sparse_embedding=emb(MAX_INPUT_LEN + 1)), ["sparse_embedding", "max_input_len"]),
    ("ids-float", dict(token_ids=[1.5, 2]), ["token_ids"]),
    ("ids-text", dict(token_ids=["1", "2"]), ["token_ids"]),
    ("ids-string", dict(token_ids="123"), ["token_ids"]),
    ("ids-bool", dict(token_ids=[True, False]), ["token_ids"]),
    ("ids-nested", dict(token_ids=[[1, 2], [3, 4]]), ["token_ids"]),
    ("ids-ragged", dict(token_ids=[[1, 2], [3]]), ["token_ids"]),
    ("ids-none-inside", dict(token_ids=[1, None]), ["token_ids"]),
    ("width-zero", dict(token_ids=[1], beam_width=0), ["beam_width", "0"]),
    ("width-negative", dict(token_ids=[1], beam_width=-3), ["beam_width"]),
    ("width-too-big", dict(token_ids=[1], beam_width=MAX_BEAM_WIDTH + 1), ["beam_width", str(MAX_BEAM_WIDTH)]),
    ("width-float", dict(token_ids=[1], beam_width=4.0), ["beam_width"]),
    ("width-text", dict(token_ids=[1], beam_width="4"), ["beam_width"]),
    ("width-bool", dict(token_ids=[1], beam_width=True), ["beam_width"]),
    ("top-k-below-width", dict(token_ids=[1], beam_width=4, top_k=3), ["top_k"]),
    ("top-k-too-big", dict(token_ids=[1], beam_width=4, top_k=MAX_TOP_K + 1), ["top_k", str(MAX_TOP_K)]),
    ("n-zero", dict(token_ids=[1], beam_width=4, num_return_sequences=0), ["num_return_sequences"]),
    ("n-too-big", dict(token_ids=[1], beam_width=4, num_return_sequences=MAX_TOP_K + 1),
     ["num_return_sequences", str(MAX_TOP_K)]),
    ("n-float", dict(token_ids=[1], beam_width=4, num_return_sequences=4.5), ["num_return_sequences"]),
    ("normalize-unknown", dict(token_ids=[1], normalize="softmax"), ["normalize", "softmax", "allowed"]),
    ("normalize-case", dict(token_ids=[1], normalize="FULL"), ["normalize"]),
    ("temperature-negative", dict(token_ids=[1], temperature=-0.5), ["temperature"]),
    ("temperature-nan", dict(token_ids=[1], temperature=math.nan), ["temperature"]),
    ("temperature-inf", dict(token_ids=[1], temperature=math.inf), ["temperature"]),
    ("temperature-text", dict(token_ids=[1], temperature="hot"), ["temperature"]),
    ("temperature-bool", dict(token_ids=[1], temperature=True), ["temperature"]),
    # issue 12, item 4: below the floor the scaled log-probs overflow float32 (an empty 200 before)
    ("temperature-tiny", dict(token_ids=[1], temperature=1e-38), ["temperature", "1e-38", "1e-06"]),
    ("temperature-below-floor", dict(token_ids=[1], temperature=9e-7), ["temperature", "1e-06"]),
    # issue 12, item 11: no real part silently taken, no text parsed as numbers
    ("embedding-complex", dict(sparse_embedding=emb(2).astype(np.complex64)),
     ["sparse_embedding", "complex64"]),
    ("embedding-complex-list", dict(sparse_embedding=[[1j] * D_MODEL]), ["sparse_embedding", "complex"]),
    ("embedding-text", dict(sparse_embedding=[["0.5"] * D_MODEL]), ["sparse_embedding"]),
    ("embedding-bool", dict(sparse_embedding=np.ones((2, D_MODEL), dtype=bool)), ["sparse_embedding", "bool"]),
    ("embedding-none-inside", dict(sparse_embedding=[[None] * D_MODEL]), ["sparse_embedding"]),
    ("timeout-zero", dict(token_ids=[1], timeout_ms=0), ["timeout_ms"]),
    ("timeout-negative", dict(token_ids=[1], timeout_ms=-10), ["timeout_ms"]),
    ("timeout-nan", dict(token_ids=[1], timeout_ms=math.nan), ["timeout_ms"]),
    ("timeout-inf", dict(token_ids=[1], timeout_ms=math.inf), ["timeout_ms"]),
    ("timeout-text", dict(token_ids=[1], timeout_ms="100"), ["timeout_ms"]),
    ("request-id-empty", dict(token_ids=[1], request_id=""), ["request_id"]),
    ("request-id-int", dict(token_ids=[1], request_id=123), ["request_id"]),
    ("request-id-long", dict(token_ids=[1], request_id="x" * 257), ["request_id"]),
    ("return-items-text", dict(token_ids=[1], return_items="yes"), ["return_items"]),
    ("seed-negative", dict(token_ids=[1], seed=-1), ["seed"]),
    ("seed-negative-numpy", dict(token_ids=[1], seed=np.int64(-1)), ["seed"]),
    ("seed-float", dict(token_ids=[1], seed=1.0), ["seed"]),
    # a review of 2026-12-06: ints beyond a float raised OverflowError, object arrays skipped
    # the element checks (5.7 and True were taken as ids 5 and 1)
    ("temperature-huge-int", dict(token_ids=[1], temperature=10 ** 400), ["temperature"]),
    ("timeout-huge-int", dict(token_ids=[1], timeout_ms=10 ** 400), ["timeout_ms"]),
    ("width-thousands-of-digits", dict(token_ids=[1], beam_width=10 ** 5000),
     ["beam_width", "bits"]),
    ("ids-object-floats", dict(token_ids=np.array([5.7, 17.2, 9.9], dtype=object)),
     ["token_ids", "integer"]),
    ("ids-object-bool", dict(token_ids=np.array([True, 17, 9], dtype=object)), ["token_ids"]),
    ("ids-object-none", dict(token_ids=np.array([None, 17], dtype=object)), ["token_ids"]),
    ("ids-object-text", dict(token_ids=np.array(["a", 17], dtype=object)), ["token_ids"]),
]


@pytest.mark.filterwarnings("error")   # no numpy RuntimeWarning (overflow, invalid cast) on bad input
@pytest.mark.parametrize("kwargs,words", [pytest.param(kw, words, id=name) for name, kw, words in BAD_REQUESTS])
def test_bad_request_names_the_field(engine, kwargs, words):
    request = RecRequest(**kwargs)
    with pytest.raises(InvalidArgument) as info:
        engine.submit(request)
    error = info.value
    assert error.code == "INVALID_ARGUMENT" and error.http_status == 400
    assert isinstance(error, xrec.XrecError) and isinstance(error, ValueError)
    for word in words:
        assert word in str(error), f"message {str(error)!r} does not mention {word!r}"
    assert error.message == str(error)
    # the batch API validates before queueing, and raises the same error
    with pytest.raises(InvalidArgument) as again:
        recommend(engine, [good_request(), request])
    assert str(again.value) == str(error) or "request_id" in words
    assert_still_serving(engine)


def test_request_id_is_kept_and_tagged(engine):
    response, = recommend(engine, [good_request(request_id="client-42", beam_width=2)])
    assert response.request_id == "client-42"
    with pytest.raises(InvalidArgument) as info:
        engine.submit(RecRequest(token_ids=[VOCAB], request_id="client-43"))
    assert info.value.request_id == "client-43"
    first, second = recommend(engine, [good_request(), good_request()])
    assert first.request_id and second.request_id and first.request_id != second.request_id


def test_valid_edge_values_are_accepted(engine):
    """The limits themselves are allowed."""
    requests = [
        RecRequest(token_ids=[0, VOCAB - 1] * (MAX_INPUT_LEN // 2), beam_width=MAX_BEAM_WIDTH,
                   top_k=MAX_TOP_K, num_return_sequences=MAX_TOP_K, normalize="full", temperature=0),
        RecRequest(token_ids=np.array([1, 2, 3], dtype=np.int32), beam_width=np.int64(1)),
        RecRequest(sparse_embedding=emb(MAX_INPUT_LEN).tolist(), decoder_context_embedding=emb(2),
                   timeout_ms=60_000, request_id="r" * 256, seed=0),
        RecRequest(token_ids=(4,), beam_width=3, return_items=False, temperature=2),
        RecRequest(token_ids=[4], beam_width=2, temperature=np.float32(0.5), timeout_ms=np.int64(60_000)),
    ]
    responses = recommend(engine, requests)
    assert [len(r.results) for r in responses] == [MAX_TOP_K, 1, 4, 3, 2]
    assert all(isinstance(c, RecCandidate) and len(c.tokens) == 3 for r in responses for c in r.results)
    assert responses[3].results[0].items == []
    assert all(isinstance(i, RecItem) for c in responses[0].results for i in c.items)
    assert responses[0].usage["input_tokens"] == MAX_INPUT_LEN
    assert {"queue_ms", "run_ms"} <= set(responses[0].timing)


def test_out_of_range_id_is_named_as_sent(engine):
    """Issue 12, item 10: 2**63 was cast to int64 first and reported as -2**63."""
    for value in (2 ** 63, 2 ** 64 - 1, 2 ** 64):
        with pytest.raises(InvalidArgument) as info:
            engine.submit(RecRequest(token_ids=[1, value]))
        assert f"token_ids[1]: got {value}," in info.value.message
        assert "-9223372036854775808" not in info.value.message


def test_numpy_scalars_are_accepted_like_python_ones(engine):
    """Issue 12, item 11: seed=np.int64(1) was refused while beam_width=np.int64(8) passed."""
    numpy_kw = dict(token_ids=np.array([1, 2, 3]), beam_width=np.int64(4), top_k=np.int32(4),
                    num_return_sequences=np.int16(3), seed=np.int64(1), return_items=np.bool_(True),
                    temperature=np.float32(0.5), timeout_ms=np.float64(60_000))
    plain_kw = dict(token_ids=[1, 2, 3], beam_width=4, top_k=4, num_return_sequences=3, seed=1,
                    return_items=True, temperature=0.5, timeout_ms=60_000)
    numpy_answer, plain_answer = recommend(engine, [RecRequest(**numpy_kw), RecRequest(**plain_kw)])
    assert [c.tokens for c in numpy_answer.results] == [c.tokens for c in plain_answer.results]
    assert [c.items for c in numpy_answer.results] == [c.items for c in plain_answer.results]
    valid = engine.validate(RecRequest(**numpy_kw))
    assert type(valid.seed) is int and type(valid.return_items) is bool


def test_temperature_floor_gives_real_results(engine):
    """Issue 12, item 4: 1e-38 gave an empty 200 (logits / T overflowed float32 to inf, then
    NaN scores); the floor 1e-6 gives every result, finite, ranked as T -> 0 ranks them."""
    floor = xrec.api_types.MIN_TEMPERATURE
    for normalize in ("allowed", "full"):
        at_floor, sharp = recommend(engine, [
            good_request(beam_width=8, temperature=floor, normalize=normalize),
            good_request(beam_width=8, temperature=10 * floor, normalize=normalize)])
        assert len(at_floor.results) == 8
        assert all(math.isfinite(c.score) for c in at_floor.results)
        # scores are ~ (logit gaps) / T there: a smaller T scales them, the ranking stays
        assert [c.tokens for c in at_floor.results] == [c.tokens for c in sharp.results]


def test_defaults_apply(engine):
    response, = recommend(engine, [RecRequest(token_ids=[1, 2, 3])])
    assert len(response.results) == 4          # default_beam_width=4 -> N = W = 4
    scores = [c.score for c in response.results]
    assert scores == sorted(scores, reverse=True)
    assert all(c.score == pytest.approx(sum(c.token_logprobs), abs=1e-5) for c in response.results)


def test_not_a_request(engine):
    with pytest.raises(InvalidArgument, match="RecRequest"):
        engine.submit({"token_ids": [1, 2]})
    with pytest.raises(InvalidArgument, match=r"requests\[1\]"):
        engine.recommend([good_request(), {"token_ids": [1]}])
    # issue 12, item 11: None (or any non-sequence) was a TypeError
    for value in (None, 5, object()):
        with pytest.raises(InvalidArgument, match="RecRequest"):
            engine.recommend(value)
        with pytest.raises(InvalidArgument, match="RecRequest"):
            engine.submit_many(value)
    assert_still_serving(engine)


def test_public_names():
    from xrec import errors

    for name in ("Engine", "RecRequest", "RecResponse", "RecCandidate", "RecItem", "XrecError",
                 "InvalidArgument", "Unauthenticated", "NotFound", "PayloadTooLarge",
                 "ResourceExhausted", "Cancelled", "Internal", "Unavailable", "DeadlineExceeded"):
        assert hasattr(xrec, name), name
        assert name in xrec.__all__, name
    codes = {"InvalidArgument": ("INVALID_ARGUMENT", 400), "Unauthenticated": ("UNAUTHENTICATED", 401),
             "NotFound": ("NOT_FOUND", 404), "PayloadTooLarge": ("PAYLOAD_TOO_LARGE", 413),
             "ResourceExhausted": ("RESOURCE_EXHAUSTED", 429), "Cancelled": ("CANCELLED", 499),
             "Internal": ("INTERNAL", 500), "Unavailable": ("UNAVAILABLE", 503),
             "DeadlineExceeded": ("DEADLINE_EXCEEDED", 504)}
    for name, (code, status) in codes.items():
        cls = getattr(xrec, name)
        assert issubclass(cls, xrec.XrecError)
        assert (cls.code, cls.http_status) == (code, status), name
        assert errors.ERRORS_BY_CODE[code] is cls
        error = cls("what went wrong", request_id="r1")
        assert error.code == code and error.message == "what went wrong" and error.request_id == "r1"
    assert xrec.Engine is Engine
    fields = set(RecRequest.__dataclass_fields__)
    assert {"token_ids", "sparse_embedding", "decoder_context_embedding", "beam_width", "top_k",
            "num_return_sequences", "normalize", "return_items", "timeout_ms", "request_id"} <= fields
    assert {"request_id", "results", "usage", "timing"} <= set(RecResponse.__dataclass_fields__)
    assert {"tokens", "score", "token_logprobs", "items"} <= set(RecCandidate.__dataclass_fields__)
    assert {"item_id", "did", "type"} <= set(RecItem.__dataclass_fields__)


def test_engine_is_a_context_manager(model_dir):
    with Engine.from_pretrained(model_dir, isolation="thread",
                                device="cpu", dtype="float32", default_beam_width=2) as engine:
        response = wait(engine.submit(good_request()))
        assert len(response.results) == 2
    with pytest.raises(xrec.Unavailable):
        engine.submit(good_request())
    engine.close()   # a second close is harmless


def test_recommend_async(engine):
    async def main():
        one = await asyncio.wait_for(engine.recommend_async(good_request(beam_width=3)), TIMEOUT_S)
        many = await asyncio.wait_for(asyncio.gather(*(engine.recommend_async(good_request(beam_width=w))
                                                       for w in (1, 2, 4))), TIMEOUT_S)
        with pytest.raises(InvalidArgument, match="beam_width"):
            await engine.recommend_async(good_request(beam_width=0))
        return one, many

    one, many = asyncio.run(main())
    assert len(one.results) == 3
    assert [len(r.results) for r in many] == [1, 2, 4]
    sync, = recommend(engine, [good_request(beam_width=3)])
    assert [c.tokens for c in sync.results] == [c.tokens for c in one.results]


@pytest.mark.parametrize("options,word", [
    (dict(bogus_option=1), "bogus_option"),
    (dict(max_beam_width=0), "max_beam_width"),
    (dict(normalize="softmax"), "normalize"),
    (dict(device="tpu"), "device"),
    (dict(max_top_k=4, max_beam_width=8), "max_top_k"),
    # "false" is a truthy string: it built a constrained engine
    (dict(constrained="false"), "constrained"),
    (dict(adaptive_threads="false"), "adaptive_threads"),
    (dict(constrained=[]), "constrained"),
    (dict(request_timeout_ms=10 ** 400), "request_timeout_ms"),   # then every submit failed
    (dict(request_timeout_ms=True), "request_timeout_ms"),        # a 1 ms deadline each
    (dict(device=None), "device"),                                # an AttributeError before
    (dict(device="cuda:x"), "device"),                            # torch's RuntimeError before
])
def test_bad_engine_option(model_dir, options, word):
    with pytest.raises(ValueError, match=word):
        Engine.from_pretrained(model_dir, isolation="thread", **options)


def test_engine_option_normalize_default(model_dir):
    """The engine's `normalize` is the default; a request may override it."""
    with Engine.from_pretrained(model_dir, isolation="thread",
                                device="cpu", dtype="float32", normalize="full",
                                default_beam_width=4) as engine:
        full, allowed, explicit = recommend(engine, [good_request(), good_request(normalize="allowed"),
                                                     good_request(normalize="full")])
    assert [c.tokens for c in full.results] == [c.tokens for c in explicit.results]
    assert [c.score for c in full.results] == pytest.approx([c.score for c in explicit.results], abs=1e-4)
    # "allowed" renormalises over the catalog's children: its scores are higher than "full"'s
    assert allowed.results[0].score > full.results[0].score


def test_a_queued_embedding_is_the_callers_array_as_it_was_at_submit(engine):
    """The in-thread engine queued the caller's float32 array itself: a caller that reused
    its buffer after submit got the next user's answer (and a NaN written after submit got
    past the validation)."""
    buffer = emb(3)
    alone = recommend(engine, [RecRequest(sparse_embedding=buffer.copy(), beam_width=4)])[0]
    engine.hold_wakeups()   # the request waits in the queue while the buffer is refilled
    try:
        future = engine.submit(RecRequest(sparse_embedding=buffer, beam_width=4))
        buffer[:] = emb(5)[:3]
        buffer[0, 0] = math.nan
    finally:
        engine.release_wakeups()
    answer = wait(future)
    assert [c.tokens for c in answer.results] == [c.tokens for c in alone.results]


def test_np_false_exclude_history_is_false(engine):
    """np.False_ was refused as if the filter were on ("needs a decoder-only model")."""
    response, = recommend(engine, [good_request(beam_width=2, exclude_history=np.False_)])
    assert len(response.results) == 2


@pytest.mark.parametrize("grace_s", [math.inf, 1e12])
def test_close_with_an_unbounded_grace_drains_and_ends_the_threads(model_dir, grace_s):
    """inf (or anything over threading.TIMEOUT_MAX) overflowed the drain's waits: close
    raised OverflowError, the threads ran on and a later close did nothing."""
    import threading

    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu", dtype="float32",
                                    default_beam_width=2)
    before = set(threading.enumerate())
    engine.hold_wakeups()
    futures = [engine.submit(good_request()) for _ in range(6)]
    engine.release_wakeups()
    engine.close(grace_s)
    assert all(len(wait(f).results) == 2 for f in futures)
    assert [t.name for t in threading.enumerate() if t not in before] == []


@pytest.mark.parametrize("grace_s", [None, math.nan, -1, "30", 10 ** 400],
                         ids=["none", "nan", "negative", "text", "huge-int"])
def test_close_with_a_bad_grace_is_refused_and_the_engine_still_closes(model_dir, grace_s):
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu", dtype="float32",
                                    default_beam_width=2)
    with pytest.raises(InvalidArgument, match="grace_s"):
        engine.close(grace_s)
    assert_still_serving(engine)
    engine.close()
    with pytest.raises(xrec.Unavailable):
        engine.submit(good_request())
