"""The OpenAI-compatible HTTP front end over any `Backend`: `create_openai_app(backend, ...)`.

/v1/models, /v1/completions, /v1/chat/completions (SSE streaming, usage chunk, logprobs, n, stop,
seed, vLLM extras, structured output, tools), vLLM's /tokenize, /detokenize and /version, /health,
/metrics (Prometheus text of every live replica of the Serve application, router/replica_metrics.py;
behind the API keys when keys are on). Every response carries an
X-Request-Id header (the client's, echoed, or a new one). A stream whose first tokens take longer than
`sse_keepalive_s` (a long queue) starts anyway and sends SSE comment lines (": keep-alive") every
`sse_keepalive_s` until they come, so that idle timeouts of proxies and clients do not fire. Every
error is OpenAI's error object with a fitting status (never FastAPI's 422), and never shows a backend's
internals (router/guards.py). Bodies over the size limit get 413 before they are read in full; prompts
over the character limit get 400 before tokenizing, which runs off the event loop. A client that goes
away (mid-stream or while waiting) aborts its requests at once.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from importlib import metadata
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router import params
from router.errors import ApiError, bad_request
from router.fanout import Fanout
from router.guards import RequestLimits, new_request_id, off_loop, public_error
from router.metrics import REQUESTS, RequestTimer
from router.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                    chat_logprobs, completion_logprobs, delta_logprobs, echo_logprobs, joined_logprobs,
                                    usage, vllm_prompt_logprobs)
from router.protocol import Backend, GenerateRequest
from router.replica_metrics import application_page
from router.tool_parsers import ForcedStream, ToolParser, ToolStream, check_parser_setting, forced_calls, parser_for
from router.serve_context import SeparateServeRequests
from engine.llm_engine import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before the response started."""


class StreamUsage:
    """A stream's usage as its chunks go out: the closing usage chunk (`include_usage`) and, with
    `continuous_usage_stats`, the usage so far on every chunk. Counted over the whole request (every
    prompt once, every choice's tokens so far), so the last chunk's usage equals the closing one's."""

    def __init__(self, reqs: list[GenerateRequest], n: int, include: bool, continuous: bool):
        self.reqs, self.n, self.include, self.continuous = reqs, n, include, continuous
        self.latest: dict[int, RequestOutput] = {}

    def update(self, i: int, out: RequestOutput) -> None:
        self.latest[i] = out

    def now(self) -> dict:
        prompt_tokens = sum(len(r.prompt_token_ids) for r in self.reqs[::self.n])
        cached = sum(self.latest[i].num_cached_tokens for i in range(0, len(self.reqs), self.n) if i in self.latest)
        return usage(prompt_tokens, sum(len(o.token_ids) for o in self.latest.values()), cached)

    def on_chunk(self) -> dict[str, Any]:
        """The usage field of a content chunk (OpenAI: null there unless usage is streamed continuously)."""
        if self.continuous:
            return {"usage": self.now()}
        return {"usage": None} if self.include else {}

    def closing(self, head: dict) -> dict | None:
        return {**head, "choices": [], "usage": self.now()} if self.include else None


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    """Streams until the body ends or the client disconnects, whichever comes first, and then always
    closes the body generator, so that the backend requests are aborted now and not at garbage
    collection (Starlette alone stops at the next failed send and leaves the generator suspended)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client is gone (ASGI spec >= 2.4 reports it on send)
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw`, cancelling it if the client disconnects first (then raise ClientGone)."""
    work, watch = asyncio.ensure_future(aw), asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientGone()
    finally:
        for task in (work, watch):
            task.cancel()


class ApiKeyAuth:
    """ASGI middleware: with keys configured, every route but /health needs `Authorization: Bearer
    <key>`. It runs before the body is parsed, so a client without a key learns nothing about its
    request (401 before any 400)."""

    PUBLIC = frozenset({"/health"})

    def __init__(self, app, api_keys: Iterable[str]):
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    def _allowed(self, scope) -> bool:
        if not self.keys or scope["type"] != "http":
            return True
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):  # mounted under a prefix (Serve's route_prefix, Starlette's Mount)
            path = path[len(root):]
        if path in self.PUBLIC:
            return True
        scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and any(hmac.compare_digest(key.strip(), k) for k in self.keys)

    async def __call__(self, scope, receive, send) -> None:
        if self._allowed(scope):
            return await self.app(scope, receive, send)
        err = ApiError(401, "Incorrect or missing API key: pass `Authorization: Bearer <key>`.",
                       type="authentication_error", code="invalid_api_key")
        await error_response(err)(scope, receive, send)


class RequestIdHeader:
    """ASGI middleware: every HTTP response carries X-Request-Id, the client's own (echoed, at most
    128 visible ASCII characters) or a new random one (as vLLM's --enable-request-id-headers)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        rid = given if 0 < len(given) <= 128 and given.isascii() and all(32 < c < 127 for c in given) \
            else uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodySizeLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 as soon as its declared
    length (or, chunked, the bytes received so far) passes the limit: it is never parsed or tokenized.
    The body is read here and handed on whole, so the app below sees an ordinary request."""

    def __init__(self, app, limits: RequestLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            return await self._refuse(int(declared), scope, receive, send)
        chunks, size, more, last = [], 0, True, None
        while more:
            last = await receive()
            if last["type"] != "http.request":
                break  # the client left: let the app see the disconnect
            chunks.append(last.get("body", b""))
            size += len(chunks[-1])
            more = last.get("more_body", False)
            if size > self.limits.max_body_bytes:
                return await self._refuse(size, scope, receive, send)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}] \
            if last is None or last["type"] == "http.request" else [last]

        async def replayed_receive():
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replayed_receive, send)

    async def _refuse(self, size: int, scope, receive, send) -> None:
        response = error_response(self.limits.body_too_large(size))
        response.headers["Connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


class OpenAIServer:
    def __init__(self, backend: Backend, request_timeout_s: float | None = None, limits: RequestLimits | None = None,
                 trace_requests: bool = False, sse_keepalive_s: float = 5.0, tool_call_parser: str = "auto"):
        self.backend = backend
        self.sse_keepalive_s = sse_keepalive_s
        self.tool_call_parser = check_parser_setting(tool_call_parser)  # "auto": from the chat template
        self.request_timeout_s = request_timeout_s
        self.limits = limits or RequestLimits()
        self.trace_requests = trace_requests  # log each finished request's timeline (router/metrics.py)
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}

    # ---- checks ----
    async def check_ready(self) -> None:
        if not await self.backend.ready():
            raise ApiError(503, "the model is not ready to serve yet", type="service_unavailable", code="unavailable")

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.backend.tokenizer.decode([token_id])
        return text

    # ---- shared request path ----
    def _refuse(self, exc: Exception, rid: str) -> JSONResponse:
        """A request answered before it reached the backend (bad input, unknown model, not ready): it is
        counted like any other, so that a dashboard shows refusals and 503s while the pools start."""
        err = public_error(exc, rid)
        REQUESTS.inc(1, tags={"status": err.status_tag, "model_name": self.backend.model_name})
        return error_response(err)

    def _requests(self, base: str, prompts: list[list[int]], n: int, max_tokens: int | None, priority: int,
                  fields: dict[str, Any], prompt_param: str, aliases: dict[str, str] | None = None,
                  max_tokens_given: bool = True) -> list[GenerateRequest]:
        """One backend request per (prompt, choice); choice j of a seeded request gets seed + j.
        Fields the client left unset stay unset in the SamplingParams, so that the engine fills them
        from the model's generation_config.json; so does a max_tokens the client did not give (the
        context room, or completions' 16, is then only a ceiling on the model's max_new_tokens)."""
        reqs = []
        for p, ids in enumerate(prompts):
            params.check_prompt_ids(self.backend, ids, prompt_param)
            limit = params.resolve_max_tokens(self.backend, len(ids), max_tokens)
            for j in range(n):
                seed = fields.get("seed")
                sp = params.sampling_params(aliases, **{**fields, "max_tokens": limit, "seed": None if seed is None else seed + j})
                reqs.append(GenerateRequest(f"{base}-{p * n + j}", ids, sp if max_tokens_given else sp.leaving_unset("max_tokens"),
                                            priority))
        return reqs

    async def _encode(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt; text is measured first (400 past the limit) and encoded off the loop."""
        self.limits.check_prompt_chars(self.backend.max_model_len, [p for p in prompts if isinstance(p, str)], "prompt")
        encode = self.backend.tokenizer.encode
        return await off_loop(lambda: [encode(p) if isinstance(p, str) else p for p in prompts])

    async def _run(self, request: Request, rid: str, reqs: list[GenerateRequest], stream: bool,
                   respond: Callable[[list[RequestOutput]], dict],
                   chunks: Callable[[Fanout, RequestTimer, asyncio.Future | None], AsyncIterator[str]],
                   received: float):
        timer = RequestTimer(self.trace_requests, self.backend.model_name)
        timer.num_prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
        timer.arrival = received  # the timeline starts when the handler did, before tokenizing
        # Each (prompt, choice) its own Serve request: children sharing one stall Serve's router.
        fanout = Fanout(SeparateServeRequests(self.backend), reqs, self.request_timeout_s)
        try:
            if stream:
                # Errors before the first tokens (a full queue, a bad prompt) keep their status code; a
                # request still queued after sse_keepalive_s starts its stream with keep-alive comments.
                first = asyncio.ensure_future(fanout.started())
                try:
                    await run_unless_disconnected(request, asyncio.wait({first}, timeout=self.sse_keepalive_s))
                except BaseException:
                    first.cancel()
                    raise
                if first.done():
                    first.result()
                response = SSEResponse(chunks(fanout, timer, None if first.done() else first))
                fanout = None  # the stream owns it now
                return response
            outs = await run_unless_disconnected(request, fanout.final_outputs(timer.output))
            timer.finish("ok")
            return JSONResponse(respond(outs))
        except ClientGone:
            timer.finish("cancelled")
            return JSONResponse({}, status_code=499)
        except asyncio.CancelledError:
            timer.finish("cancelled")
            raise
        except Exception as e:
            err = public_error(e, rid)
            timer.finish(err.status_tag)
            return error_response(err)
        finally:
            if fanout is not None:
                await fanout.aclose()

    async def _sse_body(self, rid: str, fanout: Fanout, timer: RequestTimer,
                        chunk: Callable[[int, RequestOutput], dict | None],
                        final: Callable[[], dict | None], first: asyncio.Future | None = None) -> AsyncIterator[str]:
        """The SSE frames; `first`: the still-pending wait for every choice's first output, kept alive
        with comment lines until it is done."""
        status = "cancelled"
        try:
            while first is not None and not first.done():
                yield ": keep-alive\n\n"
                await asyncio.wait({first}, timeout=self.sse_keepalive_s)
            if first is not None:
                first.result()  # an error while queued: reported in-band below
            async for i, out in fanout:
                timer.output(out)
                obj = chunk(i, out)
                if obj is not None:
                    timer.sent()
                    yield _sse(obj)
            last = final()
            if last is not None:
                yield _sse(last)
            status = "ok"
            yield "data: [DONE]\n\n"
        except Exception as e:  # after the 200 went out: report in-band, as OpenAI and vLLM do
            err = public_error(e, rid)
            status = err.status_tag
            yield _sse(err.body())
            yield "data: [DONE]\n\n"
        finally:
            if first is not None:
                first.cancel()
            await fanout.aclose()
            timer.finish(status)

    # ---- /v1/completions ----
    async def completions(self, body: CompletionRequest, request: Request):
        rid, received = new_request_id("cmpl"), time.time()
        try:
            body.check()
            await self.check_ready()
            params.check_model(self.backend, body.model)
            raw = body.prompts()
            prompts = await self._encode(raw)
            fields = {**body.sampling_fields(), "logprobs": body.logprobs}
            reqs = self._requests(rid, prompts, body.n, body.max_tokens, body.priority, fields, "prompt",
                                  max_tokens_given="max_tokens" in body.model_fields_set)
        except Exception as e:
            return self._refuse(e, rid)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.backend.model_name}
        n_logprobs = body.logprobs
        echo = _Echo(self, body, raw, reqs)

        def respond(outs: list[RequestOutput]) -> dict:
            choices = []
            for i, o in enumerate(outs):
                lp = None if n_logprobs is None else completion_logprobs(o.token_ids, o.logprobs, n_logprobs, self.token_text)
                text, lp = echo.prefixed(i, o, o.text, lp)
                choices.append({"index": i, "text": text, "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
                                "logprobs": lp, **echo.prompt_logprobs_field(i, o)})
            return {**head, "choices": choices, "usage": self._usage(reqs, outs, body.n)}

        sent_chars = [0] * len(reqs)
        use = StreamUsage(reqs, body.n, body.include_usage, body.continuous_usage)
        echoed: set[int] = set()

        def chunk(i: int, out: RequestOutput) -> dict | None:
            use.update(i, out)
            first = i not in echoed
            if not first and not out.new_text and not out.finished and (n_logprobs is None or not out.new_token_ids):
                return None  # text held back (a partial character or a possible stop string): nothing to send
            echoed.add(i)
            lp = None
            if n_logprobs is not None:
                lp = completion_logprobs(out.new_token_ids, delta_logprobs(out), n_logprobs, self.token_text, sent_chars[i])
            text, extra = out.new_text, {}
            if first:  # the prompt (echo) and prompt logprobs go with each choice's first chunk
                text, lp = echo.prefixed(i, out, text, lp)
                extra = echo.prompt_logprobs_field(i, out)
            sent_chars[i] += len(text)
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason,
                      "stop_reason": out.stop_reason, **extra}
            return {**head, "choices": [choice], **use.on_chunk()}

        return await self._run(request, rid, reqs, body.stream, respond,
                               lambda f, t, w: self._sse_body(rid, f, t, chunk, lambda: use.closing(head), w), received)

    # ---- /v1/chat/completions ----
    def _chat_prompt(self, body: ChatCompletionRequest, messages: list[dict[str, str]]) -> list[int]:
        """The chat template applied and tokenized (runs on the text thread pool)."""
        tok = self.backend.tokenizer
        if not getattr(tok, "chat_template", None):
            raise bad_request(f"the model `{self.backend.model_name}` has no chat template; use /v1/completions", "messages")
        tools = body.template_tools()
        if tools and "tools" not in str(tok.chat_template):  # it would drop them silently: the model never sees them
            raise bad_request(f"the chat template of `{self.backend.model_name}` does not render tools", "tools")
        try:
            ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False, **body.template_kwargs())
        except Exception as e:  # a template error is the request's fault (roles, content it rejects)
            raise bad_request(f"the chat template failed on these messages: {e}", "messages") from None
        return list(ids)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        rid, received = new_request_id("chatcmpl"), time.time()
        try:
            body.check()
            await self.check_ready()
            params.check_model(self.backend, body.model)
            messages = [m.as_template_input() for m in body.messages]
            self.limits.check_prompt_chars(self.backend.max_model_len, [m["content"] for m in messages], "messages")
            prompt = await off_loop(self._chat_prompt, body, messages)
            fields = {**body.sampling_fields(), "logprobs": body.num_logprobs}
            reqs = self._requests(rid, [prompt], body.n, body.output_limit, body.priority, fields, "messages",
                                  aliases={"logprobs": "top_logprobs"}, max_tokens_given=body.output_limit is not None)
        except Exception as e:
            return self._refuse(e, rid)
        created, model = int(time.time()), self.backend.model_name
        n_logprobs = body.num_logprobs
        parser = parser_for(getattr(self.backend.tokenizer, "chat_template", None), self.tool_call_parser)

        def respond(outs: list[RequestOutput]) -> dict:
            choices = [{"index": i, **_reply_message(body, parser, o), "stop_reason": o.stop_reason,
                        "logprobs": None if n_logprobs is None else chat_logprobs(o.token_ids, o.logprobs, n_logprobs, self.token_text)}
                       for i, o in enumerate(outs)]
            extra = {} if body.prompt_logprobs is None else {  # vLLM's: on the response, for the (one) prompt
                "prompt_logprobs": vllm_prompt_logprobs(reqs[0].prompt_token_ids, outs[0].prompt_logprobs,
                                                        body.prompt_logprobs, self.token_text)}
            return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                    "usage": self._usage(reqs, outs, body.n), **extra}

        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        started: set[int] = set()
        use = StreamUsage(reqs, body.n, body.include_usage, body.continuous_usage)
        tool_streams = {i: parser.stream() for i in range(len(reqs))} if body.parse_tools else {}
        named = body.named_tool.name if body.named_tool is not None else None
        forced = {i: ForcedStream(named) for i in range(len(reqs))} if body.forced_tool_schema() is not None else {}

        def chunk(i: int, out: RequestOutput) -> dict | None:
            use.update(i, out)
            delta: dict[str, Any] = {}
            if i not in started:  # OpenAI opens each choice with the role
                started.add(i)
                delta["role"] = "assistant"
            finish = out.finish_reason
            if i in tool_streams:
                finish = _tool_delta(tool_streams[i], out, body.parallel_tool_calls is not False, delta)
            elif i in forced:
                finish = _forced_delta(forced[i], out, delta)
            elif out.new_text:
                delta["content"] = out.new_text
            if not delta and not out.finished and (n_logprobs is None or not out.new_token_ids):
                return None
            lp = None
            if n_logprobs is not None:
                lp = chat_logprobs(out.new_token_ids, delta_logprobs(out), n_logprobs, self.token_text)
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {**head, "choices": [choice], **use.on_chunk()}

        return await self._run(request, rid, reqs, body.stream, respond,
                               lambda f, t, w: self._sse_body(rid, f, t, chunk, lambda: use.closing(head), w), received)

    @staticmethod
    def _usage(reqs: list[GenerateRequest], outs: list[RequestOutput], n: int) -> dict:
        # A prompt counts once however many choices it has, as OpenAI bills it.
        prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs[::n])
        cached = sum(o.num_cached_tokens for o in outs[::n])
        return usage(prompt_tokens, sum(len(o.token_ids) for o in outs), cached)

    # ---- /tokenize, /detokenize (vLLM's) ----
    async def tokenize(self, body: TokenizeRequest) -> dict:
        body.check()
        params.check_model(self.backend, body.model)
        tok = self.backend.tokenizer
        if body.messages is not None:
            chat = body.as_chat()
            messages = [m.as_template_input() for m in chat.messages]
            self.limits.check_prompt_chars(self.backend.max_model_len, [m["content"] for m in messages], "messages")
            ids = await off_loop(self._chat_prompt, chat, messages)
        else:
            self.limits.check_prompt_chars(self.backend.max_model_len, [body.prompt], "prompt")
            special = body.add_special_tokens is not False
            ids = await off_loop(lambda: tok.encode(body.prompt, add_special_tokens=special))
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.backend.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        params.check_model(self.backend, body.model)
        bad = [t for t in body.tokens if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {self.backend.vocab_size})", "tokens")
        return {"prompt": await off_loop(self.backend.tokenizer.decode, body.tokens)}

    # ---- /v1/models ----
    def model_card(self) -> dict:
        return {"id": self.backend.model_name, "object": "model", "created": self.created, "owned_by": "tandem",
                "max_model_len": self.backend.max_model_len}


class _Echo:
    """Completions' `echo` (the prompt before the completion, with its logprobs when logprobs are asked
    for) and vLLM's `prompt_logprobs` field, per choice i (prompt i // n)."""

    def __init__(self, server: OpenAIServer, body: CompletionRequest, raw: list[str | list[int]], reqs: list[GenerateRequest]):
        self.server, self.body, self.raw, self.reqs = server, body, raw, reqs

    def _prompt_lps(self, out: RequestOutput) -> list:
        if out.prompt_logprobs is None:  # a deployment whose prefill side does not return them
            raise ApiError(501, "prompt logprobs were not returned by the replica that ran this prompt",
                           param="prompt_logprobs", code="not_implemented")
        return out.prompt_logprobs

    def prefixed(self, i: int, out: RequestOutput, text: str, lp: dict | None) -> tuple[str, dict | None]:
        if not self.body.echo:
            return text, lp
        p = self.raw[i // self.body.n]
        prompt_text = p if isinstance(p, str) else self.server.backend.tokenizer.decode(p)
        if lp is not None:
            ids = self.reqs[i].prompt_token_ids
            lp = joined_logprobs(echo_logprobs(ids, self._prompt_lps(out), self.body.logprobs, self.server.token_text), lp)
        return prompt_text + text, lp

    def prompt_logprobs_field(self, i: int, out: RequestOutput) -> dict[str, Any]:
        n = self.body.prompt_logprobs
        if n is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(self.reqs[i].prompt_token_ids, self._prompt_lps(out), n,
                                                        self.server.token_text)}


def _reply_message(body: ChatCompletionRequest, parser: ToolParser, out: RequestOutput) -> dict[str, Any]:
    """A finished choice's message and finish_reason; with tools, calls in the text become tool_calls
    (finish_reason "tool_calls", as vLLM reports it) and the text before them the content. A forced
    call (tool_choice named: finish_reason stays "stop", as OpenAI and vLLM report it; "required":
    "tool_calls") is the grammar-made JSON read as calls."""
    if body.forced_tool_schema() is not None:
        named = body.named_tool.name if body.named_tool is not None else None
        calls = forced_calls(out.text, named)
        if calls:
            finish = out.finish_reason if named is not None else "tool_calls"
            return {"message": {"role": "assistant", "content": None, "tool_calls": calls}, "finish_reason": finish}
    if body.parse_tools:
        content, calls = parser.parse(out.text)
        if calls:
            calls = calls if body.parallel_tool_calls is not False else calls[:1]
            return {"message": {"role": "assistant", "content": content, "tool_calls": calls}, "finish_reason": "tool_calls"}
    return {"message": {"role": "assistant", "content": out.text}, "finish_reason": out.finish_reason}


def _forced_delta(stream: ForcedStream, out: RequestOutput, delta: dict[str, Any]) -> str | None:
    """A streamed forced tool call: its tool_calls delta entries; "required" ends with "tool_calls"."""
    entries = stream.feed(out.new_text, final=out.finished)
    if entries:
        delta["tool_calls"] = entries
    if out.finished and stream.named is None and stream.calls:
        return "tool_calls"
    if out.finished and not stream.calls and stream.text:  # cut off before the JSON closed: the text as it is
        delta["content"] = stream.text
    return out.finish_reason


def _tool_delta(stream: ToolStream, out: RequestOutput, parallel: bool, delta: dict[str, Any]) -> str | None:
    """Feed one streamed output through the choice's tool-call parser: its text into delta["content"],
    its tool_calls entries (a call's index, id and name first, its arguments whole or in fragments
    after, as the parser reads them) into delta["tool_calls"]; returns the chunk's finish_reason
    ("tool_calls" at the end of a reply that made calls)."""
    text, entries = stream.step(out.new_text, final=out.finished)
    if text:
        delta["content"] = text
    entries = entries if parallel else [e for e in entries if e["index"] == 0]
    if entries:
        delta["tool_calls"] = entries
    if out.finished and stream.calls:
        return "tool_calls"
    return out.finish_reason


def _version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:  # run from a checkout without `pip install -e .`
        return "unknown"


def _validation_error(e: RequestValidationError) -> ApiError:
    """FastAPI's 422 as OpenAI's 400, naming the client's parameter."""
    err = (e.errors() or [{}])[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None  # a union reports the branch it tried (prompt.list[int].0): name the field
    kind, msg = err.get("type"), err.get("msg", "invalid request")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {'.'.join(loc)}", param)
    if kind == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {err.get('ctx', {}).get('error', msg)}")
    if not loc:
        return bad_request(f"the request body is invalid: {msg}")
    return bad_request(f"{'.'.join(loc)}: {msg}", param)


def create_openai_app(backend: Backend, api_keys: Iterable[str] = (), request_timeout_s: float | None = None,
                      limits: RequestLimits | None = None, trace_requests: bool = False,
                      sse_keepalive_s: float = 5.0, tool_call_parser: str = "auto") -> FastAPI:
    """The FastAPI app; wrap-free: API keys, the body-size limit and X-Request-Id are ASGI middlewares added here.
    `tool_call_parser` (vLLM's --tool-call-parser): "hermes", "llama3_json", or "auto" = by the chat template."""
    server = OpenAIServer(backend, request_timeout_s, limits, trace_requests, sse_keepalive_s, tool_call_parser)
    app = FastAPI(title="Tandem", description="OpenAI-compatible LLM inference", docs_url="/docs")
    app.state.server = server
    # Added last = runs first: the key is checked before the body is read or measured.
    app.add_middleware(BodySizeLimit, limits=server.limits)
    app.add_middleware(ApiKeyAuth, api_keys=list(api_keys))
    app.add_middleware(RequestIdHeader)  # outermost: refusals (401, 413) carry the id too

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        err = _validation_error(e)
        REQUESTS.inc(1, tags={"status": err.status_tag, "model_name": backend.model_name})  # a malformed body counts too
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        return error_response(public_error(e, new_request_id("err")))

    @app.get("/health")
    async def health():
        ok = await backend.ready()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        """The Tandem metrics of every live replica of this Serve application (the pools' included), or of
        this process outside Serve (router/replica_metrics.py), so a scraper needs only the API port.
        Off the event loop: it reads Ray's KV."""
        body, content_type = await asyncio.to_thread(application_page)
        return PlainTextResponse(body, media_type=content_type)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await server.detokenize(body)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        params.check_model(backend, model)
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat_completions(body, request)

    return app
