"""The batch-1 W4A16 GEMV (parallel/kernels/gemv_w4.py) on CPU through Triton's interpreter.

Weights in tinygemm's layout built with the plain-torch model of `_convert_weight_to_int4pack` (tinygemm.py), random
codes, scales and zero points; bf16 activations. Checked against x @ the dequantized weight in fp32: through split K
(fp32 partial sums, no bf16 rounding) within 1e-5 of the output's magnitude (the 256 + c offsets cancel to ~1e-6), and
the bf16 output within one bf16 step of each value (the interpreter truncates to bf16 where the GPU rounds to nearest).
One or two steps prefetched by hand, Triton's pipeline, masked rows (N not a multiple of BLOCK_N) and
masked chunks (K not a multiple of the step), group sizes 128 and 256; the tensor-core kernel (MMA) too. No inline
assembly, so the interpreter runs the code the GPU compiles, except that the tensor-core kernel's dot takes fp32
operands there (Triton's interpreter multiplies bf16 dot operands as raw bits; the values, 128 + q and bf16 x, are the
same); compiled runs: tests/gpu/test_gemv_w4.py and scripts/bench_gemv_w4.py.
"""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
from parallel.kernels import gemv_w4 as w4
from parallel.quant import tinygemm as tg

torch.manual_seed(0)


def layer(n, k, gs):
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scales = torch.rand(n, k // gs) * 0.02 + 0.01
    zeros = torch.randint(0, 16, (n, k // gs)).float()
    packed = tg.int4pack_reference(tg.to_uint8_pairs(codes), 8)
    sz = tg.scales_and_zeros(scales, zeros, gs, gs)
    return packed, sz, tg.dequantize_int4pack_reference(packed, sz, gs)


checked = 0
for n, k, gs, cfg in (
        (24, 512, 128, dict(BLOCK_N=8, C=4, num_warps=1, PREFETCH=1)),                    # 4 steps, one prefetched
        (40, 640, 128, dict(BLOCK_N=16, C=8, num_warps=1, PREFETCH=1)),                   # masked rows and chunks
        (40, 640, 128, dict(BLOCK_N=16, C=8, num_warps=1, PREFETCH=2)),                   # two prefetched
        (24, 1024, 256, dict(BLOCK_N=8, C=16, num_warps=1, PREFETCH=2)),                  # group 256
        (40, 640, 128, dict(BLOCK_N=16, C=8, num_warps=1, PREFETCH=0, NUM_STAGES=3)),     # Triton's pipeliner
        (24, 512, 128, dict(BLOCK_N=8, C=16, num_warps=1, PREFETCH=0)),
        (16, 256, 128, dict(BLOCK_N=8, C=8, num_warps=1, PREFETCH=2)),                    # one step
        (64, 512, 128, dict(MMA=True, BLOCK_N=64, G=2, num_warps=4, NUM_STAGES=2)),       # tensor cores, 2 steps
        (32, 1024, 256, dict(MMA=True, BLOCK_N=16, G=4, num_warps=1, NUM_STAGES=1))):     # tensor cores, group 256
    packed, sz, deq = layer(n, k, gs)
    x = torch.randn(1, k).bfloat16()
    want = x.float() @ deq.t()
    scale = want.abs().max()
    y = w4.gemv_w4(x, packed, sz, gs, n, cfg).float()
    step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)  # one bf16 step at each value
    assert ((y - want).abs() <= step + 1e-5 * scale).all(), (n, k, gs, cfg, (y - want).abs().max())
    steps = k // (128 * cfg["G"]) if cfg.get("MMA") else -(-(k // 32) // cfg["C"])
    for split in (2, 4):
        if steps % split == 0:
            yf = torch.zeros(n)
            w4.gemv_w4(x, packed, sz, gs, n, {**cfg, "SPLIT_K": split}, out_fp32=yf)
            err = ((yf - want[0]).abs().max() / scale).item()
            assert err < 1e-5, (n, k, gs, cfg, split, err)
            checked += 1
    checked += 1
# the layer's batch-1 path (Int4PackWeight.apply with a tile chosen at load), act order's permuted inputs included
packed, sz, deq = layer(32, 512, 128)
perm = torch.randperm(512)
lw = tg.Int4PackWeight(packed, sz, 128, 8, 32, 512, perm=perm, w4_config=dict(BLOCK_N=8, C=4, num_warps=1))
x = torch.randn(1, 512).bfloat16()
bias = torch.randn(32).bfloat16()
want = x.float() @ lw.dequantize().t()  # dequantize() is in the layer's input order
y = lw.apply(x, bias)
assert torch.equal(y, w4.gemv_w4(x[:, perm], packed, sz, 128, 32, lw.w4_config) + bias)
assert ((y.float() - bias.float() - want).abs().max() / want.abs().max()).item() < 2e-2
checked += 1
assert w4.fits(4096, 4096, 128, 8) is None and w4.fits(4096, 4096, 64, 8) and w4.fits(4096, 4096, 128, 4)
print("ok", checked)
'''


@pytest.mark.interpreted(SCRIPT, timeout=900)
def test_w4_gemv_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT).strip()
    assert out.startswith("ok") and int(out.split()[-1]) >= 10, out
