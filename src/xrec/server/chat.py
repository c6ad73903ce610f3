"""`POST /v1/chat/completions`: OpenAI / xllm chat requests for models with a chat template.

The request's `messages` are rendered with the model directory's chat template
and tokenized at the edge (`Engine.validate`), then searched like any request.
The answer has one `choices[i]` per result, best first:

    {"index": i, "message": {"role": "assistant", "content": "<s_a_1><s_b_2><s_c_3>"},
     "finish_reason": "stop", "logprobs": {"content": [...]} or null,
     "token_ids": [t0, t1, t2], "score": -1.2, "items": [{"item_id", "did", "type"}]}

Decisions where docs/serving.md leaves a choice:

- Items and the score sit beside the message in each choice (`choices[i].items`,
  `choices[i].score`, `choices[i].token_ids`): OpenAI clients ignore unknown
  fields, and a result's items belong to that choice.
- `n` and `num_return_sequences` both mean N (results); given both, they must agree.
  Neither: N = beam_width, not OpenAI's 1 (docs/serving.md, "N"): a recommendation is a
  list, the search finds W results at the cost of one, and `choices[0]` is the best.
- `logprobs: true` fills `choices[i].logprobs.content` with one entry per token
  (`token`, `logprob`, `bytes`, `top_logprobs`); `top_logprobs` must be 0..20 and the
  lists stay empty: a beam search scores the tokens it keeps, not alternatives.
- `max_tokens` / `max_completion_tokens` are accepted and ignored for length (a
  semantic ID has R tokens); sampling knobs (`temperature`, `top_p`, penalties,
  `seed`, `stop`) are accepted and ignored, as on `/v1/completions`. `top_k` <= 0 is
  the default (W), as on `/v1/completions` (vLLM's -1 / 0: no cutoff).
- `stream: true` answers the same choices as OpenAI's chunks (stream.py): one per
  choice with `delta.content` and the fields above, then `finish_reason`, then usage
  when `stream_options.include_usage` is true.
- The filters (`exclude_items`, `item_types`, `exclude_history`) are xrec extensions,
  as on the other routes (schemas.py); `exclude_history` excludes the items the
  conversation names by their semantic IDs, and `usage.excluded_items_unknown`
  counts the excluded ids the catalog does not hold.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import Field

from xrec.api_types import RecRequest, RecResponse
from xrec.errors import InvalidArgument
from xrec.server.schemas import (N_RESULTS, STREAM, STREAM_OPTIONS, RecExtensions,
                                 StreamOptions, filter_usage, filters_of, num_results,
                                 openai_top_k)

MAX_TOP_LOGPROBS = 20


class ChatRequest(RecExtensions):
    model: str | None = None
    messages: list[dict[str, Any]]
    beam_width: int | None = None
    n: int | None = Field(None, description=N_RESULTS)
    top_k: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    request_id: str | None = None
    stream: bool | None = Field(None, description=STREAM)
    stream_options: StreamOptions | None = Field(None, description=STREAM_OPTIONS)
    # OpenAI fields accepted and ignored
    temperature: Any = None
    top_p: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    seed: Any = None
    stop: Any = None
    user: Any = None
    response_format: Any = None
    logit_bias: Any = None
    service_tier: Any = None
    metadata: Any = None


def chat_request(req: ChatRequest, request_id: str) -> RecRequest:
    num = num_results(req.n, req.num_return_sequences)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs: got {req.top_logprobs}, allowed range "
                              f"[0, {MAX_TOP_LOGPROBS}]")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidArgument("top_logprobs: needs logprobs: true (as OpenAI's API)")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name)
        if value is not None and value < 0:
            raise InvalidArgument(f"{name}: got {value}, expected >= 0 (it is ignored)")
    return RecRequest(
        messages=req.messages, beam_width=req.beam_width, num_return_sequences=num,
        top_k=openai_top_k(req.top_k), normalize=req.normalize, return_items=req.return_items,
        timeout_ms=req.timeout_ms, request_id=request_id, **filters_of(req))


def chat_response(response: RecResponse, model: str, rounds: int, req: ChatRequest,
                  token_string: Any) -> dict:
    """One choice per result, best first. `token_string(id)` names a token (the tokenizer's)."""
    choices = []
    for index, r in enumerate(response.results):
        ids = list(r.tokens)
        choice = {"index": index,
                  "message": {"role": "assistant", "content": r.text or " ".join(map(str, ids))},
                  "finish_reason": "stop", "logprobs": None, "token_ids": ids, "score": r.score,
                  "items": r.items}
        if req.logprobs:
            content = []
            for token_id, logprob in zip(ids, r.token_logprobs):
                token = token_string(token_id) or str(token_id)
                content.append({"token": token, "logprob": logprob,
                                "bytes": list(token.encode()), "top_logprobs": []})
            choice["logprobs"] = {"content": content}
        choices.append(choice)
    prompt_tokens = int(response.usage.get("input_tokens", 0))
    completion = len(choices) * rounds
    return {"id": response.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion, **filter_usage(response.usage)}}
