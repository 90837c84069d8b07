"""One mapping from failures to what each front end reports (HTTP status + OpenAI error body, gRPC code).

`ApiError` is raised by the front ends' own checks (bad parameter, unknown model, missing key);
`api_error(exc)` turns anything else a backend raised into one, following `router.protocol`.
"""
from __future__ import annotations

import asyncio
import logging
import math

import grpc
from pydantic import ValidationError

from router.protocol import BackendUnavailable
from engine.scheduler import QueueFullError

log = logging.getLogger(__name__)

# Retry-After of a 429 / 503, in whole seconds: the engine's estimate of when its queue has drained
# (`QueueFullError.retry_after_s`) clamped to this range, or the minimum where there is no estimate. The
# floor keeps clients from retrying in a tight loop; the ceiling keeps a bad estimate (a queue that just
# stalled) from sending them away for long.
RETRY_AFTER_S = 1
RETRY_AFTER_MAX_S = 30

GRPC_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# The `status` tag of tandem_requests_total, per HTTP status.
STATUS_TAGS: dict[int, str] = {200: "ok", 400: "bad_request", 401: "unauthorized", 404: "not_found", 429: "queue_full",
                               499: "cancelled", 500: "error", 503: "unavailable", 504: "timeout"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s  # the backend's estimate, unclamped; None: none

    def __reduce__(self):  # keyword-only fields survive pickling (Ray ships exceptions between processes)
        return (_rebuild_api_error, (self.status, self.message, self.type, self.param, self.code, self.retry_after_s))

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return GRPC_CODES.get(self.status, grpc.StatusCode.UNKNOWN)

    @property
    def status_tag(self) -> str:
        return STATUS_TAGS.get(self.status, "error")

    @property
    def retry_after(self) -> int | None:
        """Whole seconds for the Retry-After header / gRPC trailer of a 429 or 503."""
        if self.status not in (429, 503):
            return None
        if self.retry_after_s is None or not math.isfinite(self.retry_after_s):
            return RETRY_AFTER_S
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_S, math.ceil(self.retry_after_s)))

    def body(self) -> dict:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _rebuild_api_error(status: int, message: str, type: str, param: str | None, code: str | None,
                       retry_after_s: float | None = None) -> ApiError:
    return ApiError(status, message, type=type, param=param, code=code, retry_after_s=retry_after_s)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def from_validation_error(e: ValidationError, prefix: str = "") -> ApiError:
    """A pydantic error as a 400 that names the offending parameter."""
    err = e.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or None
    msg = err.get("msg", str(e))
    return bad_request(f"{prefix}{param + ': ' if param else ''}{msg}", param)


def api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, QueueFullError):
        return ApiError(429, f"server busy, retry later: {exc}", type="rate_limit_error", code="queue_full",
                        retry_after_s=getattr(exc, "retry_after_s", None))
    if isinstance(exc, BackendUnavailable):
        return ApiError(503, f"service unavailable: {exc}", type="service_unavailable", code="unavailable")
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return ApiError(504, f"request timed out{': ' + str(exc) if str(exc) else ''}", type="timeout", code="timeout")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    log.error("unexpected error while serving a request", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error")
