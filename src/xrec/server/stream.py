"""`stream: true` on `/v1/completions` and `/v1/chat/completions`: the answer as OpenAI's
server-sent events.

A beam search finishes all its results together, so the events are written once the
engine has answered: every error (validation, auth, the engine's 4xx / 5xx) comes
before the first byte, with its JSON status and shape, and the events are one body
(nothing is left running when a client leaves in the middle of it). Each event is
`data: <JSON>` and a blank line:

- one chunk per choice, best first, `finish_reason: null`: chat
  `{"index", "delta": {"role": "assistant", "content": SID text}, "logprobs", "token_ids",
  "score", "items"}`, completions `{"index", "text", "logprobs"}`, the fields of the
  non-streamed choice;
- one chunk with every choice's `finish_reason: "stop"` (an empty `delta` / `text`);
  on `/v1/completions` it also carries the answer's `output_tensors`;
- with `stream_options.include_usage`, a chunk with `choices: []` and the `usage`;
- `data: [DONE]`.

Every chunk has the answer's `id`, `created` and `model`, and `object`
`chat.completion.chunk` (chat) or `text_completion` (completions), as OpenAI's.
"""

from __future__ import annotations

from collections.abc import Iterator

import orjson
from fastapi.responses import Response

MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"


def sse_response(payload: dict, api: str, include_usage: bool, headers: dict[str, str]) -> Response:
    """The events of `payload` (a non-streamed answer of `api`, "xllm" or "chat")."""
    body = b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n"
                    for chunk in chunks(payload, api, include_usage)) + DONE
    return Response(body, media_type=MEDIA_TYPE, headers={**headers, "Cache-Control": "no-cache"})


def chunks(payload: dict, api: str, include_usage: bool) -> Iterator[dict]:
    """The chunks of `payload`, in order (the module docstring)."""
    is_chat = api == "chat"
    head = {"id": payload["id"], "object": "chat.completion.chunk" if is_chat else "text_completion",
            "created": payload["created"], "model": payload["model"]}
    for choice in payload["choices"]:
        yield {**head, "choices": [_delta(choice) if is_chat else {**choice, "finish_reason": None}]}
    empty = {"delta": {}} if is_chat else {"text": ""}
    last = {**head, "choices": [{"index": c["index"], **empty, "logprobs": None,
                                 "finish_reason": c["finish_reason"]} for c in payload["choices"]]}
    if "output_tensors" in payload:
        last["output_tensors"] = payload["output_tensors"]
    yield last
    if include_usage:
        yield {**head, "choices": [], "usage": payload["usage"]}


def _delta(choice: dict) -> dict:
    """A chat choice as a chunk's choice: its message as the delta."""
    out = {key: value for key, value in choice.items() if key != "message"}
    return {"index": choice["index"], "delta": choice["message"], **out, "finish_reason": None}
