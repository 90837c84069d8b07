"""Guards both front ends (OpenAI HTTP, gRPC) put around a request before and after the backend.

- `RequestLimits`: a body-size and a prompt-length limit, checked before any tokenizing, so an
  oversized request costs the server almost nothing (HTTP 413 / 400, gRPC RESOURCE_EXHAUSTED /
  INVALID_ARGUMENT).
- `off_loop`: tokenizing, chat templates and detokenizing run on a small thread pool, never on the
  event loop, so `/health` and every other request keep being served while one big prompt is encoded.
- `public_error`: what a client may see of a failure. Backend errors cross Ray, whose exceptions
  carry tracebacks, pids, node IPs, actor ids and file paths; those are logged here with the request
  id, and the client gets a short message naming that id.
- `new_request_id`: engine request ids are always made here; a client's own id is only a label
  echoed back, so one client can neither collide with nor probe another's in-flight request.
"""
from __future__ import annotations

import asyncio
import logging
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError

from router.errors import ApiError, api_error, bad_request
from engine.async_engine import EngineDeadError
from engine.disagg import PrefillUnavailable
from engine.scheduler import QueueFullError
from router.protocol import BackendUnavailable
from workers.executor import ExecutorError

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# With no explicit character limit a prompt may have this many characters per token of context: no
# tokenizer in use packs more into one token on real text, so a longer prompt cannot fit anyway and
# is refused without spending seconds encoding it.
CHARS_PER_TOKEN_BOUND = 32
# Text work is short and GIL-releasing in fast tokenizers; a few threads keep one huge prompt from
# holding up the others while bounding the CPU that text work can take from the engine.
TEXT_THREADS = 4
_text_pool = ThreadPoolExecutor(max_workers=TEXT_THREADS, thread_name_prefix="tandem-text")


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int | None = None  # None: CHARS_PER_TOKEN_BOUND x the backend's max_model_len

    @classmethod
    def from_config(cls, config: Any) -> "RequestLimits":
        """From an `AppConfig` (its max_request_body_bytes / max_prompt_chars)."""
        return cls(config.max_request_body_bytes, config.max_prompt_chars)

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or CHARS_PER_TOKEN_BOUND * max_model_len

    def body_too_large(self, size: int) -> ApiError:
        return ApiError(413, f"The request body has {size} bytes or more; this server accepts at most "
                        f"{self.max_body_bytes}.", code="request_too_large")

    def check_prompt_chars(self, max_model_len: int, texts: Iterable[str], param: str) -> None:
        """Before tokenizing: the total characters of a request's prompt text (all its prompts or messages)."""
        limit, total = self.prompt_chars(max_model_len), sum(len(t) for t in texts)
        if total > limit:
            raise bad_request(f"The prompt has {total} characters; this server accepts at most {limit} "
                              f"(the model's context is {max_model_len} tokens).", param)


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run CPU-bound text work (tokenize, chat template, detokenize) on the text thread pool."""
    return await asyncio.get_running_loop().run_in_executor(_text_pool, lambda: fn(*args, **kwargs))


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- what a client may see of an error
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.+@-]+){2,}")
_IP = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b")
_PID = re.compile(r"\bpid[=: ]+\d+", re.IGNORECASE)
_HEX_ID = re.compile(r"\b[0-9a-f]{16,}\b", re.IGNORECASE)
_MAX_MESSAGE = 300


def redact(text: str) -> str:
    """One line, no traceback, no paths, IPs, pids or long hex ids (Ray's actor, task and node ids)."""
    text = text.split("Traceback (most recent call last)", 1)[0].strip()
    text = text.splitlines()[0] if text else ""
    for pattern, repl in ((_PATH, "<path>"), (_IP, "<address>"), (_PID, "pid <hidden>"), (_HEX_ID, "<id>")):
        text = pattern.sub(repl, text)
    return text[:_MAX_MESSAGE]


def _unwrap(exc: BaseException) -> BaseException:
    """The exception the backend raised, not Ray's wrapper around it (whose text is a remote traceback)."""
    while isinstance(exc, RayTaskError) and isinstance(getattr(exc, "cause", None), BaseException):
        exc = exc.cause
    return exc


def public_error(exc: BaseException, request_id: str) -> ApiError:
    """The client's view of `exc`. Errors of the front ends' own checks pass as they are; a backend's
    are logged in full with the request id and reach the client as a short message naming that id."""
    if isinstance(exc, ApiError):
        return exc
    cause = _unwrap(exc)
    if isinstance(cause, BackPressureError):  # Serve's own queue bound (max_queued_requests): overload, not a fault
        cause = QueueFullError("every replica's queue is full", retry_after_s=cause.retry_after_s)
    if isinstance(cause, (EngineDeadError, RayActorError, ExecutorError, PrefillUnavailable)):
        # A pool replica's engine lost a rank, or a replica died, under this request: Serve replaces it, so
        # this is "retry later" (503), not a server bug (500) - found by scripts/fault_load.py's kill-rank.
        # So is a decode replica whose ranks are gone (ExecutorError), and a prefill pool with no live replica
        # under a request whose token 1 had already gone out (PrefillUnavailable: it cannot start over here).
        cause = BackendUnavailable(str(cause))
    if isinstance(cause, ApiError):  # our own check, raised in a pool replica
        return ApiError(cause.status, redact(cause.message), type=cause.type, param=cause.param, code=cause.code,
                        retry_after_s=cause.retry_after_s)
    known = isinstance(cause, (ValueError, QueueFullError, BackendUnavailable, TimeoutError, asyncio.TimeoutError))
    if not known:
        log.error("request %s: unexpected error", request_id, exc_info=exc)
        return ApiError(500, f"internal server error (request id {request_id})", type="server_error",
                        code="internal_error")
    log.warning("request %s failed: %s", request_id, exc, exc_info=exc if cause is not exc else None)
    err = api_error(cause)
    if err.status == 503:  # a replica died or is draining: its Ray error says which, on which node
        err.message = "no replica could serve the request (it failed or is restarting); retry later"
    err.message = f"{redact(err.message)} (request id {request_id})"
    return err
