"""The rows GEMV (parallel/kernels/gemv.py `gemv_rows`: x [M, K] with M = 2..16, each weight tile read
once for all rows) against torch on CPU, through Triton's interpreter (TRITON_INTERPRET=1, in a
subprocess since it must be set before the kernels are defined): several M, N, K, including N and K
that are not multiples of the tile, bias, a strided x, both inner products (FMA and tl.dot) and the
default tiles. fp32 and fp16 take every variant; bf16 only the FMA one, because the interpreter's
tl.dot multiplies bf16 operands as their raw 16-bit integers (numpy has no bf16). The compiled kernel,
in bf16 and under CUDA-graph capture through `parallel.matmul.linear`, is tested in
tests/gpu/test_gemv_rows.py."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
import torch.nn.functional as F
from parallel.kernels.gemv import gemv, gemv_rows, rows_tile_config

torch.manual_seed(0)
FMA = lambda bm: dict(BLOCK_M=bm, BLOCK_N=8, BLOCK_K=32, DOT=False, num_warps=4, num_stages=2)
DOT = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, DOT=True, num_warps=4, num_stages=2)
checked = 0
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for m, n, k in [(2, 48, 256), (3, 37, 200), (4, 64, 96), (8, 64, 512), (9, 40, 136), (16, 33, 300)]:
        x = torch.randn(m, 2 * k)[:, :k].to(dtype)  # strided rows: stride(0) = 2K
        w = (torch.randn(n, k) / k**0.5).to(dtype)
        b = torch.randn(n).to(dtype)
        want = F.linear(x.float(), w.float(), b.float())
        bm = 1 << (m - 1).bit_length()
        configs = [None, FMA(bm), FMA(16)] + ([DOT] if dtype != torch.bfloat16 else [])
        if dtype == torch.bfloat16 and rows_tile_config(m, n, k)["DOT"]:
            configs.remove(None)
        for cfg in configs:
            for bias in (b, None):
                y = gemv(x, w, bias, cfg)
                assert y.shape == (m, n) and y.dtype == dtype, (y.shape, y.dtype)
                ref = want if bias is not None else want - b.float()
                err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                assert err < tol, (dtype, m, n, k, cfg, err)
                checked += 1
try:
    gemv(torch.randn(2, 64), torch.randn(32, 64), norm_weight=torch.ones(64), eps=1e-5)
    raise AssertionError("a fused prologue took two rows")
except ValueError:
    pass
try:
    gemv_rows(torch.randn(9, 64), torch.randn(32, 64), config=FMA(8))
    raise AssertionError("9 rows ran in an 8-row tile")
except ValueError:
    pass
print("ok", checked)
'''


@pytest.mark.interpreted(SCRIPT, timeout=600)
def test_rows_gemv_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT).strip()
    assert out.startswith("ok") and int(out.split()[-1]) >= 90, out
