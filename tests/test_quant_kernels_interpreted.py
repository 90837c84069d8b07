"""The Triton quantized GEMMs (parallel/kernels/quant_gemm.py) on CPU, through Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess since it must be set before the kernels are defined): GEMV, GEMM
and dequantize + linear, for GPTQ 4/8 bit (sym, asym, act order, one group), AWQ and FP8 (block and
per channel), with bias, equal to x @ the reference dequantized weight. The same kernels run
compiled in tests/gpu/test_quant_kernels.py."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
from parallel.kernels import quant_gemm as qg
from parallel.quant.awq import unpack_awq
from parallel.quant.gptq import unpack_int32
from parallel.quant.packed import from_fp8, from_int_codes
from parallel.quant.rtn import Options, quantize

torch.manual_seed(0)
K, N = 256, 48
cases = []
for o, act in ((Options("gptq", bits=4, group_size=32, sym=False, desc_act=True), True),
               (Options("gptq", bits=8, group_size=64), False), (Options("gptq", bits=4, group_size=-1), False)):
    t, deq = quantize(torch.randn(N, K) * 0.05, o, torch.randperm(K) if act else None)
    gs = K if o.group_size == -1 else o.group_size
    cases.append((o, from_int_codes(unpack_int32(t["qweight"], o.bits, 0), unpack_int32(t["qzeros"], o.bits, 1) + 1,
                                    t["scales"].float(), t["g_idx"].long(), o.bits, gs), deq))
o = Options("awq", group_size=64)
t, deq = quantize(torch.randn(N, K) * 0.05, o)
cases.append((o, from_int_codes(unpack_awq(t["qweight"]), unpack_awq(t["qzeros"]), t["scales"].float(),
                                torch.arange(K) // 64, 4, 64), deq))
o = Options("fp8", block=(16, 128))
t, deq = quantize(torch.randn(N, K) * 0.05, o)
cases.append((o, from_fp8(t["weight"], t["weight_scale_inv"].repeat_interleave(16, 0), 128, False), deq))
o = Options("fp8", fp8_scale="channel")
t, deq = quantize(torch.randn(N, K) * 0.05, o)
cases.append((o, from_fp8(t["weight"], t["weight_scale"], K, True), deq))
bias = torch.randn(N)
gemv = dict(BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=2)
for o, pw, deq in cases:
    assert torch.equal(pw.dequantize(), deq), o
    for rows in (1, 3, 9):
        x = torch.randn(rows, K)
        xs = (x.index_select(1, pw.perm) if pw.perm is not None else x).contiguous()
        want = x @ deq.t() + bias
        for plan in (None, {"gemv": gemv, "mid": "fused"}, {"mid": "dequant"}):
            y = qg.matmul_q(xs, pw.codes, pw.scales, pw.zeros, pw.group_size, pw.bits, bias, plan)
            err = (y - want).abs().max().item()
            assert err < 1e-4, (o, rows, plan, err)
print("ok", len(cases))
'''


@pytest.mark.interpreted(SCRIPT, timeout=600)
def test_quantized_gemms_in_the_triton_interpreter():
    assert run_interpreted(SCRIPT).strip().endswith("ok 6")
