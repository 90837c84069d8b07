"""Helpers for the front-end tests: a tiny model with a chat template, a LocalBackend over it, and
waiting on (or slowing down) its engine."""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from pathlib import Path

from tests.models import BOS_TOKEN, EOS_TOKEN, build_model

# ChatML-like, in the tiny tokenizer's own special tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}" + BOS_TOKEN + "{{ m['role'] }}\n{{ m['content'] }}" + EOS_TOKEN + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + BOS_TOKEN + "assistant\n{% endif %}"
)

# Engine settings small enough for a shared 2-core machine.
ENGINE_KWARGS = dict(dtype="float32", device="cpu", num_gpu_blocks_override=96, block_size=16, max_num_batched_tokens=256)


def build_chat_model(path: str | os.PathLike, template: str = CHAT_TEMPLATE) -> str:
    """The tiny Llama of tests/models.py plus a chat template (max_model_len 256, vocab 300)."""
    folder = build_model("llama", path)
    Path(folder, "chat_template.jinja").write_text(template)
    return folder


def make_backend(model: str, **overrides):
    """A LocalBackend over `model` (AppConfig args as overrides, e.g. max_waiting_requests=1)."""
    from router.config import AppConfig
    from router.local_backend import LocalBackend

    return LocalBackend.from_config(AppConfig(model=model, colocated=True, **{**ENGINE_KWARGS, **overrides}))


IDLE_FIELDS = ("blocks_used", "running", "waiting")


def wait_idle(get_stats, timeout: float = 10.0, fields=IDLE_FIELDS, interval: float = 0.02) -> dict:
    """Poll `get_stats()` (engine stats) until every one of `fields` is 0; returns those stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = get_stats()
        if all(stats[f] == 0 for f in fields):
            return stats
        assert time.monotonic() < deadline, f"engine not idle: {stats}"
        time.sleep(interval)


def wait_for(pred, timeout: float = 20.0) -> None:
    """Poll `pred()` until true; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@contextlib.contextmanager
def slow_engine(backend, seconds_per_step: float = 0.01):
    """Each engine step of `backend` takes at least this long, so that long requests are still running
    when the test cancels or disconnects them (the tiny model would otherwise finish first)."""
    real_step = backend.llm_engine.step

    def slow_step():
        time.sleep(seconds_per_step)
        return real_step()

    backend.llm_engine.step = slow_step
    try:
        yield
    finally:
        del backend.llm_engine.step


class LiveServer:
    """An ASGI app under uvicorn in a daemon thread, on a free localhost port (real sockets:
    streaming, client disconnects, HTTP clients). `call(coro_fn)` runs a coroutine on its loop."""

    def __init__(self, app, start_timeout: float = 30.0):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    async def _serve(self):
        self.loop = asyncio.get_running_loop()
        await self.server.serve(sockets=[self.sock])

    def call(self, coro_fn, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout=timeout)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def shutdown_serve() -> None:
    """`serve.shutdown()`, the applications deleted first (tandem.serving.stop: their replicas stop together,
    not one deployment after another)."""
    from tandem.serving import stop

    stop()
