"""xrec: a serving engine for OneRec-style generative recommendation models.

The public API: `Engine`, `RecRequest`, `RecResponse`, `RecCandidate`,
`RecItem` and the exception classes. `Engine` is imported lazily so that
`import xrec` (and the CLI's `--help`) does not load torch.
"""

from typing import Any

from xrec.api_types import RecCandidate, RecItem, RecRequest, RecResponse
from xrec.errors import (Cancelled, DeadlineExceeded, Internal, InvalidArgument, NotFound,
                         PayloadTooLarge, ResourceExhausted, Unauthenticated, Unavailable,
                         XrecError)

__version__ = "0.1.0"
__all__ = ["Engine", "RecRequest", "RecResponse", "RecCandidate", "RecItem", "XrecError",
           "InvalidArgument", "Unauthenticated", "NotFound", "PayloadTooLarge",
           "ResourceExhausted", "Cancelled", "Internal", "Unavailable", "DeadlineExceeded"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from xrec.engine.engine import Engine
        return Engine
    raise AttributeError(f"module 'xrec' has no attribute {name!r}")
