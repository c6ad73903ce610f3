"""HTTP tests of the decoder-only family against real uvicorn servers on 127.0.0.1.

`prompt` / `messages` on the native route, `prompt` on `/v1/completions`, and
`POST /v1/chat/completions` (xrec.server.chat). Three engines, one server each
(module scope):

- `sid`: a tiny random Qwen3 model with OpenOneRec's vocabulary layout, a chat
  template and a catalog, served with generation_prefix "<|sid_begin|>" and a
  small max_input_len;
- `no_template`: a copy of it whose tokenizer_config.json has no chat template;
- `no_tokenizer`: the encoder-decoder "tiny" model, which has no tokenizer.json.

Expected prompt lengths are computed without xrec: `tokenizers` for text,
`transformers.apply_chat_template` for chats. One `xrec serve` subprocess
checks the CLI path (start-up log, --generation-prefix, SIGTERM). No
wall-time assertions; every wait is bounded.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
tokenizers = pytest.importorskip("tokenizers")

from test_server import (ServerThread, assert_error, metric, post_in_thread,  # noqa: E402
                         start_serve, wait_until)

from xrec import Engine  # noqa: E402
from xrec.api_types import RecRequest  # noqa: E402
from xrec.demo import write_random_model  # noqa: E402
from xrec.errors import InvalidArgument  # noqa: E402
from xrec.server.app import create_app  # noqa: E402
from xrec.api_types import check_prompt_bound  # noqa: E402
from xrec.tokenizer import PromptTokenizer  # noqa: E402

ROUNDS, HIDDEN, VOCAB = 3, 32, 768        # the "qwen3-sid-test" size
NUM_ITEMS, MAX_INPUT_LEN = 2000, 64
SID_BEGIN = "<|sid_begin|>"
WAIT_S = 30.0
NATIVE, XLLM, CHAT = "/v1/rec/completions", "/v1/completions", "/v1/chat/completions"
PROMPT = "user watched <s_a_3><s_b_7><s_c_12> twice; recommend the next video"
MESSAGES = [{"role": "system", "content": "You recommend videos."},
            {"role": "user", "content": "I liked <s_a_1><s_b_2><s_c_3>. What next?"}]
SID_TEXT = re.compile(r"(<s_a_\d+>)(<s_b_\d+>)(<s_c_\d+>)")


@dataclass
class Served:
    """One engine behind a uvicorn server, and a client of it."""

    engine: Engine
    server: ServerThread
    client: httpx.Client

    @property
    def url(self) -> str:
        return self.server.url

    def post(self, path: str, body: dict) -> dict:
        """The JSON answer of a request that must succeed."""
        response = self.client.post(path, json=body)
        assert response.status_code == 200, (path, body, response.text[:500])
        return response.json()


def _serve(model_dir: Path, serve=lambda engine: ServerThread(create_app(engine)), **options):
    """`Served` for the model in `model_dir` with engine `options`; `serve` puts the engine
    behind a server (default: plain uvicorn)."""
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu", **options)
    server = serve(engine)
    client = httpx.Client(base_url=server.url, timeout=WAIT_S)
    try:
        yield Served(engine, server, client)
    finally:
        client.close()
        server.stop()
        engine.close(5)


# ---- fixtures --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sid_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("sid") / "sid", "qwen3-sid-test", 0,
                              NUM_ITEMS)


@pytest.fixture(scope="module")
def sid(sid_dir):
    yield from _serve(sid_dir, generation_prefix=SID_BEGIN, max_input_len=MAX_INPUT_LEN)


@pytest.fixture(scope="module")
def no_template(sid_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "sid-plain"
    shutil.copytree(sid_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    yield from _serve(out, generation_prefix=SID_BEGIN)


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    yield from _serve(write_random_model(tmp_path_factory.mktemp("tiny") / "tiny", "tiny", 0,
                                         500))


@pytest.fixture(scope="module")
def reference(sid_dir):
    """The model's tokenizer.json read by `tokenizers` itself, and the generation prefix's ids."""
    tokenizer = tokenizers.Tokenizer.from_file(str(sid_dir / "tokenizer.json"))
    prefix_ids = tokenizer.encode(SID_BEGIN, add_special_tokens=False).ids
    assert prefix_ids == [tokenizer.token_to_id(SID_BEGIN)]
    return tokenizer, prefix_ids


@pytest.fixture(scope="module")
def prompt_len(reference):
    """prompt text -> its length with the generation prefix."""
    tokenizer, prefix_ids = reference
    return lambda text: len(tokenizer.encode(text).ids) + len(prefix_ids)


@pytest.fixture(scope="module")
def chat_len(sid_dir, reference):
    """messages -> prompt length with the generation prefix, by transformers' template."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(sid_dir))
    _, prefix_ids = reference

    def length(messages) -> int:
        ids = hf.apply_chat_template(messages, add_generation_prompt=True,
                                     enable_thinking=False, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids   # transformers 5: a dict
        return len(ids) + len(prefix_ids)
    return length


@pytest.fixture(scope="module")
def token_to_id(sid_dir):
    return PromptTokenizer.from_model_dir(sid_dir).token_to_id


# ---- helpers ---------------------------------------------------------------------------

def post(served: Served, path: str, body: dict) -> dict:
    response = served.client.post(path, json=body)
    assert response.status_code == 200, (path, body, response.text)
    return response.json()


def check_sid(text: str, tokens: list[int], token_to_id) -> None:
    """`text` is the three itemic tokens of `tokens`, one per level, concatenated."""
    match = SID_TEXT.fullmatch(text)
    assert match, text
    assert [token_to_id(token) for token in match.groups()] == tokens


def check_results(results: list[dict], num: int, token_to_id) -> None:
    assert len(results) == num
    scores = [r["score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    for r in results:
        assert set(r) == {"tokens", "score", "token_logprobs", "items", "text"}
        assert len(r["tokens"]) == ROUNDS == len(r["token_logprobs"])
        check_sid(r["text"], r["tokens"], token_to_id)
        assert math.isclose(sum(r["token_logprobs"]), r["score"], rel_tol=1e-4, abs_tol=1e-4)
        assert r["items"] and set(r["items"][0]) == {"item_id", "did", "type"}
    assert len({tuple(r["tokens"]) for r in results}) == num


def same_results(a: list[dict], b: list[dict]) -> None:
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert [r["text"] for r in a] == [r["text"] for r in b]
    assert [r["items"] for r in a] == [r["items"] for r in b]
    for x, y in zip(a, b):
        assert math.isclose(x["score"], y["score"], rel_tol=1e-5, abs_tol=1e-5)


def as_results(choices: list[dict]) -> list[dict]:
    """Chat choices in the native result shape (for comparisons)."""
    return [{"tokens": c["token_ids"], "text": c["message"]["content"], "items": c["items"],
             "score": c["score"]} for c in choices]


# ---- the native route ----------------------------------------------------------------------

def test_native_prompt_equals_its_token_ids(sid, reference, prompt_len, token_to_id):
    tokenizer, prefix_ids = reference
    ids = tokenizer.encode(PROMPT).ids
    by_prompt = post(sid, NATIVE, {"prompt": PROMPT, "beam_width": 8, "model": "sid",
                                   "request_id": "p-1"})
    assert by_prompt["id"] == "p-1" and by_prompt["model"] == "sid"
    check_results(by_prompt["results"], 8, token_to_id)
    assert by_prompt["usage"] == {"input_tokens": prompt_len(PROMPT), "beams": 8}
    by_ids = post(sid, NATIVE, {"token_ids": ids, "beam_width": 8})
    assert by_ids["usage"] == by_prompt["usage"]
    same_results(by_ids["results"], by_prompt["results"])
    # the prefix is appended to token_ids too: sending it explicitly is another prompt
    with_prefix = post(sid, NATIVE, {"token_ids": ids + prefix_ids, "beam_width": 8})
    assert with_prefix["usage"]["input_tokens"] == prompt_len(PROMPT) + len(prefix_ids)


def test_native_messages(sid, chat_len, token_to_id):
    out = post(sid, NATIVE, {"messages": MESSAGES, "beam_width": 8, "num_return_sequences": 4})
    check_results(out["results"], 4, token_to_id)
    assert out["usage"] == {"input_tokens": chat_len(MESSAGES), "beams": 8}
    # OpenAI's content parts are the same text
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    same_results(post(sid, NATIVE, {"messages": parts, "beam_width": 8,
                                    "num_return_sequences": 4})["results"], out["results"])


def test_prompt_length_counts_the_generation_prefix(sid, reference, prompt_len):
    tokenizer, _ = reference
    fits = "7" * (MAX_INPUT_LEN - 1)   # one token a digit (Qwen2's split pattern)
    assert prompt_len(fits) == MAX_INPUT_LEN
    out = post(sid, NATIVE, {"prompt": fits, "beam_width": 2})
    assert out["usage"]["input_tokens"] == MAX_INPUT_LEN
    error = assert_error(sid.client.post(NATIVE, json={"prompt": fits + "7", "beam_width": 2}),
                         400)
    assert error["message"].startswith("prompt:") and "generation prefix" in error["message"]
    assert f"max_input_len={MAX_INPUT_LEN}" in error["message"]
    ids = tokenizer.encode(fits).ids
    assert post(sid, NATIVE, {"token_ids": ids, "beam_width": 2})["usage"]["input_tokens"] == \
        MAX_INPUT_LEN
    assert_error(sid.client.post(NATIVE, json={"token_ids": ids + ids[:1]}), 400)


# ---- prompts that cannot fit: refused before the BPE work -------------------------------------

LONG_TEXTS = [PROMPT, "7" * 500, "e\u0301" * 300 + "\u1100\u1161\u11a8" * 100,  # NFC shortens these
              "<|im_start|>" * 50, "<s_a_1><s_b_2>" * 100, " " * 999, "\n\n" * 300,
              "<xrec_unused_500>" * 40, "推荐视频 🙂 Café naïve " * 40]


def test_min_num_tokens_is_a_lower_bound(sid_dir, reference):
    tokenizer, _ = reference
    ours = PromptTokenizer.from_model_dir(sid_dir)
    assert ours.max_token_chars == max(map(len, tokenizer.get_vocab(with_added_tokens=True)))
    for text in LONG_TEXTS:
        num_tokens = len(tokenizer.encode(text).ids)
        assert 0 < ours.min_num_tokens(text) <= num_tokens, text[:40]
        assert ours.min_num_tokens(text) == -(-len(tokenizer.normalizer.normalize_str(text))
                                              // ours.max_token_chars)


def test_no_bound_where_a_token_may_cover_more_than_its_string(reference):
    """Pipelines that drop characters or fuse them into one token have no bound (None)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    base, _ = reference

    def variant(change) -> PromptTokenizer:
        tokenizer = Tokenizer.from_str(base.to_str())
        change(tokenizer)
        return PromptTokenizer(tokenizer)
    assert variant(lambda t: None).max_token_chars is not None
    dropping = variant(lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Whitespace()))
    assert len(dropping.encode(" " * 999)) == 0      # why: 999 characters, no token
    assert dropping.max_token_chars is None and dropping.min_num_tokens(" " * 999) == 0
    removed = pre_tokenizers.Split(" ", behavior="removed")
    assert variant(lambda t: setattr(t, "pre_tokenizer", removed)).max_token_chars is None
    # truncation is turned off at load, as Hugging Face's tokenizer call does: the bound holds
    assert variant(lambda t: t.enable_truncation(8)).max_token_chars is not None
    assert variant(lambda t: t.add_special_tokens([AddedToken("<m>", lstrip=True)])) \
        .max_token_chars is None
    fused = Tokenizer(models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True))
    assert PromptTokenizer(fused).max_token_chars is None
    assert PromptTokenizer(Tokenizer(models.WordPiece({"a": 0, "[UNK]": 1}))).max_token_chars \
        is None


def test_a_prompt_that_cannot_fit_is_refused_without_encoding(sid, monkeypatch):
    """The bound is the engine's validation: the Python API tokenized a 2 MB prompt in full
    (2 s, on the caller's event loop in `recommend_async`) before refusing it."""
    limits, tokenizer = sid.engine.limits, sid.engine.tokenizer
    encoded = []
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: encoded.append(a))
    longest = (MAX_INPUT_LEN - 1) * tokenizer.max_token_chars   # no more fits (1: the prefix)
    too_long = "7" * (longest + 1)
    with pytest.raises(InvalidArgument, match=rf"prompt: at least {MAX_INPUT_LEN + 1} positions "
                                              rf"\(with the generation prefix\), more than "
                                              rf"max_input_len={MAX_INPUT_LEN}"):
        sid.engine.validate(RecRequest(prompt=too_long))
    with pytest.raises(InvalidArgument, match=r"messages: at least \d+ positions"):
        sid.engine.validate(RecRequest(messages=[{"role": "user", "content": too_long}]))
    parts = [{"role": "user", "content": [{"type": "text", "text": too_long}]}]
    with pytest.raises(InvalidArgument, match="messages: at least"):
        sid.engine.validate(RecRequest(messages=parts))
    # many empty messages: no content, but the template's text around each (before, only
    # the contents were counted, and 30,000 such messages were tokenized on the event loop)
    empty = [{"role": "user", "content": ""}] * longest
    with pytest.raises(InvalidArgument, match="messages: at least"):
        sid.engine.validate(RecRequest(messages=empty))
    assert encoded == []
    error = assert_error(sid.client.post(XLLM, json={"prompt": too_long}), 400)
    assert error["message"].startswith("prompt: at least") and encoded == []
    # what may fit is left to the engine's exact count
    for text in ("7" * longest, PROMPT, tokenizer.render_chat(MESSAGES)):
        check_prompt_bound("prompt", text, limits, tokenizer)


# ---- /v1/completions -------------------------------------------------------------------------

def test_xllm_completions_prompt(sid, prompt_len, token_to_id):
    native = post(sid, NATIVE, {"prompt": PROMPT, "beam_width": 8})["results"]
    out = post(sid, XLLM, {"model": "sid", "prompt": PROMPT, "beam_width": 8, "max_tokens": 3,
                           "logprobs": True, "temperature": 0.0})
    assert out["object"] == "text_completion" and out["model"] == "sid"
    choices = out["choices"]
    assert [c["index"] for c in choices] == list(range(8))
    for choice, result in zip(choices, native):
        check_sid(choice["text"], choice["logprobs"]["token_ids"], token_to_id)
        assert choice["text"] == result["text"] and choice["finish_reason"] == "stop"
        assert choice["logprobs"]["token_ids"] == result["tokens"]
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]   # the token strings
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(result["token_logprobs"],
                                                                     rel=1e-5, abs=1e-5)
    assert len(choices) == len(native)
    prompt_tokens = prompt_len(PROMPT)
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 8 * ROUNDS,
                            "total_tokens": prompt_tokens + 8 * ROUNDS}
    rec = out["output_tensors"][0]
    assert rec["name"] == "rec_result" and rec["datatype"] == "INT64"
    assert rec["contents"]["int64_contents"] == [r["items"][0]["item_id"] for r in native]


# ---- /v1/chat/completions ------------------------------------------------------------------

def test_chat_completions_shape_and_native_equivalence(sid, chat_len, token_to_id):
    out = post(sid, CHAT, {"model": "sid", "messages": MESSAGES, "beam_width": 16, "n": 5,
                           "request_id": "chat-1"})
    assert out["id"] == "chat-1" and out["object"] == "chat.completion"
    assert out["model"] == "sid" and isinstance(out["created"], int)
    choices = out["choices"]
    assert [c["index"] for c in choices] == list(range(5))
    for c in choices:
        assert set(c) == {"index", "message", "finish_reason", "logprobs", "token_ids", "score",
                          "items"}
        assert c["message"] == {"role": "assistant", "content": c["message"]["content"]}
        check_sid(c["message"]["content"], c["token_ids"], token_to_id)
        assert c["finish_reason"] == "stop" and c["logprobs"] is None
        assert c["items"] and set(c["items"][0]) == {"item_id", "did", "type"}
    scores = [c["score"] for c in choices]
    assert scores == sorted(scores, reverse=True)
    prompt_tokens = chat_len(MESSAGES)
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 5 * ROUNDS,
                            "total_tokens": prompt_tokens + 5 * ROUNDS}
    native = post(sid, NATIVE, {"messages": MESSAGES, "beam_width": 16,
                                "num_return_sequences": 5})
    assert native["usage"]["input_tokens"] == prompt_tokens
    same_results(as_results(choices), native["results"])


def test_chat_n_and_num_return_sequences(sid):
    body = {"messages": MESSAGES, "beam_width": 16}
    by_n = as_results(post(sid, CHAT, {**body, "n": 5})["choices"])
    assert len(by_n) == 5
    same_results(as_results(post(sid, CHAT, {**body, "num_return_sequences": 5})["choices"]),
                 by_n)
    same_results(as_results(post(sid, CHAT, {**body, "n": 5,
                                             "num_return_sequences": 5})["choices"]), by_n)
    everything = as_results(post(sid, CHAT, body)["choices"])   # N defaults to W
    assert len(everything) == 16
    same_results(everything[:5], by_n)


def test_chat_logprobs(sid, token_to_id):
    body = {"messages": MESSAGES, "beam_width": 8, "n": 3}
    out = post(sid, CHAT, {**body, "logprobs": True, "top_logprobs": 20})
    native = post(sid, NATIVE, {"messages": MESSAGES, "beam_width": 8,
                                "num_return_sequences": 3})["results"]
    for choice, result in zip(out["choices"], native, strict=True):
        content = choice["logprobs"]["content"]
        assert len(content) == ROUNDS
        assert "".join(entry["token"] for entry in content) == choice["message"]["content"]
        assert [token_to_id(entry["token"]) for entry in content] == choice["token_ids"]
        for entry in content:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert entry["bytes"] == list(entry["token"].encode()) and entry["top_logprobs"] == []
        logprobs = [entry["logprob"] for entry in content]
        assert math.isclose(sum(logprobs), choice["score"], rel_tol=1e-4, abs_tol=1e-4)
        assert logprobs == pytest.approx(result["token_logprobs"], rel=1e-5, abs=1e-5)
    unasked = post(sid, CHAT, {**body, "logprobs": False})
    assert all(c["logprobs"] is None for c in unasked["choices"])


def test_chat_accepts_and_ignores_openai_knobs(sid):
    body = {"messages": MESSAGES, "beam_width": 8, "n": 4}
    plain = as_results(post(sid, CHAT, body)["choices"])
    knobs = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 1, "max_completion_tokens": 1,
             "stop": ["\n", "<|im_end|>"], "user": "user-7", "seed": 7, "stream": False,
             "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"5": 1},
             "response_format": {"type": "text"}, "stream_options": None,
             "metadata": {"k": "v"}}
    same_results(as_results(post(sid, CHAT, {**body, **knobs})["choices"]), plain)


def test_top_k_minus_one_is_the_default_on_both_openai_routes(sid):
    """vLLM's and xllm's `top_k: -1` (and 0: no cutoff) is the default (W) on chat as on
    `/v1/completions`; the native route keeps refusing a top_k below W."""
    chat = {"messages": MESSAGES, "beam_width": 8, "n": 4}
    completion = {"prompt": PROMPT, "beam_width": 8, "n": 4}
    plain_chat = as_results(post(sid, CHAT, chat)["choices"])
    plain_completion = post(sid, XLLM, completion)["choices"]
    for top_k in (-1, 0):
        same_results(as_results(post(sid, CHAT, {**chat, "top_k": top_k})["choices"]),
                     plain_chat)
        assert ([c["text"] for c in post(sid, XLLM, {**completion, "top_k": top_k})["choices"]]
                == [c["text"] for c in plain_completion])
    error = assert_error(sid.client.post(NATIVE, json={"prompt": PROMPT, "beam_width": 8,
                                                       "top_k": -1}), 400)
    assert error["message"].startswith("top_k: got -1")


def test_a_burst_of_ragged_prompts_gets_each_its_own_answer(sid):
    """Prompts of different lengths on three routes at once (they may share a batch): each
    answer is the one the same request gets alone."""
    chats = [[{"role": "user", "content": "hi"}], MESSAGES,
             [{"role": "user", "content": "<s_a_1><s_b_2><s_c_3>"},
              {"role": "assistant", "content": "<s_a_4><s_b_5><s_c_6>"},
              {"role": "user", "content": "more"}]]
    requests = [(CHAT, {"messages": m, "beam_width": 4, "request_id": f"chat-{i}"})
                for i, m in enumerate(chats)]
    requests += [(NATIVE, {"prompt": PROMPT, "beam_width": 4, "request_id": "native-p"}),
                 (NATIVE, {"prompt": "7", "beam_width": 4, "request_id": "native-7"}),
                 (XLLM, {"prompt": "recommend", "beam_width": 4, "request_id": "xllm-p"})]

    def tokens(out: dict) -> list:
        if "results" in out:
            return [r["tokens"] for r in out["results"]]
        return [c.get("token_ids") or c["logprobs"]["token_ids"] for c in out["choices"]]
    alone = {body["request_id"]: tokens(post(sid, path, body)) for path, body in requests}
    answers: list = []
    threads = [post_in_thread(sid.url + path, body, answers) for path, body in requests]
    for thread in threads:
        thread.join(WAIT_S * 2)
    assert all(getattr(a, "status_code", None) == 200 for a in answers), answers
    together = {a.json()["id"]: tokens(a.json()) for a in answers}
    assert together == alone


def test_models_name_the_served_directory(sid):
    assert [m["id"] for m in sid.client.get("/v1/models").json()["data"]] == ["sid"]


# ---- errors ------------------------------------------------------------------------------

EMB = [0.0] * HIDDEN
MALFORMED = [
    # (id, server, path, body, status, code, what the message holds: a text or a tuple of them)
    ("chat-messages-string", "sid", CHAT, {"messages": "hi"}, 422, "INVALID_ARGUMENT",
     "messages"),
    ("chat-message-string", "sid", CHAT, {"messages": ["hi"]}, 422, "INVALID_ARGUMENT",
     "messages"),
    ("chat-messages-empty", "sid", CHAT, {"messages": []}, 400, "INVALID_ARGUMENT", "messages"),
    ("chat-no-role", "sid", CHAT, {"messages": [{"content": "hi"}]}, 400, "INVALID_ARGUMENT",
     "messages"),
    ("chat-role-number", "sid", CHAT, {"messages": [{"role": 1, "content": "hi"}]}, 400,
     "INVALID_ARGUMENT", "messages"),
    ("chat-content-number", "sid", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
     "INVALID_ARGUMENT", "content"),
    ("chat-content-missing", "sid", CHAT, {"messages": [{"role": "user"}]}, 400,
     "INVALID_ARGUMENT", "content"),
    ("chat-content-image", "sid", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "INVALID_ARGUMENT",
     "content"),
    ("chat-unknown-role", "sid", CHAT, {"messages": [{"role": "tool", "content": "hi"}]}, 400,
     "INVALID_ARGUMENT", ("messages", "unsupported role")),
    ("chat-n-disagrees", "sid", CHAT, {"messages": MESSAGES, "beam_width": 8, "n": 2,
                                       "num_return_sequences": 3}, 400, "INVALID_ARGUMENT",
     "num_return_sequences"),
    ("chat-top-logprobs-21", "sid", CHAT, {"messages": MESSAGES, "logprobs": True,
                                           "top_logprobs": 21}, 400, "INVALID_ARGUMENT",
     "top_logprobs"),
    ("chat-top-logprobs-negative", "sid", CHAT, {"messages": MESSAGES, "top_logprobs": -1},
     400, "INVALID_ARGUMENT", "top_logprobs"),
    ("chat-top-logprobs-without-logprobs", "sid", CHAT, {"messages": MESSAGES, "top_logprobs": 2},
     400, "INVALID_ARGUMENT", "top_logprobs"),
    ("chat-n-zero", "sid", CHAT, {"messages": MESSAGES, "n": 0}, 400, "INVALID_ARGUMENT", "n:"),
    ("chat-stream-options-type", "sid", CHAT, {"messages": MESSAGES, "stream": True,
                                               "stream_options": {"include_usage": "yes"}},
     422, "INVALID_ARGUMENT", "stream_options.include_usage"),
    ("chat-max-tokens-negative", "sid", CHAT, {"messages": MESSAGES, "max_tokens": -1}, 400,
     "INVALID_ARGUMENT", "max_tokens"),
    ("chat-unknown-field", "sid", CHAT, {"messages": MESSAGES, "beam_widht": 8}, 422,
     "INVALID_ARGUMENT", "beam_widht"),
    ("chat-prompt-field", "sid", CHAT, {"messages": MESSAGES, "prompt": "hi"}, 422,
     "INVALID_ARGUMENT", "prompt"),
    ("chat-token-ids-field", "sid", CHAT, {"token_ids": [1, 2]}, 422, "INVALID_ARGUMENT",
     "token_ids"),
    ("chat-messages-missing", "sid", CHAT, {"beam_width": 8}, 422, "INVALID_ARGUMENT",
     "messages"),
    ("chat-beam-zero", "sid", CHAT, {"messages": MESSAGES, "beam_width": 0}, 400,
     "INVALID_ARGUMENT", "beam_width"),
    ("chat-logprobs-string", "sid", CHAT, {"messages": MESSAGES, "logprobs": "yes"}, 422,
     "INVALID_ARGUMENT", "logprobs"),
    ("chat-unknown-model", "sid", CHAT, {"messages": MESSAGES, "model": "other"}, 404,
     "NOT_FOUND", "model"),
    ("chat-too-long", "sid", CHAT, {"messages": [{"role": "user", "content": "7" * 100}]}, 400,
     "INVALID_ARGUMENT", ("messages:", "max_input_len")),
    ("native-messages-string", "sid", NATIVE, {"messages": "hi"}, 422, "INVALID_ARGUMENT",
     "messages"),
    ("native-no-role", "sid", NATIVE, {"messages": [{"content": "hi"}]}, 400,
     "INVALID_ARGUMENT", "messages"),
    ("native-unknown-role", "sid", NATIVE, {"messages": [{"role": "robot", "content": "hi"}]},
     400, "INVALID_ARGUMENT", ("messages", "unsupported role")),
    ("native-prompt-number", "sid", NATIVE, {"prompt": 5}, 422, "INVALID_ARGUMENT", "prompt"),
    ("native-prompt-empty", "sid", NATIVE, {"prompt": ""}, 400, "INVALID_ARGUMENT", "prompt"),
    ("native-prompt-too-long", "sid", NATIVE, {"prompt": "7" * 100}, 400, "INVALID_ARGUMENT",
     ("prompt:", "max_input_len")),
    ("native-prompt-and-ids", "sid", NATIVE, {"prompt": "hi", "token_ids": [1]}, 400,
     "INVALID_ARGUMENT", "prompt"),
    ("native-prompt-and-messages", "sid", NATIVE, {"prompt": "hi", "messages": MESSAGES}, 400,
     "INVALID_ARGUMENT", "messages"),
    ("native-id-out-of-vocab", "sid", NATIVE, {"token_ids": [1, VOCAB]}, 400,
     "INVALID_ARGUMENT", str(VOCAB)),
    ("native-sparse-embedding", "sid", NATIVE, {"sparse_embedding": {"shape": [1, HIDDEN],
                                                "data": EMB}}, 400, "INVALID_ARGUMENT",
     "sparse_embedding"),
    ("native-context-embedding", "sid", NATIVE, {"token_ids": [1], "decoder_context_embedding":
                                                 {"shape": [1, HIDDEN], "data": EMB}}, 400,
     "INVALID_ARGUMENT", "decoder_context_embedding"),
    ("xllm-sparse-embedding", "sid", XLLM, {"input_tensors": [
        {"name": "sparse_embedding", "data_type": "FLOAT", "shape": [1, HIDDEN],
         "contents": {"fp32_contents": EMB}}]}, 400, "INVALID_ARGUMENT", "sparse_embedding"),
    ("xllm-prompt-too-long", "sid", XLLM, {"prompt": "7" * 100}, 400, "INVALID_ARGUMENT",
     ("prompt:", "max_input_len")),
    ("no-template-chat", "no_template", CHAT, {"messages": MESSAGES}, 400, "INVALID_ARGUMENT",
     ("messages:", "no chat template")),
    ("no-template-native", "no_template", NATIVE, {"messages": MESSAGES}, 400,
     "INVALID_ARGUMENT", ("messages:", "no chat template")),
    ("no-tokenizer-prompt", "no_tokenizer", NATIVE, {"prompt": "hi"}, 400, "INVALID_ARGUMENT",
     ("prompt:", "tokenizer.json")),
    ("no-tokenizer-messages", "no_tokenizer", NATIVE, {"messages": MESSAGES}, 400,
     "INVALID_ARGUMENT", ("messages:", "tokenizer.json")),
    ("no-tokenizer-chat", "no_tokenizer", CHAT, {"messages": MESSAGES}, 400,
     "INVALID_ARGUMENT", ("messages:", "tokenizer.json")),
    ("no-tokenizer-xllm-prompt", "no_tokenizer", XLLM, {"prompt": "hi"}, 400,
     "INVALID_ARGUMENT", ("prompt:", "tokenizer.json")),
]
# what each server answers 200 (the chat route where the server has one)
VALID = {"sid": (CHAT, {"messages": MESSAGES, "beam_width": 4}),
         "no_template": (NATIVE, {"prompt": PROMPT, "beam_width": 4}),
         "no_tokenizer": (NATIVE, {"token_ids": [1, 2, 3], "beam_width": 4})}


@pytest.mark.parametrize("server, path, body, status, code, says",
                         [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_malformed_request(request, server, path, body, status, code, says):
    served: Served = request.getfixturevalue(server)
    error = assert_error(served.client.post(path, json={**body, "request_id": "bad-1"}),
                         status, code)
    for text in (says,) if isinstance(says, str) else says:
        assert text in error["message"], error
    if status != 422:   # a body that does not parse has no request_id: a fresh one answers
        assert error["request_id"] == "bad-1"
    valid_path, valid_body = VALID[server]
    assert served.client.post(valid_path, json=valid_body).status_code == 200


@pytest.mark.parametrize("path, body", [
    (NATIVE, {"prompt": "hello \ud800 world"}), (XLLM, {"prompt": "hello \udfff"}),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800 hello"}]})])
def test_a_lone_surrogate_is_refused_as_the_python_api_refuses_it(sid, path, body):
    """JSON may escape a lone UTF-16 surrogate, and `json.dumps` does for a str holding one;
    pydantic's parser refused such a body as "malformed JSON body: ... unexpected end of hex
    escape" (the escape is whole) where the Python API names the field and the character."""
    response = sid.client.post(path, content=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
    error = assert_error(response, 400)
    with pytest.raises(InvalidArgument) as refused:
        sid.engine.validate(RecRequest(**body))
    assert error["message"] == refused.value.message and "lone surrogate" in error["message"]


def test_no_template_still_serves_prompts(no_template, prompt_len, token_to_id):
    out = post(no_template, NATIVE, {"prompt": PROMPT, "beam_width": 4})
    check_results(out["results"], 4, token_to_id)
    assert out["usage"]["input_tokens"] == prompt_len(PROMPT)


# ---- metrics -------------------------------------------------------------------------------

def test_metrics_count_the_chat_route_under_its_own_label(sid):
    def counts() -> tuple[float, ...]:
        return (metric(sid.url, "xrec_requests_total", api="chat", code="OK"),
                metric(sid.url, "xrec_requests_total", api="chat", code="INVALID_ARGUMENT"),
                metric(sid.url, "xrec_requests_total", api="chat", code="NOT_FOUND"),
                metric(sid.url, "xrec_request_latency_seconds_count", api="chat"),
                metric(sid.url, "xrec_requests_total", api="native", code="OK"),
                metric(sid.url, "xrec_requests_total", api="native", code="INVALID_ARGUMENT"))
    before = counts()
    body = {"messages": MESSAGES, "beam_width": 4}
    post(sid, CHAT, body)
    post(sid, CHAT, {**body, "n": 2})
    assert_error(sid.client.post(CHAT, json={**body, "n": 0}), 400)
    assert_error(sid.client.post(CHAT, json={"beam_width": 4}), 422)
    assert_error(sid.client.post(CHAT, json={**body, "model": "other"}), 404, "NOT_FOUND")
    after = counts()
    assert [b - a for a, b in zip(before, after)] == [2, 2, 1, 5, 0, 0]
    text = sid.client.get("/metrics").text
    assert 'xrec_requests_total{api="chat",code="OK"}' in text


# ---- the real process ----------------------------------------------------------------------

def test_xrec_serve_subprocess(sid_dir, chat_len, token_to_id, tmp_path):
    """`xrec serve` of a decoder-only model: start-up lines logged (no traceback), the
    generation prefix from its flag, chat answered, a clean exit on SIGTERM."""
    env = {key: value for key, value in os.environ.items() if key != "XREC_API_KEY"}
    env["XREC_HOME"] = str(tmp_path / "home")
    log_path = tmp_path / "serve.log"
    proc, url, port = start_serve(["--model", str(sid_dir), "--device", "cpu", "--generation-prefix",
                                   SID_BEGIN, "--grace-s", "5"], env, log_path)
    try:
        response = httpx.post(url + CHAT, json={"messages": MESSAGES, "beam_width": 4},
                              timeout=WAIT_S)
        assert response.status_code == 200, response.text
        out = response.json()
        assert out["usage"]["prompt_tokens"] == chat_len(MESSAGES)
        for choice in out["choices"]:
            check_sid(choice["message"]["content"], choice["token_ids"], token_to_id)
        assert wait_until(lambda: "listening on" in log_path.read_text(), interval=0.05), \
            log_path.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0, log_path.read_text()
        text = log_path.read_text()
        assert "Traceback" not in text, text
        assert f"listening on http://127.0.0.1:{port}" in text and "workspace" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_free_decoding_reaching_ids_without_a_token_is_answered(sid_dir):
    """The model's vocabulary (768 ids) is padded beyond its tokenizer's 588 tokens, as real
    checkpoints are; unconstrained beams reach those ids, whose text raised inside the batch:
    every request of it failed INTERNAL, over HTTP a 500."""
    for served in _serve(sid_dir, generation_prefix=SID_BEGIN, constrained=False):
        tokenizer = served.engine.tokenizer
        assert tokenizer.vocab_size < served.engine.limits.vocab_size
        futures = served.engine.submit_many([RecRequest(token_ids=[5, 6, 7], beam_width=16)
                                             for _ in range(3)])
        answers = [f.result(timeout=WAIT_S) for f in futures]
        results = [r for answer in answers for r in answer.results]
        beyond = [r for r in results if max(r.tokens) >= tokenizer.vocab_size]
        assert beyond, "no result reached an id without a token: the test shows nothing"
        assert all(r.text is None for r in beyond)
        assert all(r.text == tokenizer.tokens_text(r.tokens) for r in results if r not in beyond)
        body = served.post("/v1/rec/completions", {"token_ids": [5, 6, 7], "beam_width": 16})
        assert len(body["results"]) == 16
