"""The tinygemm int4 W4A16 path's load-time repacking (parallel/quant/tinygemm.py), on CPU.

* GPTQ (sym, asym, act order, one group) and AWQ layers repacked into tinygemm's layout (uint8 pairs,
  int4pack words, bf16 scales_and_zeros with zero = (8 - z) * scale, act order's K permutation)
  dequantize, as tinygemm computes (code - 8) * scale + zero, to the method's reference weights within
  the bf16 rounding of scale and zero.
* PyTorch's own CPU int4 kernel reads our scales_and_zeros as we mean them (same [K/gs, N, 2] contract).
* The plain-torch model of `_convert_weight_to_int4pack` and the Triton dequantize kernel agree
  (Triton interpreter). The CUDA op itself is checked against the model in tests/gpu/test_quant_kernels.py.
* Shapes tinygemm refuses, and non-int4 / non-bf16 layers, name why they stay with the Triton kernels.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from parallel.linear import MergedColumnParallelLinear, RowParallelLinear
from parallel.quant import parse_quant_config
from parallel.quant import tinygemm as tg
from parallel.quant.packed import pack_codes
from parallel.quant.rtn import Options, quantize
from parallel.state import Group
from tests.interpreter import run_interpreted

CASES = {
    "gptq_g128_sym": (Options("gptq", bits=4, group_size=128), False),
    "gptq_g32_asym_act": (Options("gptq", bits=4, group_size=32, sym=False, desc_act=True), True),
    "gptq_g64_asym": (Options("gptq", bits=4, group_size=64, sym=False), False),
    "gptq_one_group": (Options("gptq", bits=4, group_size=-1), False),
    "awq_g128": (Options("awq", group_size=128), False),
    "awq_g32": (Options("awq", group_size=32), False),
}


def _layer(o: Options, n_in: int, outs: list[int], act: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_in, generator=g) if act else None
    cls = MergedColumnParallelLinear if len(outs) > 1 else RowParallelLinear
    args = (n_in, outs) if len(outs) > 1 else (n_in, outs[0])
    layer = cls(*args, group=Group(ranks=[0], rank=0), quant_config=parse_quant_config(o.quantization_config()))
    for i, n in enumerate(outs):
        tensors, _ = quantize(torch.randn(n, n_in, generator=g) * 0.05, o, order)
        for name, t in tensors.items():
            p = getattr(layer, name)
            p.weight_loader(p, t, *((i,) if len(outs) > 1 else ()))
    layer.init_buffers()
    return layer


def _repack(pw):
    """What tinygemm.build does on CUDA, with the plain-torch model of the CUDA layout op."""
    codes = tg.unpack_codes(pw.codes)
    n, k = codes.shape
    fit = tg.plan_shape(n, k, pw.group_size)
    assert not isinstance(fit, str), fit
    group, ikt = fit
    packed = tg.int4pack_reference(tg.to_uint8_pairs(codes), ikt)
    sz = tg.scales_and_zeros(pw.scales, pw.zeros, pw.group_size, group)
    return packed, sz, group, ikt


@pytest.mark.parametrize("case", list(CASES))
def test_tinygemm_layout_dequantizes_to_the_reference(case):
    o, act = CASES[case]
    layer = _layer(o, 512, [128, 64], act)
    ref = layer.quant_method.dequantize(layer)  # [192, 512] float32, original input order
    pw = layer.quant_method.pack(layer)
    assert pw is not None and pw.bits == 4 and (pw.perm is not None) == act
    packed, sz, group, ikt = _repack(pw)
    assert packed.shape == (192 // 8, 512 // (ikt * 16), 32, ikt // 2) and packed.dtype == torch.int32
    assert sz.shape == (512 // group, 192, 2) and sz.dtype == torch.bfloat16
    if o.group_size == -1:
        assert group == 256  # one group of 512: its scale repeated over tinygemm's largest group
    w = tg.dequantize_int4pack_reference(packed, sz, group)  # the layout's (act-order sorted) K order
    if pw.perm is not None:
        w = torch.empty_like(w).index_copy_(1, pw.perm, w)
    # Bound: scale and zero rounded to bf16 (2^-8 relative each), |code - 8| and |8 - z| at most 8.
    step = pw.scales.float()[:, torch.arange(512) // pw.group_size]  # [N, K] in the layout's order
    if pw.perm is not None:
        step = torch.empty_like(step).index_copy_(1, pw.perm, step)
    assert ((w - ref).abs() <= step / 16 + 1e-7).all()
    assert (w - ref).abs().mean() < 0.02 * step.mean()
    # The run-time side of act order: x's columns permuted as K was, the product is x @ W.T.
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    w_layout = tg.dequantize_int4pack_reference(packed, sz, group)
    xs = x.index_select(1, pw.perm) if pw.perm is not None else x
    torch.testing.assert_close(xs @ w_layout.t(), x @ w.t(), rtol=1e-4, atol=1e-4)


def test_torch_cpu_int4_kernel_reads_scales_and_zeros_as_we_mean_them():
    """aten._weight_int4pack_mm_for_cpu takes the same [K/gs, N, 2] (scale, zero) tensor as the CUDA op and
    computes (code - 8) * scale + zero: our zero = (8 - z) * scale gives the asymmetric GPTQ weight."""
    o, _ = CASES["gptq_g64_asym"]
    layer = _layer(o, 256, [64], False)
    pw = layer.quant_method.pack(layer)
    packed, sz, group, _ = _repack(pw)
    codes = tg.unpack_codes(pw.codes).to(torch.int32)
    cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, cpu_packed, group, sz)
    want = x.float() @ tg.dequantize_int4pack_reference(packed, sz, group).t()
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    ref = x.float() @ layer.quant_method.dequantize(layer).t()
    assert (y.float() - ref).abs().max() < 0.03 * ref.abs().max()


def test_unpack_codes_inverts_the_triton_packing():
    codes = torch.randint(0, 16, (40, 256), generator=torch.Generator().manual_seed(3))
    assert torch.equal(tg.unpack_codes(pack_codes(codes, 4), chunk_rows=16).long(), codes)
    pairs = tg.to_uint8_pairs(codes)
    assert pairs.shape == (40, 128) and torch.equal((pairs[:, :1] >> 4).long(), codes[:, :1])


def test_layout_model_matches_the_cuda_packing_rule():
    """Word [nt, ko, t, j] packs bytes in[n0][ks[0..3]] as int4mm.cu's matrix_to_m16n8k16_Bint4_layout does."""
    n, k, ikt = 16, 256, 4
    u = tg.to_uint8_pairs(torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(4)))
    p = tg.int4pack_reference(u, ikt)
    for nt in range(n // 8):
        for ko in range(k // (ikt * 16)):
            for t in range(32):
                for inner in range(0, ikt, 2):
                    n0, kb0 = nt * 8 + t // 4, (ko * ikt + inner) * 8
                    v = [int(u[n0, x]) for x in (kb0 + t % 4, kb0 + t % 4 + 4, kb0 + 8 + t % 4, kb0 + 12 + t % 4)]
                    want = ((v[3] & 0xF) << 28 | (v[2] & 0xF) << 24 | (v[1] & 0xF) << 20 | (v[0] & 0xF) << 16
                            | (v[3] & 0xF0) << 8 | (v[2] & 0xF0) << 4 | (v[1] & 0xF0) | (v[0] & 0xF0) >> 4)
                    assert int(p[nt, ko, t, inner // 2]) & 0xFFFFFFFF == want


def test_shapes_tinygemm_refuses_say_why():
    assert tg.plan_shape(4096, 4096, 128) == (128, 8)
    assert tg.plan_shape(4096, 14336, 128) == (128, 8)
    assert tg.plan_shape(4096, 4096, 4096) == (256, 8)  # one group: scales repeated per 256
    assert tg.plan_shape(64, 96, 32) == (32, 2)
    assert "multiple of 8" in tg.plan_shape(60, 4096, 128)
    assert "not a multiple of 32" in tg.plan_shape(64, 4096, 16)
    assert "group size 48" in tg.plan_shape(64, 96, 48)
    assert "K=80" in tg.plan_shape(64, 80, 32)


def test_convert_keeps_triton_for_what_tinygemm_does_not_take(monkeypatch):
    pw8 = SimpleNamespace(bits=8, codes=None)
    assert "8-bit" in tg.convert(pw8, torch.bfloat16)
    assert "FP8" in tg.convert(SimpleNamespace(bits=None, codes=None), torch.bfloat16)
    assert "float16" in tg.convert(SimpleNamespace(bits=4, codes=None), torch.float16)
    monkeypatch.setenv(tg.KERNEL_ENV, "triton")
    assert tg.KERNEL_ENV in tg.convert(SimpleNamespace(bits=4, codes=None), torch.bfloat16)
    monkeypatch.setenv(tg.KERNEL_ENV, "marlin")
    with pytest.raises(ValueError, match="marlin"):
        tg.convert(SimpleNamespace(bits=4, codes=None), torch.bfloat16)


SCRIPT = r'''
import torch
from parallel.quant import tinygemm as tg
from parallel.kernels.int4pack import dequantize_int4pack
g = torch.Generator().manual_seed(0)
for n, k, gs in ((16, 256, 128), (24, 192, 64), (8, 96, 32), (16, 640, 128), (32, 512, 256)):
    fit = tg.plan_shape(n, k, gs)
    c = torch.randint(0, 16, (n, k), generator=g)
    p = tg.int4pack_reference(tg.to_uint8_pairs(c), fit[1])
    sz = tg.scales_and_zeros(torch.rand(n, k // gs, generator=g) + 0.1, torch.randint(0, 16, (n, k // gs), generator=g).float(),
                             gs, fit[0])
    ref = tg.dequantize_int4pack_reference(p, sz, fit[0])
    out = dequantize_int4pack(p, sz, fit[0], n, k, torch.float32)
    assert torch.equal(out, ref), (n, k, gs, (out - ref).abs().max())
print("ok")
'''


@pytest.mark.interpreted(SCRIPT, timeout=600)
def test_int4pack_dequantize_kernel_in_the_triton_interpreter():
    assert run_interpreted(SCRIPT).strip().endswith("ok")


def test_inner_k_tiles_preference_from_the_environment(monkeypatch):
    """TANDEM_TINYGEMM_IKT picks the first inner_k_tiles tried (then the others, largest first, where K needs them)."""
    from parallel.quant import tinygemm as tg

    monkeypatch.delenv(tg.IKT_ENV, raising=False)
    assert tg.plan_shape(64, 512, 128) == (128, 8) and tg.plan_shape(64, 96, 32) == (32, 2)
    monkeypatch.setenv(tg.IKT_ENV, "4")
    assert tg.plan_shape(64, 512, 128) == (128, 4) and tg.plan_shape(64, 96, 32) == (32, 2)
    monkeypatch.setenv(tg.IKT_ENV, "3")
    with pytest.raises(ValueError, match="TANDEM_TINYGEMM_IKT"):
        tg.plan_shape(64, 512, 128)
