"""The fused batch-1 GEMV on quantized weights (parallel/kernels/gemv_quant.py) on CPU, through Triton's
interpreter (TRITON_INTERPRET=1, in a subprocess since it must be set before the kernels are defined).

Every format the loader leaves on CUDA, built on CPU exactly as load builds it (parallel/quant/fused_gemv.py
`view` over the packed weight): tinygemm's int4 layout (GPTQ sym / asym, group sizes 32, 64, 128 and one
group (-1), act order with g_idx, AWQ), the Triton int layout (GPTQ 4-bit act order, 8-bit), FP8 per channel
and block-wise. Each against x @ the layout's dequantized weight (the reference dequantize of the layer), for
the plain product with bias and for each fused prologue / epilogue against `gemv.gemv` (the bf16 fused
decoder's kernel, run on the dequantized weight in the same interpreter): RMSNorm + RoPE (qkv), RMSNorm +
SiLU-and-mul (gate/up), residual add with bias (row-parallel). fp32 activations (tight tolerance) and
bf16 for the plain product. Also the default tiles of every format, and ragged N (masked rows). The
compiled kernel is tested in tests/gpu/test_gemv_quant.py."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
import torch.nn.functional as F
from parallel.kernels import gemv as gv
from parallel.kernels import gemv_quant as gq
from parallel.quant import fused_gemv, tinygemm as tg
from parallel.quant.awq import unpack_awq
from parallel.quant.gptq import unpack_int32
from parallel.quant.packed import from_fp8, from_int_codes
from parallel.quant.rtn import Options, quantize

torch.manual_seed(0)
K = 512


def gptq(n, o, act):
    t, deq = quantize(torch.randn(n, K) * 0.05, o, torch.randperm(K) if act else None)
    gs = K if o.group_size == -1 else o.group_size
    return from_int_codes(unpack_int32(t["qweight"], o.bits, 0), unpack_int32(t["qzeros"], o.bits, 1) + 1,
                          t["scales"].float(), t["g_idx"].long(), o.bits, gs), deq


def awq(n, gs):
    t, deq = quantize(torch.randn(n, K) * 0.05, Options("awq", group_size=gs))
    return from_int_codes(unpack_awq(t["qweight"]), unpack_awq(t["qzeros"]), t["scales"].float(),
                          torch.arange(K) // gs, 4, gs), deq


def int4pack(pw):
    """What tinygemm.convert builds on CUDA, with the plain-torch model of _convert_weight_to_int4pack."""
    codes = tg.unpack_codes(pw.codes)
    tgs, ikt = tg.plan_shape(codes.shape[0], K, pw.group_size)
    packed = tg.int4pack_reference(tg.to_uint8_pairs(codes), ikt)
    sz = tg.scales_and_zeros(pw.scales, pw.zeros, pw.group_size, tgs)
    w = tg.Int4PackWeight(packed, sz, tgs, ikt, codes.shape[0], K, pw.perm)
    deq = tg.dequantize_int4pack_reference(packed, sz, tgs)
    if pw.perm is not None:
        deq = torch.empty_like(deq).index_copy_(1, pw.perm, deq)
    return w, deq


def cases(n):
    """(name, packed weight as load leaves it, its dequantized [n, K] weight in input order)"""
    out = []
    for name, o, act in (("gptq g32 asym act-order", Options("gptq", bits=4, group_size=32, sym=False, desc_act=True), True),
                         ("gptq g64 sym", Options("gptq", bits=4, group_size=64), False),
                         ("gptq g128 asym", Options("gptq", bits=4, group_size=128, sym=False), False),
                         ("gptq one group", Options("gptq", bits=4, group_size=-1), False)):
        pw, deq = gptq(n, o, act)
        out.append(("int4pack " + name, *int4pack(pw)))
        if act:
            out.append(("triton-layout " + name, pw, pw.dequantize()))
    pw, _ = awq(n, 64)
    out.append(("int4pack awq g64", *int4pack(pw)))
    pw, deq = gptq(n, Options("gptq", bits=8, group_size=64, sym=False), False)
    out.append(("triton-layout gptq 8-bit g64 asym", pw, pw.dequantize()))
    t, deq = quantize(torch.randn(n, K) * 0.05, Options("fp8", fp8_scale="channel"))
    out.append(("fp8 per channel", from_fp8(t["weight"], t["weight_scale"], K, True), deq))
    t, deq = quantize(torch.randn(n, K) * 0.05, Options("fp8", block=(16, 128)))
    out.append(("fp8 block 16x128", from_fp8(t["weight"], t["weight_scale_inv"].repeat_interleave(16, 0), 128, False), deq))
    return out


def check(got, want, tol, what):
    err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
    assert err < tol, (what, err)


HD = 16
TOL = 2e-4  # relative to the largest output: codes are summed as 2048 + c (the offset cancels in fp32, ~1e-5)
checked = 0
for name, pw, deq in cases(48):  # plain product, with and without bias, every candidate tile; bf16 too
    qw = fused_gemv.view(pw)
    assert not isinstance(qw, str), (name, qw)
    assert torch.allclose(deq, pw.dequantize(), atol=1e-6), name
    x, b = torch.randn(1, K), torch.randn(48)
    check(gq.qgemv(x, qw, None), x @ deq.t(), TOL, (name, "no bias"))  # the bias is a branch, not a tile matter
    checked += 1
    for cfg in gq.candidates(qw)[:2] + [dict(BLOCK_N=32, KS=1, num_warps=1, num_stages=1)]:  # 48 rows: one tile masked
        check(gq.qgemv(x, qw, b, cfg), x @ deq.t() + b, TOL, (name, cfg))
        checked += 1
    xb = x.bfloat16()
    check(gq.qgemv(xb, qw, b.bfloat16()), xb.float() @ deq.t() + b.bfloat16().float(), 1e-2, (name, "bf16"))
    checked += 1
for name, pw, deq in cases(40):  # ragged N: 40 rows in tiles of 16 or 32 (masked); the residual epilogue with bias
    qw = fused_gemv.view(pw)
    x, b, r = torch.randn(1, K), torch.randn(40), torch.randn(1, 40)
    check(gq.qgemv(x, qw, b, residual=r), gv.gemv(x, deq, b, residual=r), TOL, (name, "residual"))
    checked += 1
h, nw = torch.randn(1, K) * 3, torch.rand(K) + 0.5
pos = torch.tensor([5])
ang = torch.rand(8, 1, HD // 2) * 6
cs = torch.cat([torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)], 1).contiguous()  # [P, 2, D]
rope = gv.Rope(pos, cs, HD, 2 * HD)
for name, pw, deq in cases(3 * HD):  # qkv: RMSNorm prologue, RoPE of q and k (v passes), bias
    qw = fused_gemv.view(pw)
    b = torch.randn(3 * HD)
    check(gq.qgemv(h, qw, b, norm_weight=nw, eps=1e-5, rope=rope), gv.gemv(h, deq, b, norm_weight=nw, eps=1e-5, rope=rope),
          TOL, (name, "norm+rope"))
    checked += 1
for name, pw, deq in cases(2 * 48):  # gate/up: RMSNorm prologue and SiLU-and-mul, bias
    qw = fused_gemv.view(pw)
    b = torch.randn(96)
    gate_up = gv.gemv(h, deq, b, norm_weight=nw, eps=1e-6)  # gemv's SiLU needs libdevice, which the interpreter lacks
    check(gq.qgemv(h, qw, b, norm_weight=nw, eps=1e-6, silu=True), F.silu(gate_up[:, :48]) * gate_up[:, 48:], TOL,
          (name, "norm+silu"))
    plain = h @ deq.t()
    check(gq.qgemv(h, qw, None, silu=True), F.silu(plain[:, :48]) * plain[:, 48:], TOL, (name, "silu"))
    checked += 2
print("ok", checked)
'''


@pytest.mark.interpreted(SCRIPT, timeout=900)
def test_quantized_fused_gemv_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT).strip()
    assert out.startswith("ok") and int(out.split()[-1]) == 81, out
