"""The FP8 tiles of the fused batch-1 GEMV that sum each 8- or 16-byte chunk in the thread (gemv_quant's RED tiles,
`_fp8_red_tile`), on CPU through Triton's interpreter, for per-channel and block-wise (16 x 128) scales: the plain
product with bias, and each fused prologue / epilogue against `gemv.gemv` on the dequantized weight (RMSNorm +
RoPE, RMSNorm + SiLU-and-mul, residual add), with one, several and a ragged number of programs and K steps, with and without the next step's codes loaded
during the current one (PREFETCH). Also
`FP8_TABLE`: an entry for a shape is what `fused_gemv.tune` returns for it, and one that does not fit K is not."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
import torch.nn.functional as F
from parallel.kernels import gemv as gv
from parallel.kernels import gemv_quant as gq
from parallel.quant import fused_gemv
from parallel.quant.packed import from_fp8
from parallel.quant.rtn import Options, quantize

torch.manual_seed(0)
K = 1024


def weights(n):
    t, deq = quantize(torch.randn(n, K) * 0.05, Options("fp8", fp8_scale="channel"))
    yield "channel", fused_gemv.view(from_fp8(t["weight"], t["weight_scale"], K, True)), deq
    t, deq = quantize(torch.randn(n, K) * 0.05, Options("fp8", block=(16, 128)))
    yield "block", fused_gemv.view(from_fp8(t["weight"], t["weight_scale_inv"].repeat_interleave(16, 0), 128, False)), deq


def check(got, want, what, tol=2e-4):
    err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
    assert err < tol, (what, err)


TILES = [dict(BLOCK_N=bn, KS=ks, num_warps=w, num_stages=1, BLOCK_C=c, RED=True)
         for bn, ks, w, c in ((4, 128, 4, 8), (2, 32, 2, 8), (8, 16, 2, 16), (16, 64, 4, 16), (1, 16, 1, 8))]
# PREFETCH (codes of the next K step loaded during this one) over 1, 2 and 4 steps (T = 1 loads step 0 twice)
TILES += [dict(BLOCK_N=bn, KS=ks, num_warps=w, num_stages=1, BLOCK_C=c, RED=True, PREFETCH=True)
          for bn, ks, w, c in ((4, 128, 4, 8), (2, 64, 2, 8), (2, 32, 2, 8), (8, 16, 2, 16))]
HD = 16
h, nw = torch.randn(1, K) * 3, torch.rand(K) + 0.5
ang = torch.rand(8, 1, HD // 2) * 6
cs = torch.cat([torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)], 1).contiguous()
rope = gv.Rope(torch.tensor([3]), cs, HD, 2 * HD)
checked = 0
for cfg in TILES:
    for scale, qw, deq in weights(40):  # 40 rows: the last program of 16 or 32 rows is masked
        x, b, r = torch.randn(1, K), torch.randn(40), torch.randn(1, 40)
        check(gq.qgemv(x, qw, b, cfg), x @ deq.t() + b, (scale, cfg, "plain"))
        check(gq.qgemv(x, qw, b, cfg, residual=r), gv.gemv(x, deq, b, residual=r), (scale, cfg, "residual"))
        checked += 2
    for scale, qw, deq in weights(3 * HD):
        b = torch.randn(3 * HD)
        check(gq.qgemv(h, qw, b, cfg, norm_weight=nw, eps=1e-5, rope=rope),
              gv.gemv(h, deq, b, norm_weight=nw, eps=1e-5, rope=rope), (scale, cfg, "norm+rope"))
        checked += 1
    for scale, qw, deq in weights(2 * 48):
        gate_up = gv.gemv(h, deq, None, norm_weight=nw, eps=1e-6)  # gemv's SiLU needs libdevice (not here)
        check(gq.qgemv(h, qw, None, cfg, norm_weight=nw, eps=1e-6, silu=True), F.silu(gate_up[:, :48]) * gate_up[:, 48:],
              (scale, cfg, "norm+silu"))
        checked += 1
_, qw, _ = next(weights(40))
try:
    gq.qgemv(torch.randn(1, K), qw, None, dict(BLOCK_N=4, KS=256, num_warps=4, num_stages=1, BLOCK_C=8, RED=True))
    raise SystemExit("a K step of 2048 inputs was taken for K = 1024")
except ValueError:
    pass
gq.FP8_TABLE[(40, K, "residual")] = dict(TILES[1])
gq.FP8_TABLE[(40, K, "paired")] = dict(BLOCK_N=4, KS=256, num_warps=4, num_stages=1, BLOCK_C=8, RED=True)  # 2048 > K
assert fused_gemv.tune(qw, torch.float32, "residual") == TILES[1]
assert gq.table_config(qw, "paired") is None
print("ok", checked)
'''


@pytest.mark.interpreted(SCRIPT, timeout=900)
def test_fp8_red_tiles_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT).strip()
    assert out == "ok 72", out
