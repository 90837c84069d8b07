"""The fused MoE kernels (parallel/kernels/fused_moe.py) on CPU through Triton's interpreter (in a
subprocess: TRITON_INTERPRET=1 must be set before the kernels are defined): plain weights, and e4m3
experts with block-wise (K blocks smaller than the kernel's K tile) and per-row scales, equal to the
expert loop of workers/models/moe.py on the same weights. Some pairs go to experts of another EP rank."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
from parallel.kernels.fused_moe import fused_moe
from parallel.state import Group
from workers.models.moe import Experts

torch.manual_seed(0)
T, H, I, E, TOP = 7, 64, 64, 6, 2
x = torch.randn(T, H)
ids = torch.randint(0, E, (T, TOP))
weights = torch.softmax(torch.randn(T, TOP), -1)
checked = 0
for block in (False, (16, 16), (32, 64), None):  # plain; block-wise; block-wise, K tile = 64; per row
    for local in (range(E), range(2, 5)):  # every expert here; EP: experts 2-4 of 6
        ex = Experts(E, H, I, group=Group(), local_experts=local, fp8_block=block)
        for w in (ex.w13, ex.w2):
            w.data.copy_((torch.randn(w.shape) * (100 if block is not False else 0.05)).to(w.dtype))
        if block is not False:
            for s in (ex.w13_scale, ex.w2_scale):
                s.data.copy_(torch.rand(s.shape) * 1e-3 + 1e-4)
        want = ex(x, ids, weights)  # the expert loop (CPU tensors)
        scales = (ex.w13_scale, ex.w13_block, ex.w2_scale, ex.w2_block) if block is not False else None
        got = fused_moe(x, ex.w13, ex.w2, ids, weights, local.start, E, scales)
        err = (got - want).abs().max().item()
        assert err < 1e-4 * max(1.0, want.abs().max().item()), (block, local, err)
        assert want.abs().max() > 0
        checked += 1
print("ok", checked)
'''


@pytest.mark.interpreted(SCRIPT, timeout=600)
def test_fused_moe_plain_and_fp8_in_the_triton_interpreter():
    assert run_interpreted(SCRIPT).strip().endswith("ok 8")
