"""The official `openai` Python SDK, unchanged, against a real uvicorn server on 127.0.0.1.

The server is what `xrec serve --model models/qwen3-tiny --generation-prefix
'<|sid_begin|>' --api-key KEY` runs: the random `qwen3-sid-tiny` model (OpenOneRec's
vocabulary layout, a chat template, a catalog), named after its directory. The SDK's
sync and async clients list the model, complete and chat with `n`, stream both
routes with `stream_options.include_usage` (the chunks carry the non-streamed
answer's choices), and get the SDK's exceptions for a wrong key and a bad field.
The README section "Use it from the OpenAI SDK" is run as written. Prompts near the
body limit are refused before they are tokenized. No wall-time assertions; every
wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_server import ServerThread, raw_post, wait_until  # noqa: E402

from xrec import Engine  # noqa: E402
from xrec.demo import write_random_model  # noqa: E402
from xrec.server.app import create_app  # noqa: E402

MODEL = "qwen3-tiny"            # the served name: the model directory's (README)
KEY = "sdk-test-key"
SID_BEGIN = "<|sid_begin|>"
WAIT_S = 60.0
W = 16                          # beam_width of every request (the engine's default is 128)
MESSAGES = [{"role": "user", "content": "I watched <s_a_340><s_b_6566><s_c_5603>. What next?"}]
PROMPT = "user liked <s_a_3><s_b_7><s_c_9>"
SID_TEXT = re.compile(r"<s_a_\d+><s_b_\d+><s_c_\d+>")
README = Path(__file__).resolve().parents[1] / "README.md"
README_URL = "http://127.0.0.1:8000"
CHAT, XLLM = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = write_random_model(tmp_path_factory.mktemp("sdk") / MODEL, "qwen3-sid-tiny", 0,
                                   2000)
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu",
                                    generation_prefix=SID_BEGIN)
    yield engine
    engine.close(5)


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, api_key=KEY)
    running = ServerThread(app)
    running.service = app.state.xrec
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                       timeout=WAIT_S) as client:
        yield client


def requests_total(server, api: str, code: str) -> float:
    """`xrec_requests_total{api, code}` of `server`'s /metrics."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=WAIT_S).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "xrec_requests_total" and sample.labels == {"api": api, "code": code}:
                return sample.value
    return 0.0


def choices_of(answer) -> list[dict]:
    """An SDK answer's choices as plain dicts (the xrec fields beside the OpenAI ones)."""
    return [choice.model_dump() for choice in answer.choices]


def chat(client, **fields):
    """A chat of MESSAGES at beam width W; `fields` are the SDK's arguments."""
    fields["extra_body"] = {"beam_width": W, **fields.get("extra_body", {})}
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **fields)


def complete(client, **fields):
    """A completion of PROMPT at beam width W; `fields` are the SDK's arguments."""
    fields["extra_body"] = {"beam_width": W, **fields.get("extra_body", {})}
    return client.completions.create(model=MODEL, prompt=PROMPT, **fields)


# ---- the SDK's calls -----------------------------------------------------------------------

def test_models_list(client):
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completions_n_is_the_number_of_choices(client):
    every = complete(client)                       # no n: every result the search kept (W)
    assert len(every.choices) == W
    three = complete(client, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [c.text for c in every.choices[:3]]
    assert all(SID_TEXT.fullmatch(c.text) and c.finish_reason == "stop" for c in three.choices)
    assert three.usage.completion_tokens == 3 * 3  # N results of R = 3 tokens
    assert len(three.model_extra["output_tensors"][0]["contents"]["int64_contents"]) == 3
    same = complete(client, n=3, extra_body={"num_return_sequences": 3})
    assert [c.text for c in same.choices] == [c.text for c in three.choices]


def test_chat_n(client):
    every = chat(client)
    assert len(every.choices) == W
    three = chat(client, n=3)
    assert [c.message.content for c in three.choices] == \
        [c.message.content for c in every.choices[:3]]
    for choice in choices_of(three):
        assert SID_TEXT.fullmatch(choice["message"]["content"])
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "stop"
        assert len(choice["token_ids"]) == 3 and choice["items"] and "score" in choice


def test_bad_fields_are_bad_request_errors(client):
    with pytest.raises(openai.BadRequestError, match="num_return_sequences"):
        complete(client, n=2, extra_body={"num_return_sequences": 3})
    with pytest.raises(openai.BadRequestError, match="beam_width"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                       extra_body={"beam_width": 0})
    with pytest.raises(openai.BadRequestError, match="n: got 0"):   # also when streamed
        chat(client, n=0, stream=True)
    with pytest.raises(openai.NotFoundError, match="model"):
        client.chat.completions.create(model="other", messages=MESSAGES)


def test_a_wrong_key_is_an_authentication_error(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0,
                       timeout=WAIT_S) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        with pytest.raises(openai.AuthenticationError):
            chat(wrong, n=1)
        with pytest.raises(openai.AuthenticationError):
            chat(wrong, n=1, stream=True)


def test_async_client_concurrent_chats(server, client):
    histories = ["<s_a_1><s_b_2><s_c_3>", "<s_a_4><s_b_5><s_c_6>", "<s_a_7><s_b_8><s_c_9>",
                 "<s_a_10><s_b_11><s_c_12>"]
    bodies = [[{"role": "user", "content": f"I watched {h}. What next?"}] for h in histories]

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                      timeout=WAIT_S) as aclient:
            return await asyncio.gather(*(aclient.chat.completions.create(
                model=MODEL, messages=m, n=2, extra_body={"beam_width": W}) for m in bodies))
    together = asyncio.run(run())
    alone = [client.chat.completions.create(model=MODEL, messages=m, n=2,
                                            extra_body={"beam_width": W}) for m in bodies]
    assert [[c.message.content for c in a.choices] for a in together] == \
        [[c.message.content for c in a.choices] for a in alone]


# ---- streaming -----------------------------------------------------------------------------

def _check_stream(chunks: list, answer, n: int, content) -> None:
    """`chunks`: one per choice with the answer's choice (less finish_reason), then one with
    every finish_reason, then the usage with no choices; all with one id and the model."""
    assert len(chunks) == n + 2
    expected = choices_of(answer)
    for index, (chunk, whole) in enumerate(zip(chunks[:n], expected)):
        (choice,) = chunk.choices
        got = choice.model_dump()
        assert got["index"] == index and got["finish_reason"] is None
        assert content(got) == content(whole)
        for key in set(whole) - {"message", "text", "finish_reason", "index"}:
            assert got[key] == whole[key], key
    assert [(c.index, c.finish_reason) for c in chunks[n].choices] == \
        [(i, "stop") for i in range(n)]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == answer.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert len({(c.id, c.created) for c in chunks}) == 1 and {c.model for c in chunks} == {MODEL}


def test_streamed_chat_is_the_answer_in_chunks(client):
    answer = chat(client, n=3, logprobs=True)
    stream = chat(client, n=3, logprobs=True, stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    _check_stream(chunks, answer, 3, lambda c: c["message"]["content"] if "message" in c
                  else c["delta"]["content"])
    assert all(c.choices[0].delta.role == "assistant" for c in chunks[:3])
    # without include_usage: no usage chunk
    assert len(list(chat(client, n=2, stream=True))) == 2 + 1


def test_streamed_completions_are_the_answer_in_chunks(client):
    answer = complete(client, n=3)
    chunks = list(complete(client, n=3, stream=True, stream_options={"include_usage": True}))
    assert {c.object for c in chunks} == {"text_completion"}
    _check_stream(chunks, answer, 3, lambda c: c["text"])
    assert chunks[3].model_extra["output_tensors"] == answer.model_extra["output_tensors"]


def test_stream_wire_format_and_errors_before_the_first_byte(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": MESSAGES, "beam_width": W, "n": 2, "stream": True,
            "request_id": "stream-1"}
    response = httpx.post(server.url + CHAT, json=body, headers=auth, timeout=WAIT_S)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"] == "stream-1" and "x-catalog-version" in response.headers
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2]) and len(events) == 2 + 3
    assert json.loads(events[0][len("data: "):])["id"] == "stream-1"
    for bad, status in (({"n": 0}, 400), ({"stream_options": {"include_usage": 1}}, 422),
                        ({"model": "other"}, 404)):
        refused = httpx.post(server.url + CHAT, json={**body, **bad}, headers=auth,
                             timeout=WAIT_S)
        assert refused.status_code == status
        assert refused.headers["content-type"] == "application/json"
        assert refused.json()["error"]["request_id"]


def test_a_client_that_leaves_mid_stream_leaks_nothing(server):
    before = [requests_total(server, "chat", code)
              for code in ("OK", "CANCELLED")]
    body = json.dumps({"messages": MESSAGES, "beam_width": 64, "n": 64, "logprobs": True,
                       "stream": True}).encode()
    sock = raw_post(server.port, f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    f"{KEY}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                    "\r\n\r\n", body)
    assert sock.recv(64).startswith(b"HTTP/1.1 200")   # the stream began
    sock.close()
    app = server.service
    assert wait_until(lambda: app.num_in_flight == 0 and not app._waiters)
    after = [requests_total(server, "chat", code)
             for code in ("OK", "CANCELLED")]
    assert [b - a for a, b in zip(before, after)] == [1, 0]   # counted once, as answered
    assert httpx.get(server.url + "/health", timeout=WAIT_S).status_code == 200


# ---- prompts near the body limit -------------------------------------------------------------

def test_a_megabyte_prompt_is_refused_before_it_is_tokenized(server, client, engine, monkeypatch):
    """Just under the 1 MiB that service.py parses on a worker thread, so on the event loop:
    BPE on it would take most of a second, for a prompt refused anyway. The length error
    comes without the tokenizer encoding the text."""
    encoded = []

    def recorded(encode):
        def run(*args, **kwargs):
            encoded.append(args)
            return encode(*args, **kwargs)
        return run
    for name in ("encode", "encode_chat"):
        monkeypatch.setattr(engine.tokenizer, name, recorded(getattr(engine.tokenizer, name)))
    limit = server.service.max_body_bytes
    text = ("user watched <s_a_3><s_b_7><s_c_12> twice " * 30_000)[:1_000_000]
    assert len(text) < limit and len(text) < 1 << 20
    with pytest.raises(openai.BadRequestError, match=r"prompt: at least \d+ positions .*"
                                                     r"max_input_len=4096"):
        client.completions.create(model=MODEL, prompt=text, n=1, extra_body={"beam_width": W})
    with pytest.raises(openai.BadRequestError, match=r"messages: at least \d+ positions"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                       extra_body={"beam_width": W})
    assert encoded == []
    assert len(complete(client, n=1).choices) == 1 and len(encoded) == 1  # short ones are encoded


# ---- the README ----------------------------------------------------------------------------

def readme_examples() -> list[str]:
    """The python blocks of the README section "Use it from the OpenAI SDK", in order."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Use it from the OpenAI SDK\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_readme_examples_run(server, monkeypatch, capsys):
    examples = readme_examples()
    assert len(examples) == 3 and all(README_URL in e for e in examples[:2])
    monkeypatch.setenv("XREC_API_KEY", KEY)
    namespace: dict = {"__name__": "readme"}
    for example in examples:
        exec(compile(example.replace(README_URL, server.url), "README.md", "exec"), namespace)
    lines = capsys.readouterr().out.splitlines()
    assert all(SID_TEXT.match(line) for line in lines[:3])              # sync: 3 choices
    assert len(eval(lines[3])) == 3                                      # completions: 3 texts
    assert [line.split(" -> ")[0] for line in lines[4:7]] == [
        "<s_a_1><s_b_2><s_c_3>", "<s_a_4><s_b_5><s_c_6>", "<s_a_7><s_b_8><s_c_9>"]
    streamed = lines[7:]
    assert [line.split()[0] for line in streamed[:3]] == ["0", "1", "2"]
    assert [line.split()[1] for line in streamed[:3]] == [line.split()[0] for line in lines[:3]]
    assert streamed[3].endswith(" tokens") and len(streamed) == 4
