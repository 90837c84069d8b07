"""A step's attention launches recorded in its first layer and repeated by the others with their own KV cache
(workers/attention/triton_backend.py `LayerRepeat`, parallel/kernels/direct_launch.py `launch`).

Off the GPU: `launch` keeps a launch only where its handle can repeat it (runtime arguments positional, every
constexpr by keyword, a compiled kernel), and `LayerRepeat.of` refuses a record with an argument inside the cache
other than its K or V half. Through Triton's interpreter (the repeats go through the JIT there, with the swapped
arguments): three layers of a mixed step, a verification step and a decode step, each layer's q/k/v copied into
shared buffers as the piecewise graphs do, give every layer the same output and cache as launching it afresh, and
a layer with another output buffer launches afresh."""
from __future__ import annotations

import pytest
import torch

from parallel.kernels import direct_launch
from parallel.kernels.direct_launch import launch, record_launches
from tests.interpreter import run_interpreted
from workers.attention.triton_backend import LayerRepeat


class _Compiled:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class _Jit:
    """Stands in for a JITFunction: `fn[grid](*args, **kwargs)` returns its compiled kernel."""

    def __init__(self, arg_names, compiled=True):
        self.arg_names, self.compiled, self.kernel, self.calls = arg_names, compiled, _Compiled(), []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.kernel if self.compiled else None
        return run


def test_launch_keeps_only_what_its_handle_can_repeat(monkeypatch):
    monkeypatch.setattr(direct_launch, "interpreted", lambda: False)
    fn = _Jit(["a", "b", "X", "Y"])
    launch(fn, (3,), 1, 2, Y=5, X=4, num_warps=4)  # not recording: a plain launch
    assert len(fn.calls) == 1
    with record_launches() as kept:
        launch(fn, (3,), 1, 2, Y=5, X=4, num_warps=4, launch_pdl=False)
        launch(fn, (3,), 1, 2, X=4)  # a constexpr left to its default: the handle would not know it
        launch(_Jit(["a", "X"], compiled=False), (1,), 1, X=2)  # no compiled kernel to call again
    assert kept[0].const == (4, 5) and kept[0].args == (1, 2) and kept[1] is None and kept[2] is None
    with pytest.raises(RuntimeError):
        with record_launches():
            with record_launches():
                pass
    kept[0].swaps.append((1, 0))
    kept[0].launch(("swapped",))
    assert fn.kernel.launches[-1] == ((3, 1, 1), (1, "swapped", 4, 5))
    assert len(fn.calls) == 3  # the repeat did not go through the JIT


def test_layer_repeat_swaps_the_cache_halves_only(monkeypatch):
    monkeypatch.setattr(direct_launch, "interpreted", lambda: False)
    caches = torch.zeros(3, 2, 4, 16, 2, 8)
    fn = _Jit(["q", "k_cache", "v_cache", "tables", "n", "C"])
    q, tables = torch.zeros(5, 4, 8), torch.zeros(2, 3, dtype=torch.int32)
    with record_launches() as kept:
        launch(fn, (2,), q, caches[0][0], caches[0][1], tables, 7, C=1)
    repeat = LayerRepeat.of(kept, q, q, q, q, caches[0], 0.5)
    assert repeat is not None and kept[0].swaps == [(1, 0), (2, 1)]
    assert repeat.fits(q, q, q, q, caches[2], 0.5)
    assert not repeat.fits(q, q, q, torch.zeros(5, 4, 8), caches[2], 0.5)  # another output buffer
    assert not repeat.fits(q, q, q, q, caches[2], 0.25)
    assert not repeat.fits(q, q, q, q, caches[2][:, :2], 0.5)  # another cache shape
    repeat.launch(caches[2])
    grid, args = fn.kernel.launches[-1]
    assert args[1].data_ptr() == caches[2][0].data_ptr() and args[2].data_ptr() == caches[2][1].data_ptr()
    assert args[0] is q and args[3] is tables and args[4:] == (7, 1)
    with record_launches() as kept:  # the whole cache as one argument: no half to swap, so no repeat
        launch(fn, (2,), q, caches[0], caches[0][1], tables, 7, C=1)
    assert LayerRepeat.of(kept, q, q, q, q, caches[0], 0.5) is None
    with record_launches() as kept:
        launch(_Jit(["a"], compiled=False), (1,), q)
    assert LayerRepeat.of(kept, q, q, q, q, caches[0], 0.5) is None


SCRIPT = r'''
import torch
import workers.attention.triton_backend as tb
from workers.attention.backend import AttentionMetadata
from workers.attention.triton_backend import LayerRepeat, TritonAttention
from tests.paged_steps import paged_metadata

tb._on_gpu = lambda q: True  # the interpreter's tensors are on the CPU; the repeat is for GPUs
tb._capturing = lambda: False
D, PAGE, HQ, HKV, LAYERS = 16, 16, 8, 2, 3
g = torch.Generator().manual_seed(0)


def step(q_lens, ctx_lens, num_decodes):
    meta, nblocks = paged_metadata(q_lens, ctx_lens, PAGE, g)
    meta.num_decodes = num_decodes
    n = sum(q_lens)
    layers = [tuple(torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV)) for _ in range(LAYERS)]
    caches = torch.randn(LAYERS, 2, nblocks, PAGE, HKV, D, generator=g)
    return meta, layers, caches


def fresh(meta):
    return AttentionMetadata(**{f: getattr(meta, f) for f in ("slot_mapping", "query_start_loc", "seq_lens",
                             "block_tables", "query_lens_cpu", "seq_lens_cpu", "max_query_len", "max_seq_len",
                             "num_decodes")})


checked = 0
# a mixed step (decodes, then chunks past 16 tokens: write_kv and the prefill kernel), a verification step
# (the split-context kernel), a decode step (the decode kernel and its merge)
for q_lens, ctx_lens, d in (([1, 1, 20, 33], [70, 9, 100, 0], 2), ([3, 5, 2], [40, 130, 7], 0),
                            ([1, 1, 1], [200, 65, 3], 3)):
    meta, layers, caches = step(q_lens, ctx_lens, d)
    want_out, want_cache = [], caches.clone()
    for i, (q, k, v) in enumerate(layers):  # each layer launched afresh: the reference
        want_out.append(TritonAttention()._forward(q, k, v, want_cache[i], fresh(meta), 0.25, torch.empty_like(q)))
    q_buf, k_buf, v_buf = (torch.empty_like(x) for x in layers[0])
    out_buf = torch.empty_like(q_buf)
    backend, m, got = TritonAttention(), fresh(meta), caches.clone()
    for i, (q, k, v) in enumerate(layers):
        q_buf.copy_(q), k_buf.copy_(k), v_buf.copy_(v)
        backend.forward(q_buf, k_buf, v_buf, got[i], m, 0.25, out=out_buf)
        assert torch.equal(out_buf, want_out[i]), (q_lens, i, (out_buf - want_out[i]).abs().max().item())
    assert isinstance(m.derived["triton_repeat"], LayerRepeat), q_lens
    assert sum(len(r.swaps) for r in m.derived["triton_repeat"].launches) >= 2, q_lens  # a K and a V half at least
    assert torch.equal(got, want_cache), q_lens
    # another output buffer: launched afresh, still right
    other = torch.empty_like(out_buf)
    again = caches.clone()
    backend.forward(q_buf, k_buf, v_buf, again[LAYERS - 1], m, 0.25, out=other)
    assert torch.equal(other, want_out[LAYERS - 1]), q_lens
    checked += 1
print("ok", checked)
'''


@pytest.mark.interpreted(SCRIPT, timeout=600)
def test_repeated_layers_match_fresh_launches_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT).strip()
    assert out.startswith("ok") and int(out.split()[-1]) == 3, out
