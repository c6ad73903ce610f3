"""One exception hierarchy; each class carries its status code and HTTP status."""

from __future__ import annotations


class XrecError(Exception):
    """Base class. `code` is the status name used in HTTP error bodies."""

    code = "INTERNAL"
    http_status = 500

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.request_id = request_id

    def __reduce__(self):  # the class, message and request id cross a process boundary
        return type(self), (self.message, self.request_id)


class InvalidArgument(XrecError, ValueError):
    code, http_status = "INVALID_ARGUMENT", 400


class Unauthenticated(XrecError):
    code, http_status = "UNAUTHENTICATED", 401


class NotFound(XrecError):
    code, http_status = "NOT_FOUND", 404


class PayloadTooLarge(XrecError):
    code, http_status = "PAYLOAD_TOO_LARGE", 413


class ResourceExhausted(XrecError):
    code, http_status = "RESOURCE_EXHAUSTED", 429


class Cancelled(XrecError):
    code, http_status = "CANCELLED", 499


class Internal(XrecError):
    code, http_status = "INTERNAL", 500


class Unavailable(XrecError):
    code, http_status = "UNAVAILABLE", 503


class DeadlineExceeded(XrecError):
    code, http_status = "DEADLINE_EXCEEDED", 504


ERRORS_BY_CODE = {cls.code: cls for cls in (InvalidArgument, Unauthenticated, NotFound,
                                            PayloadTooLarge, ResourceExhausted, Cancelled,
                                            Internal, Unavailable, DeadlineExceeded)}
