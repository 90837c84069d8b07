"""parallel/kernels/direct_launch.py off the GPU: a kept handle is used only under its own key, a key of None always
takes the JIT path, the cache empties when full, and integer arguments are classed at least as finely as Triton
types them (its typing changes at 2**31, 2**32 and 2**63)."""
from __future__ import annotations

from parallel.kernels.direct_launch import Handles, int_kind


class _Compiled:
    """Stands in for a CompiledKernel: `kernel[grid](*args)` records the launch; the first form it is called in
    with constexprs raises TypeError when `runtime_only` (a Triton whose launcher takes the runtime arguments only)."""

    def __init__(self, runtime_only: bool = False):
        self.runtime_only, self.launches = runtime_only, []

    def run(self, *a):  # the attribute Handles checks for
        raise AssertionError("not called directly")

    def __getitem__(self, grid):
        def runner(*args):
            if self.runtime_only and len(args) > 2:
                raise TypeError("too many arguments")
            self.launches.append((grid, args))
        return runner


def test_a_handle_is_reused_only_under_its_key():
    handles, jit_calls = Handles(limit=2), []
    compiled = {"a": _Compiled(), "b": _Compiled(runtime_only=True)}

    def jit(name):
        return lambda: jit_calls.append(name) or compiled[name]

    handles.launch("a", jit("a"), (4,), (1, 2), (True,))
    handles.launch("a", jit("a"), (5, 2), (3, 4), (True,))
    assert jit_calls == ["a"] and compiled["a"].launches == [((5, 2, 1), (3, 4, True))]
    handles.launch("b", jit("b"), (1,), (7, 8), (False,))
    handles.launch("b", jit("b"), (1,), (7, 8), (False,))
    handles.launch("b", jit("b"), (2,), (9, 9), (False,))
    assert jit_calls == ["a", "b"] and compiled["b"].launches == [((1, 1, 1), (7, 8)), ((2, 1, 1), (9, 9))]
    handles.launch(None, jit("a"), (1,), (0, 0), (True,))
    handles.launch(None, jit("a"), (1,), (0, 0), (True,))
    assert jit_calls == ["a", "b", "a", "a"] and len(handles) == 2
    handles.launch("c", jit("a"), (1,), (0, 0), (True,))  # full: emptied, then c kept
    assert len(handles) == 1


def test_integer_classes_split_where_triton_types_change():
    edges = [-(1 << 63), -(1 << 31) - 1, -(1 << 31), 0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
             (1 << 63) - 1, 1 << 63]
    kinds = [int_kind(v) for v in edges]
    assert kinds == [2, 2, 0, 0, 0, 0, 1, 1, 2, 2, 3]
