"""The compile watch (parallel/kernels/compile_watch.py) on Triton's real hook slots: once armed, each
variant Triton compiles is counted and logged with its kernel, specialisation and time; before arming,
and for explicit warm-ups, nothing is; hooks set before it still run and keep their say. Triton's own
calls of the hooks need a GPU: tests/gpu/test_compile_watch_gpu.py."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("triton")

from parallel.kernels import compile_watch  # noqa: E402


@pytest.fixture
def watch(monkeypatch):
    """A fresh watch on this process's Triton hook slots, put back as they were afterwards."""
    holder, before, after = compile_watch._hook_slots()
    for name in (before, after):
        monkeypatch.setattr(holder, name, getattr(holder, name))
    for name, value in (("_installed", False), ("_armed", False), ("_compiles_while_armed", 0), ("_started", {})):
        monkeypatch.setattr(compile_watch, name, value)
    return holder, before, after


def _triton_compiles(holder, before, after, key, warmup=False):
    """The two calls Triton makes around one compile (runtime/jit.py, `_do_compile`)."""
    kwargs = dict(key=key, repr=f"_demo_kernel[num_warps=4](n: i32, {key})", fn=SimpleNamespace(module="demo",
                  name="_demo_kernel"), compile={}, is_manual_warmup=warmup, already_compiled=False)
    skip = getattr(holder, before)(**kwargs)
    if not skip:
        getattr(holder, after)(**kwargs)
    return skip


def test_only_compiles_after_arming_are_counted_and_logged(watch, caplog):
    holder, before, after = watch
    assert compile_watch.install() and compile_watch.install()  # idempotent
    caplog.set_level(logging.WARNING, logger=compile_watch.__name__)
    _triton_compiles(*watch, key=("start-up",))
    assert compile_watch.compiles_while_armed() == 0 and not caplog.records
    compile_watch.arm()
    _triton_compiles(*watch, key=("serving", "D"))
    _triton_compiles(*watch, key=("explicit warm-up",), warmup=True)
    assert compile_watch.compiles_while_armed() == 1
    (record,) = caplog.records
    message = record.getMessage()
    assert "demo._demo_kernel" in message and "('serving', 'D')" in message and " s " in message
    compile_watch.disarm()
    _triton_compiles(*watch, key=("resizing",))
    assert compile_watch.compiles_while_armed() == 1 and len(caplog.records) == 1
    assert not compile_watch._started  # no miss is left waiting for its compile


def test_hooks_set_before_still_run_and_may_skip_the_compile(watch):
    holder, before, after = watch
    calls = []
    setattr(holder, before, lambda **kw: calls.append(("before", kw["key"])) or kw["key"] == ("cached elsewhere",))
    setattr(holder, after, lambda **kw: calls.append(("after", kw["key"])))
    compile_watch.install()
    compile_watch.arm()
    assert not _triton_compiles(*watch, key=("k",))
    assert _triton_compiles(*watch, key=("cached elsewhere",))  # their true answer: Triton skips the compile
    assert calls == [("before", ("k",)), ("after", ("k",)), ("before", ("cached elsewhere",))]
    assert compile_watch.compiles_while_armed() == 1
    assert not compile_watch._started

def test_a_paused_set_up_compiles_unlogged_and_leaves_the_watch_as_it_was(watch):
    assert compile_watch.install()
    compile_watch.arm()
    with compile_watch.paused():  # a KV transfer agent's copy kernels, compiled once its replica joins
        _triton_compiles(*watch, key=("kv set-up",))
    assert compile_watch.compiles_while_armed() == 0
    _triton_compiles(*watch, key=("serving",))
    assert compile_watch.compiles_while_armed() == 1  # armed again after
    compile_watch.disarm()
    with compile_watch.paused():
        pass
    _triton_compiles(*watch, key=("still start-up",))
    assert compile_watch.compiles_while_armed() == 1  # not armed by the pause where it was not before
