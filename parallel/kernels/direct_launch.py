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
