"""FP8 checkpoints with static activations (`activation_scheme: "static"`, a calibrated `input_scale` per
linear) on CUDA: the W8A8 GEMM (bf16, more than 4 rows) quantizes the activations with the checkpoint's
scale, clamp(x / s) in e4m3, not per token; a fused layer uses the largest of its projections' scales.
The GEMV (1-4 rows) keeps its activations unquantized, static or not (W8A16, as for dynamic checkpoints).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.linear import MergedColumnParallelLinear
from parallel.quant import parse_quant_config
from parallel.quant.rtn import Options, quantize_fp8
from parallel.state import Group

CUDA = torch.device("cuda")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU with FP8 (compute capability >= 8.9)")
IN, OUTS = 512, [256, 384]


def _static_layer(scale: float) -> tuple[MergedColumnParallelLinear, torch.Tensor]:
    """gate/up-like fused layer from RTN per-channel FP8 weights; input_scale `scale` on the first
    projection, half of it on the second. Returns the CUDA layer and its float32 dequantized weight."""
    o = Options("fp8", fp8_scale="channel", activation_scheme="static")
    layer = MergedColumnParallelLinear(IN, OUTS, group=Group(ranks=[0], rank=0),
                                       quant_config=parse_quant_config(o.quantization_config()))
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(OUTS):
        tensors, _ = quantize_fp8(torch.randn(n, IN, generator=g) * 0.05, o)
        tensors["input_scale"] = torch.tensor(scale if i == 0 else scale / 2)
        for name, t in tensors.items():
            p = getattr(layer, name)
            p.weight_loader(p, t, i)
    layer.init_buffers()
    ref_w = layer.quant_method.dequantize(layer)
    layer = layer.to(CUDA)
    layer.init_buffers()
    layer.quant_method.process_weights(layer)
    return layer, ref_w.to(CUDA)


def _err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return (y.float() - ref.float()).abs().max().item()


def test_w8a8_quantizes_activations_with_the_static_scale():
    x = torch.randn(32, IN, generator=torch.Generator().manual_seed(1)).to(CUDA, torch.bfloat16) * 2
    # 8x the per-token scale the largest row would get: the static rounding is visibly coarser than dynamic.
    s = x.float().abs().max().item() / 448.0 * 8
    layer, ref_w = _static_layer(s)
    packed = layer.packed
    assert packed.w8a8_scale is not None and packed.act_scale.tolist() == [pytest.approx(s)]
    y = layer.quant_method.apply(layer, x, None)

    xq_static = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    row = (x.float().abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
    xq_dynamic = (x.float() / row).clamp(-448, 448).to(torch.float8_e4m3fn).float() * row
    want_static, want_dynamic = xq_static @ ref_w.t(), xq_dynamic @ ref_w.t()
    scale = want_static.abs().max().item()
    assert _err(y, want_static) <= 0.01 * scale, (_err(y, want_static), scale)
    # The two references are far apart, and the GEMM is on the static one's side.
    assert _err(want_dynamic, want_static) > 3 * _err(y, want_static)


def test_gemv_rows_run_w8a16_with_unquantized_activations():
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(2)).to(CUDA, torch.bfloat16)
    layer, ref_w = _static_layer(x.float().abs().max().item() / 448.0 * 8)
    y = layer.quant_method.apply(layer, x, None)
    ref = F.linear(x.float(), ref_w)
    assert _err(y, ref) <= 0.02 * ref.abs().max().item()


def test_static_w8a8_runs_in_a_cuda_graph():
    x = torch.randn(32, IN, generator=torch.Generator().manual_seed(3)).to(CUDA, torch.bfloat16)
    layer, _ = _static_layer(x.float().abs().max().item() / 448.0)
    eager = layer.quant_method.apply(layer, x, None)  # also the warm-up before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync (e.g. reading the scale) would fail the capture
        out = layer.quant_method.apply(layer, x, None)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-2 * eager.abs().max().item())
