"""What every engine offers its callers, whichever way it isolates its pipelines.

`EngineFrontend` holds the edge (validation against the engine's `limits`, prompt
tokenization) and the request API built on two primitives that each engine
implements: `submit_valid` and `submit_valid_many`.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any, Sequence

from xrec.api_types import RecRequest, RecResponse, SearchLimits, ValidRequest, validate
from xrec.errors import InvalidArgument


class EngineFrontend:
    """The request API: `submit`, `submit_many`, `recommend`, `recommend_async`."""

    limits: SearchLimits
    tokenizer: Any

    def submit_valid(self, valid: ValidRequest, as_data: bool = False) -> Future:
        """Queue a request that `validate` returned. `as_data`: the future resolves to the
        answer's arrays (`xrec.engine.responses.ResponseData`, what the HTTP server writes
        JSON from) instead of a `RecResponse` (thousands of small objects to build)."""
        raise NotImplementedError

    def submit_valid_many(self, valids: Sequence[ValidRequest],
                          as_data: bool = False) -> list[Future]:
        """Queue validated requests at once (so they can share a batch)."""
        raise NotImplementedError

    def close(self, grace_s: float = 30.0) -> None:
        raise NotImplementedError

    def submit(self, request: RecRequest) -> Future:
        """Validate and queue one request; its future resolves to a `RecResponse` or an
        `XrecError`. Raises `InvalidArgument` at once for a bad request."""
        return self.submit_valid(self.validate(request))

    def validate(self, request: RecRequest) -> ValidRequest:
        """The request checked and its prompt tokenized (the edge), not queued."""
        if not isinstance(request, RecRequest):
            raise InvalidArgument(f"expected a RecRequest, got {type(request).__name__}")
        return validate(request, self.limits, self.tokenizer)

    def submit_many(self, requests: Sequence[RecRequest]) -> list[Future]:
        """Validate every request, then queue them all at once (so they can share a batch).
        Raises `InvalidArgument` before queueing anything if one is bad; a request refused
        at admission (queue full, too big) has its future failed."""
        if not isinstance(requests, Sequence) or isinstance(requests, str):
            raise InvalidArgument(f"requests: expected a sequence of RecRequest, got "
                                  f"{type(requests).__name__}")
        for index, request in enumerate(requests):
            if not isinstance(request, RecRequest):
                raise InvalidArgument(f"requests[{index}]: expected a RecRequest, got "
                                      f"{type(request).__name__}")
        return self.submit_valid_many([self.validate(request) for request in requests])

    def recommend(self, requests: RecRequest | Sequence[RecRequest]) -> list[RecResponse]:
        """Run requests to completion (`submit_many`); responses in request order; the
        first failure is raised."""
        if isinstance(requests, RecRequest):
            requests = [requests]
        return [future.result() for future in self.submit_many(requests)]

    async def recommend_async(self, request: RecRequest) -> RecResponse:
        """Await one request; cancelling the awaiting task cancels a still-waiting request."""
        return await asyncio.wrap_future(self.submit(request))

    def __enter__(self) -> "EngineFrontend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
