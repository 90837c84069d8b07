"""The 4-bit batch-1 GEMV on tinygemm's layout (parallel/kernels/gemv_int4.py) on CPU through Triton's interpreter.

tests/test_gemv_quant_interpreted.py runs it through `gemv_quant.candidates` (fp32 activations, one or two K steps).
Here what that leaves out: bf16 activations with the RMSNorm prologue, where x and the norm weight are read as int32
pairs (`_x2` PAIRS) -- bitwise equal to the per-element path and, for SiLU / RoPE, to the bf16 fused GEMV on the
dequantized weight within bf16 rounding; many K steps (the next step's codes loaded before the current one is summed);
ragged N (masked rows); and every group size tinygemm has, with and without act order, against x @ the dequantized
weight in fp32 (the 256 + c / 16 + c offsets cancel to ~1e-6 of the output). The compiled kernels: tests/gpu/
and scripts/bench_gemv.py --int4 (every tile checked against tinygemm there).
"""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
import torch.nn.functional as F
from parallel.kernels import gemv as gv
from parallel.kernels import gemv_int4 as g4
from parallel.quant import fused_gemv, tinygemm as tg
from parallel.quant.gptq import unpack_int32
from parallel.quant.packed import from_int_codes
from parallel.quant.rtn import Options, quantize

torch.manual_seed(0)
K = 1024


def layer(n, gs, sym=True, act=False):
    """A GPTQ layer as load leaves it on CUDA (tinygemm's layout, built with the plain-torch model of the op), the
    fused GEMV's view of it, and its dequantized weight in input order."""
    o = Options("gptq", bits=4, group_size=gs, sym=sym, desc_act=act)
    t, _ = quantize(torch.randn(n, K) * 0.05, o, torch.randperm(K) if act else None)
    g = K if gs == -1 else gs
    pw = from_int_codes(unpack_int32(t["qweight"], 4, 0), unpack_int32(t["qzeros"], 4, 1) + 1, t["scales"].float(),
                        t["g_idx"].long(), 4, g)
    codes = tg.unpack_codes(pw.codes)
    tgs, ikt = tg.plan_shape(n, K, g)
    packed = tg.int4pack_reference(tg.to_uint8_pairs(codes), ikt)
    sz = tg.scales_and_zeros(pw.scales, pw.zeros, g, tgs)
    deq = tg.dequantize_int4pack_reference(packed, sz, tgs)
    if pw.perm is not None:
        deq = torch.empty_like(deq).index_copy_(1, pw.perm, deq)
    return fused_gemv.view(tg.Int4PackWeight(packed, sz, tgs, ikt, n, K, pw.perm)), deq


def rel(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


checked = 0
for gs, sym, act in ((32, False, True), (64, True, False), (128, False, False), (256, True, False), (-1, False, True)):
    qw, deq = layer(40, gs, sym, act)  # 40 rows: BLOCK_N 16 masks the last tile
    x = torch.randn(1, K)
    for cfg in (dict(BLOCK_N=16, KS=4, num_warps=1), dict(BLOCK_N=8, KS=32, num_warps=1)):  # 8 steps; one step
        err = rel(g4.qgemv4(x, qw, None, cfg), x @ deq.t())
        assert err < 2e-5, (gs, sym, act, cfg, err)
        xb = x.bfloat16()
        err = rel(g4.qgemv4(xb, qw, None, cfg), xb.float() @ deq.t())
        assert err < 1e-2, (gs, act, cfg, "bf16", err)
        checked += 2

HD = 16
h, nw = (torch.randn(1, K) * 3).bfloat16(), (torch.rand(K) + 0.5).bfloat16()
ang = torch.rand(8, 1, HD // 2) * 6
cs = torch.cat([torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)], 1).contiguous()
rope = gv.Rope(torch.tensor([5]), cs, HD, 2 * HD)
for gs in (64, 128):
    qw, deq = layer(3 * HD, gs)
    w16 = deq.bfloat16()
    cfg = dict(BLOCK_N=4, KS=8, num_warps=1)  # 4 steps
    pairs = g4.qgemv4(h, qw, None, cfg, norm_weight=nw, eps=1e-5, rope=rope)
    each = g4.qgemv4(h, qw, None, cfg, norm_weight=nw.float(), eps=1e-5, rope=rope)  # fp32 norm weight: per element
    assert torch.equal(pairs, each), gs
    want = gv.gemv(h, w16, None, norm_weight=nw, eps=1e-5, rope=rope)
    assert rel(pairs, want) < 2e-2, (gs, "norm+rope", rel(pairs, want))
    qw, deq = layer(96, gs)
    pairs = g4.qgemv4(h, qw, None, cfg, norm_weight=nw, eps=1e-6, silu=True)
    each = g4.qgemv4(h, qw, None, cfg, norm_weight=nw.float(), eps=1e-6, silu=True)
    assert torch.equal(pairs, each), gs
    gu = gv.gemv(h, deq.bfloat16(), None, norm_weight=nw, eps=1e-6).float()  # gemv's SiLU needs libdevice
    want = F.silu(gu[:, :48]).bfloat16().float() * gu[:, 48:]
    assert rel(pairs, want) < 2e-2, (gs, "norm+silu", rel(pairs, want))
    r = torch.randn(1, 96).bfloat16()
    got = g4.qgemv4(h, qw, None, dict(BLOCK_N=16, KS=16, num_warps=1), residual=r)
    assert rel(got, gv.gemv(h, deq.bfloat16(), None, residual=r)) < 2e-2, (gs, "residual")
    checked += 5
print("ok", checked)
'''


@pytest.mark.interpreted(SCRIPT, timeout=900)
def test_int4_gemv_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT).strip()
    assert out.startswith("ok") and int(out.split()[-1]) == 30, out
