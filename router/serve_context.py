"""`SeparateServeRequests`: a `Backend` whose every `generate` is its own Serve request.

Why: a client request fans out into one backend stream per (prompt, choice) (router/fanout.py). Under
Serve, a handle call made while serving a request inherits that request's context, including its
`_internal_request_id` (ray/serve/_private/default_impl.py:get_request_metadata). Serve 2.60's request
router indexes pending requests by that id and skips a second one with the same id
(`RequestRouter._add_pending_request_to_indices`), and a routing task that found a replica fulfils
"the pending request with this id": so the n children of one request all share one id, each routing
hands its replica to the first child, and the others wait on Serve's retry paths. That was the
`n` > 1 / prompt-list stall of issue 19 (one decode call about every 10 s; 64 separate requests were
fine). Each stream here runs in its own task (Fanout), so a fresh id set in that task's context
reaches exactly its own handle calls (and, through them, the pools' calls to each other).

A client request with several prompts or choices is now one `generate_batch` call (router/fanout.py),
which gets a fresh id the same way; a decode replica's prefill calls for its prompts each get their own
(`in_own_serve_request`, router/pools.py). Client cancellation still reaches every child: Fanout.aclose
cancels and aborts them itself.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, AsyncIterator, Callable, TypeVar

from router.protocol import Backend, GenerateRequest
from engine.llm_engine import RequestOutput

T = TypeVar("T")


def own_serve_request_context() -> None:
    """Give the current task a Serve request context of its own (a no-op outside a Serve request)."""
    from ray.serve import context as serve_context
    from ray.serve._private.utils import generate_request_id

    current = serve_context._serve_request_context.get()
    if current is None:
        return
    serve_context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=generate_request_id()))


def in_own_serve_request(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` (a handle's `.remote`) as a Serve request of its own, leaving the caller's context as it was."""
    ctx = contextvars.copy_context()
    return ctx.run(lambda: (own_serve_request_context(), fn(*args))[1])


class SeparateServeRequests:
    """Wraps a backend: `generate` runs as its own Serve request; everything else is the backend's."""

    def __init__(self, backend: Backend):
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    async def generate_batch(self, reqs: list[GenerateRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        own_serve_request_context()
        async with contextlib.aclosing(self._backend.generate_batch(reqs)) as stream:
            async for item in stream:
                yield item

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        own_serve_request_context()
        # aclosing: closing this stream (client gone) must close the backend's at once, which aborts it.
        async with contextlib.aclosing(self._backend.generate(req)) as stream:
            async for out in stream:
                yield out
