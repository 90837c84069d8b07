"""The gRPC front end (`tandem.v1.Inference`) over any `Backend`.

`InferenceServicer` has the methods in the shape Ray Serve's gRPC proxy calls on an ingress
deployment: named like the RPCs, taking the request proto and a `grpc_context`
(`RayServegRPCContext` under Serve), `GenerateStream` an async generator. A failure sets its status
code and details on `grpc_context` and raises `RpcError`: Serve's replica turns a raise after
`set_code` into exactly that status for the client. `add_to_aio_server` runs the same methods on a
plain `grpc.aio` server (tests, router.standalone), where `RpcError` becomes `context.abort`.

Parity with /v1: a chat (`messages`, rendered by the chat template), presence/frequency penalties,
`logprobs` (each token's logprob and top alternatives), `n` choices (streamed messages carry their
`index`; Generate returns them all in `choices`), and structured output (json_schema, regex, choice,
grammar, json_object; checked against the grammar engine like /v1's, INVALID_ARGUMENT naming why).

A client that cancels (or whose deadline passes) cancels the handler task; the backend request is
aborted on the way out. The engine request id is always made here (`grpc-<uuid>`); a client's
`request_id` is only a label echoed in its responses, so reusing one (even one in flight) is fine and
reveals nothing about other clients. Errors reach the client through `router.guards.public_error`;
a request over the size limit is RESOURCE_EXHAUSTED, a prompt over the character limit
INVALID_ARGUMENT, both before tokenizing, which runs off the event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable

import grpc

from router import params, structured
from router.errors import ApiError, bad_request
from router.fanout import Fanout
from router.guards import RequestLimits, new_request_id, off_loop, public_error
from router.metrics import RequestTimer
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from router.protocol import Backend, GenerateRequest
from router.serve_context import SeparateServeRequests
from engine.llm_engine import RequestOutput
from workers.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = SamplingParams.model_fields["max_tokens"].default
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty", "min_tokens",
                      "presence_penalty", "frequency_penalty", "logprobs")
MAX_N = 128  # choices per request, as /v1's limit
# gRPC's code for "message too large" (router.errors maps HTTP statuses; 413 is HTTP-only there).
_EXTRA_CODES = {413: grpc.StatusCode.RESOURCE_EXHAUSTED}


class RpcError(Exception):
    # Both values go to Exception's args: Serve pickles the exception from the replica to the proxy.
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, details)
        self.code, self.details = code, details

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


def _metadata(grpc_context: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in (grpc_context.invocation_metadata() or ())}


@dataclass
class _Call:
    """What an RPC body gets from `InferenceServicer._call`."""
    reqs: list[GenerateRequest]  # one per choice
    label: str  # the id the client sees: its own request_id, else the engine's
    fanout: Fanout
    timer: RequestTimer
    logprobs: bool  # the client asked for per-token logprobs


class InferenceServicer:
    def __init__(self, backend: Backend, api_keys: Iterable[str] = (), request_timeout_s: float | None = None,
                 limits: RequestLimits | None = None, trace_requests: bool = False):
        self.backend = backend
        self.api_keys = [k.encode() for k in api_keys]
        self.request_timeout_s = request_timeout_s
        self.limits = limits or RequestLimits()
        self.trace_requests = trace_requests  # log each finished request's timeline (router/metrics.py)

    # ---- RPCs ----
    async def Generate(self, request: pb.GenerateRequest, grpc_context: Any) -> pb.GenerateResponse:
        async with self._call(request, grpc_context) as call:
            outs = await call.fanout.final_outputs(call.timer.output)
            for out in outs:
                self._check_not_aborted(out)
            resp = self._response(call, 0, outs[0], outs[0].text, outs[0].token_ids, outs[0].logprobs)
            if len(outs) > 1:
                resp.choices.extend(pb.Choice(index=i, text=o.text, token_ids=o.token_ids, finish_reason=o.finish_reason or "",
                                              logprobs=self._logprobs(call, o.token_ids, o.logprobs))
                                    for i, o in enumerate(outs))
                self._usage(resp, call, outs)
            return resp

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context: Any) -> AsyncIterator[pb.GenerateResponse]:
        async with self._call(request, grpc_context) as call:
            async for i, out in call.fanout:
                call.timer.output(out)
                self._check_not_aborted(out)
                if out.new_text or out.new_token_ids or out.finished:
                    call.timer.sent()
                    k = len(out.new_token_ids)
                    yield self._response(call, i, out, out.new_text, out.new_token_ids,
                                         (out.logprobs or [])[-k:] if k else [])

    # ---- helpers ----
    @contextlib.asynccontextmanager
    async def _call(self, request: pb.GenerateRequest, grpc_context: Any) -> AsyncIterator[_Call]:
        """One RPC's shared skeleton: authenticate and parse the request, start its `Fanout` under the
        timeout, and on the way out record the outcome, map a failure to its gRPC status (`_fail`) and
        abort the backend request (a cancelled client cancels the handler task)."""
        timer, fanout, rid = RequestTimer(self.trace_requests, self.backend.model_name), None, new_request_id("grpc")
        try:
            reqs = await self._prepare(request, grpc_context, rid)
            timer.num_prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
            fanout = Fanout(SeparateServeRequests(self.backend), reqs, self._timeout(grpc_context))
            yield _Call(reqs, request.request_id or rid, fanout, timer, request.HasField("logprobs"))
            timer.finish("ok")
        except asyncio.CancelledError:
            timer.finish("cancelled")
            raise
        except Exception as e:
            self._fail(grpc_context, e, timer, rid)
        finally:
            if fanout is not None:
                await fanout.aclose()

    def _fail(self, grpc_context: Any, exc: Exception, timer: RequestTimer, rid: str) -> None:
        err = public_error(exc, rid)
        code = _EXTRA_CODES.get(err.status, err.grpc_code)
        timer.finish(err.status_tag)
        grpc_context.set_code(code)
        grpc_context.set_details(err.message)
        if err.retry_after is not None:
            grpc_context.set_trailing_metadata([("retry-after", str(err.retry_after))])
        # Not chained: Serve pickles this to its proxy, and the cause's text is what must stay server-side.
        raise RpcError(code, err.message) from None

    def _authenticate(self, grpc_context: Any) -> None:
        if not self.api_keys:
            return
        scheme, _, key = _metadata(grpc_context).get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(key.strip().encode(), k) for k in self.api_keys):
            raise ApiError(401, "missing or invalid API key: send metadata `authorization: Bearer <key>`",
                           type="authentication_error", code="invalid_api_key")

    def _timeout(self, grpc_context: Any) -> float | None:
        """The configured limit, or the client's deadline when sooner (grpc.aio exposes it; Serve's proxy
        applies its own `grpc_options.request_timeout_s`)."""
        remaining = getattr(grpc_context, "time_remaining", lambda: None)()
        limits = [t for t in (self.request_timeout_s, remaining) if t is not None]
        return min(limits) if limits else None

    async def _prepare(self, request: pb.GenerateRequest, grpc_context: Any, rid: str) -> list[GenerateRequest]:
        """The backend requests of one RPC: one per choice (choice j of a seeded request gets seed + j)."""
        self._authenticate(grpc_context)
        size = request.ByteSize()
        if size > self.limits.max_body_bytes:
            raise self.limits.body_too_large(size)
        if not await self.backend.ready():
            raise ApiError(503, "the model is not ready to serve yet", type="service_unavailable", code="unavailable")
        params.check_model(self.backend, request.model)
        given = [f for f, v in (("prompt", request.prompt), ("prompt_token_ids", request.prompt_token_ids),
                                ("messages", request.messages)) if v]
        if len(given) != 1:
            raise bad_request("set exactly one of prompt, prompt_token_ids and messages", given[1] if given else "prompt")
        n = request.n if request.HasField("n") else 1
        if not 1 <= n <= MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
        constraint = structured.resolve(self._constraints(request))
        if request.prompt:
            self.limits.check_prompt_chars(self.backend.max_model_len, [request.prompt], "prompt")
            ids = await off_loop(self.backend.tokenizer.encode, request.prompt)
        elif request.messages:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            self.limits.check_prompt_chars(self.backend.max_model_len, [m["content"] for m in messages], "messages")
            ids = await off_loop(params.render_chat, self.backend, messages)
        else:
            ids = list(request.prompt_token_ids)
        params.check_prompt_ids(self.backend, ids, given[0])
        max_tokens = request.max_tokens if request.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        max_tokens = params.resolve_max_tokens(self.backend, len(ids), max_tokens)
        optional = {f: getattr(request, f) for f in _OPTIONAL_SAMPLING if request.HasField(f)}
        reqs = []
        for j in range(n):
            if "seed" in optional:
                optional["seed"] = request.seed + j
            sp = params.sampling_params(max_tokens=max_tokens, stop=list(request.stop), ignore_eos=request.ignore_eos,
                                        stop_token_ids=list(request.stop_token_ids), structured_outputs=constraint, **optional)
            reqs.append(GenerateRequest(rid if n == 1 else f"{rid}-{j}", ids, sp, request.priority))
        return reqs

    @staticmethod
    def _constraints(request: pb.GenerateRequest) -> list[tuple[str, Any]]:
        """Every structured-output field the request sets, as (field, spec) for `structured.resolve`."""
        fields = (("json_schema", "json", request.json_schema), ("regex", "regex", request.regex),
                  ("choice", "choice", list(request.choice)), ("grammar", "grammar", request.grammar),
                  ("json_object", "json_object", request.json_object))
        return [(name, structured.from_field(kind, value, name)) for name, kind, value in fields if value]

    @staticmethod
    def _check_not_aborted(out: RequestOutput) -> None:
        if out.finish_reason == "abort":  # stopped by the server (backend.abort, shutdown): CANCELLED
            raise ApiError(499, "the request was aborted by the server", type="cancelled", code="aborted")

    def _response(self, call: _Call, index: int, out: RequestOutput, text: str, token_ids: list[int],
                  logprobs: list[dict[int, float]] | None) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=call.label, model=self.backend.model_name, text=text, token_ids=token_ids,
                                   finish_reason=out.finish_reason or "", index=index,
                                   logprobs=self._logprobs(call, token_ids, logprobs))
        if out.finished:
            self._usage(resp, call, [out])
        return resp

    @staticmethod
    def _usage(resp: pb.GenerateResponse, call: _Call, outs: list[RequestOutput]) -> None:
        n_prompt, n_out = len(call.reqs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                                     cached_tokens=outs[0].num_cached_tokens))

    @staticmethod
    def _logprobs(call: _Call, token_ids: list[int], entries: list[dict[int, float]] | None) -> list[pb.TokenLogprob]:
        """One entry per token: its logprob and the top alternatives, most likely first (each engine entry
        maps the sampled id and the top-n ids to their logprobs)."""
        if not call.logprobs or not entries:
            return []
        n_top = call.reqs[0].sampling_params.logprobs or 0
        out = []
        for tok, entry in zip(token_ids, entries):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:n_top]
            out.append(pb.TokenLogprob(token_id=tok, logprob=entry.get(tok, float("nan")),
                                       top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top]))
        return out


class _AioAdapter(pb_grpc.InferenceServicer):
    """The servicer on a plain grpc.aio server: RpcError -> context.abort with its status."""

    def __init__(self, servicer: InferenceServicer):
        self.servicer = servicer

    async def Generate(self, request, context):
        try:
            return await self.servicer.Generate(request, grpc_context=context)
        except RpcError as e:
            await context.abort(e.code, e.details)

    async def GenerateStream(self, request, context):
        try:
            async for resp in self.servicer.GenerateStream(request, grpc_context=context):
                yield resp
        except RpcError as e:
            await context.abort(e.code, e.details)


def add_to_aio_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    pb_grpc.add_InferenceServicer_to_server(_AioAdapter(servicer), server)
