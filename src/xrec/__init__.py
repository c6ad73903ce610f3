"""xrec: a serving engine for OneRec-style generative recommendation models."""

from xrec.errors import (Cancelled, DeadlineExceeded, Internal, InvalidArgument, NotFound,
                         PayloadTooLarge, ResourceExhausted, Unauthenticated, Unavailable,
                         XrecError)

__version__ = "0.1.0"
__all__ = ["XrecError", "InvalidArgument", "Unauthenticated", "NotFound", "PayloadTooLarge",
           "ResourceExhausted", "Cancelled", "Internal", "Unavailable", "DeadlineExceeded"]
