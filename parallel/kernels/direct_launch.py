"""Launching a compiled Triton kernel again through its handle, skipping the JIT's per-launch work.

`jit_fn[grid](*args, **constexprs)` binds the arguments, works out what Triton specialises them on, looks the
compiled kernel up in its cache and only then launches: 10-25 us of host time per launch on an H100 host
(scripts/bench_ring_launch.py: 39-57 us through the JIT path, 29 us through the handle, bitwise the same output).
That launch returns the `CompiledKernel`; calling it again (`kernel[grid](*args)`) goes straight to the launcher.
The caller keys the handles it keeps by every value Triton specialises on (or a finer key), so a handle is only
reused where the JIT would have picked the same compiled kernel: `Handles`.

Used by the KV handoff's row copy (parallel/kernels/block_copy.py) and the ring's scatter launches
(parallel/kernels/ring_attention_triton.py; its attention steps keep a launcher of their own, `_Runner`). Never under
TRITON_INTERPRET (there is no compiled kernel).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Hashable


def int_kind(v: int) -> int:
    """A class of integer values at least as fine as Triton's typing of an unspecialised int argument (i32, u32,
    i64, u64 by range), for a handle's key: values of one class always get the same argument type."""
    if -(1 << 31) <= v < (1 << 31):
        return 0
    if (1 << 31) <= v < (1 << 32):
        return 1
    return 2 if -(1 << 63) <= v < (1 << 63) else 3


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class Handle:
    """A compiled kernel called directly (`CompiledKernel[grid](...)`): no argument binding, specialisation or cache
    lookup. Its arguments are the kernel's in signature order with the constexprs, or, where a Triton's launcher
    wants only the runtime ones, without (`form`, found at the first call: a wrong count is a TypeError before
    anything launches)."""

    def __init__(self, kernel):
        self.kernel, self.with_constexprs = kernel, None

    def launch(self, grid: tuple[int, ...], args: tuple, const: tuple) -> None:
        run = self.kernel[(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)]
        if self.with_constexprs is None:
            try:
                run(*args, *const)
                self.with_constexprs = True
            except TypeError:
                run(*args)
                self.with_constexprs = False
        elif self.with_constexprs:
            run(*args, *const)
        else:
            run(*args)


class Handles:
    """Compiled kernels' handles by a caller's key (at most `limit`; all forgotten when full: keys may follow shapes).
    `launch(key, jit_launch, grid, args, const)`: through the handle under `key` if there is one, else through
    `jit_launch()` (the JIT path, which must return what `jit_fn[grid](...)` returns), keeping its kernel under `key`.
    key None: always the JIT path (a launch the caller cannot key)."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._handles: dict[Hashable, Handle] = {}

    def launch(self, key: Hashable | None, jit_launch: Callable[[], Any], grid: tuple[int, ...], args: tuple,
               const: tuple) -> None:
        hit = self._handles.get(key) if key is not None else None
        if hit is not None:
            hit.launch(grid, args, const)
            return
        kernel = jit_launch()
        if key is not None and hasattr(kernel, "run") and hasattr(kernel, "__getitem__"):
            if len(self._handles) >= self.limit:
                self._handles.clear()
            self._handles[key] = Handle(kernel)

    def clear(self) -> None:
        self._handles.clear()

    def __len__(self) -> int:
        return len(self._handles)


# ---- a step's launches, recorded in one layer and repeated in the others ----

_recording: list["Recorded"] | None = None  # set by `record_launches` while one layer's kernels launch
_COMPILE_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "launch_cooperative_grid"})


class Recorded:
    """One launch kept to be repeated: its compiled kernel, grid, runtime arguments and constexprs (in signature
    order), and `swaps`: (argument index, which value of `launch(values)` goes there) for the arguments that differ
    from one repetition to the next. Every other argument, integers and their alignment included, is the recorded
    one, so the compiled kernel is the one the JIT would pick whenever the swapped tensors keep the recorded ones'
    dtype and 16-byte alignment (the caller checks that)."""

    _handles: dict[int, Handle] = {}  # by id(kernel), each holding its kernel (so the id stays its own)

    def __init__(self, kernel, grid: tuple[int, ...], args: tuple, const: tuple,
                 relaunch: Callable[[tuple], Any] | None = None):
        handle = None
        if relaunch is None:
            handle = Recorded._handles.get(id(kernel))
            if handle is None:  # one per compiled kernel: it learns once whether the launcher takes the constexprs
                handle = Recorded._handles[id(kernel)] = Handle(kernel)
        self.handle, self.grid, self.args, self.const, self.relaunch = handle, grid, args, const, relaunch
        self.swaps: list[tuple[int, int]] = []

    def launch(self, values: tuple) -> None:
        args = list(self.args)
        for i, which in self.swaps:
            args[i] = values[which]
        if self.relaunch is not None:  # under TRITON_INTERPRET: through the JIT again (what CPU tests check)
            self.relaunch(tuple(args))
        else:
            self.handle.launch(self.grid, tuple(args), self.const)


def launch(jit_fn, grid: tuple[int, ...], *args, **kwargs):
    """`jit_fn[grid](*args, **kwargs)` (runtime arguments positional, constexprs and compile options by keyword),
    and, inside `record_launches`, the launch kept for repeating. Returns what the JIT returns."""
    kernel = jit_fn[grid](*args, **kwargs)
    if _recording is not None:
        const = {k: v for k, v in kwargs.items() if k not in _COMPILE_OPTIONS}
        names = getattr(jit_fn, "arg_names", None)
        if (names is None or len(args) + len(const) != len(names) or any(n not in const for n in names[len(args):])
                or not (interpreted() or hasattr(kernel, "__getitem__"))):
            _recording.append(None)  # cannot be repeated through its handle: the caller drops the whole record
        else:
            relaunch = (lambda a: jit_fn[grid](*a, **kwargs)) if interpreted() else None
            _recording.append(Recorded(kernel, grid, args, tuple(const[n] for n in names[len(args):]), relaunch))
    return kernel


class record_launches:
    """`with record_launches() as launches:` every `launch` inside is appended to `launches` (None for one that
    cannot be repeated). Not reentrant: one layer records at a time, on the thread that runs the step."""

    def __enter__(self) -> list:
        global _recording
        if _recording is not None:
            raise RuntimeError("record_launches is already recording")
        _recording = []
        return _recording

    def __exit__(self, *exc) -> None:
        global _recording
        _recording = None
