"""Triton compiles that happen while serving, logged with their kernel and the time they took.

A Triton kernel compiles once per specialisation: its constexprs, and for plain integer and pointer
arguments whether they equal 1 or divide by 16. The model runner compiles the variants it knows of at
start-up (`ModelRunner._warm_up_kernels`); one it missed compiles inside the first step that needs it,
and every request in that step waits (0.3-2 s on an H100 host). Served runs have shown such one-off
stalls (a single 1.7 s TTFT among 50-70 ms ones) with nothing in the logs to say which kernel. Once the
runner is ready it calls `arm()`; from then on each compile is one WARNING line naming the kernel and
the argument types it was specialised on, which is what a `do_not_specialize` or a warm-up case fixes.

Triton calls `jit_cache_hook` before it compiles a variant missing from the process's cache (loading it
from the on-disk cache counts too: that is the short case) and `jit_post_compile_hook` after; both
receive the same `key`. Older Triton versions have the two as `JITFunction.cache_hook`/`compiled_hook`.
"""
from __future__ import annotations

import builtins
import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

_lock = threading.Lock()
_installed = False
_armed = False
_compiles_while_armed = 0
_started: dict[str, float] = {}  # repr(key) -> when its cache miss began (between the two hooks)


def _hook_slots() -> tuple[Any, str, str] | None:
    """The object holding Triton's two JIT hooks and their attribute names; None without Triton."""
    try:
        import triton
    except ImportError:
        return None
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is not None and hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook"):
        return runtime, "jit_cache_hook", "jit_post_compile_hook"
    from triton.runtime.jit import JITFunction

    if hasattr(JITFunction, "cache_hook") and hasattr(JITFunction, "compiled_hook"):
        return JITFunction, "cache_hook", "compiled_hook"
    return None


def install() -> bool:
    """Chain the watch after whatever hooks are set (they still run first, and their answer stands).
    Idempotent; False where this Triton has no hooks to attach to."""
    global _installed
    with _lock:
        if _installed:
            return True
        slots = _hook_slots()
        if slots is None:
            return False
        holder, before_name, after_name = slots
        setattr(holder, before_name, _chained(_before_compile, getattr(holder, before_name)))
        setattr(holder, after_name, _chained(_after_compile, getattr(holder, after_name)))
        _installed = True
        return True


def _chained(ours: Callable[..., None], theirs: Callable[..., Any] | None) -> Callable[..., Any]:
    def hook(*args: Any, **kwargs: Any) -> Any:
        answer = theirs(*args, **kwargs) if theirs is not None else None
        if not answer:  # a true answer from the cache hook means Triton compiles nothing
            ours(**kwargs)
        return answer

    return hook


def arm() -> None:
    """From now on, log each compile: start-up is over."""
    global _armed
    _armed = True


def disarm() -> None:
    global _armed
    _armed = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Set-up that compiles after the runner armed the watch (a KV transfer agent's copy kernels, made once its
    replica joins a pool): not a compile while serving. Armed again after, if it was."""
    global _armed
    was, _armed = _armed, False
    try:
        yield
    finally:
        _armed = was or _armed


def compiles_while_armed() -> int:
    """Variants compiled (or loaded from disk) since `arm()`, in this process."""
    return _compiles_while_armed


def _before_compile(*, key: Any = None, is_manual_warmup: bool = False, **_: Any) -> None:
    if _armed and not is_manual_warmup:
        _started[repr(key)] = time.perf_counter()


def _after_compile(*, key: Any = None, repr: str = "", fn: Any = None, is_manual_warmup: bool = False,
                   **_: Any) -> None:
    global _compiles_while_armed
    began = _started.pop(builtins.repr(key), None)  # `repr` here is Triton's text
    if not _armed or is_manual_warmup or began is None:
        return
    with _lock:
        _compiles_while_armed += 1
    where = f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}"
    log.warning("Triton compiled a kernel variant while serving, in %.2f s (the step waited for it): %s, "
                "specialised as %s", time.perf_counter() - began, where, repr)

