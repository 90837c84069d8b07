"""Triton's own hook calls reach the compile watch: once armed, a new specialisation of a kernel (an
integer argument that now divides by 16) counts as one compile while serving, a launch of a known
variant counts nothing."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel.kernels import compile_watch


@triton.jit
def _fill_kernel(out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, offs.to(tl.float32), mask=offs < n)


def test_a_new_specialisation_after_arming_is_counted_once():
    assert compile_watch.install()
    out = torch.empty(64, device="cuda")
    _fill_kernel[(1,)](out, 7, BLOCK=64)  # before arming: start-up's compile
    compile_watch.arm()
    try:
        before = compile_watch.compiles_while_armed()
        _fill_kernel[(1,)](out, 9, BLOCK=64)  # the same variant as n=7
        assert compile_watch.compiles_while_armed() == before
        _fill_kernel[(1,)](out, 32, BLOCK=64)  # n % 16 == 0: Triton specialises on it
        torch.cuda.synchronize()
        assert compile_watch.compiles_while_armed() == before + 1
        assert out[:32].tolist() == [float(i) for i in range(32)]
    finally:
        compile_watch.disarm()
