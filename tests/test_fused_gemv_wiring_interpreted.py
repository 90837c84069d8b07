"""How quantized layers reach the fused batch-1 decoder (parallel/quant/fused_gemv.py, workers/models/fused_decode.py),
on CPU through Triton's interpreter (TRITON_INTERPRET=1, in subprocesses since it must be set before the kernels
are defined).

* `fused_decode.row_parallel_gemv` on a quantized RowParallelLinear under TP=2 (two gloo ranks, each holding its
  shard of a GPTQ / FP8 checkpoint, packed as load packs it): the first rank's epilogue adds bias and residual,
  the all-reduce gives residual + x @ W.T + b with W the full dequantized weight.
* `fused_decode.linear_gemv` on a quantized MergedColumnParallelLinear (gate/up) with the RMSNorm prologue and
  SiLU-and-mul; `_streams` tells quantized layers with and without a `gemv_weight`; `fused_gemv.kind_of` how
  each layer class is tuned. The compiled path is tested in tests/gpu/test_gemv_quant.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.interpreter import run_interpreted

K, N = 512, 64
METHODS = ("gptq", "fp8")


def _options(method: str):
    from parallel.quant.rtn import Options

    return Options("gptq", bits=4, group_size=64, sym=False) if method == "gptq" else Options("fp8", fp8_scale="channel")


def _pack(layer) -> None:
    """What LinearMethod.process_weights does on CUDA: the Triton layout, then the fused GEMV's view of it."""
    from parallel.quant import fused_gemv

    layer.packed = layer.quant_method.pack(layer)
    qw = fused_gemv.view(layer.packed)
    assert not isinstance(qw, str), qw
    layer.gemv_weight = qw


def _rank_check(rank: int) -> None:
    from parallel.kernels import gemv as gemv_module
    from parallel.linear import RowParallelLinear
    from parallel.quant import parse_quant_config
    from parallel.quant.rtn import quantize
    from workers.models.fused_decode import row_parallel_gemv

    for method in METHODS:
        o = _options(method)
        g = torch.Generator().manual_seed(0)  # every rank draws the same full tensors
        tensors, deq = quantize(torch.randn(N, K, generator=g) * 0.05, o)
        b, x, residual = torch.randn(N, generator=g), torch.randn(1, K, generator=g), torch.randn(1, N, generator=g)
        layer = RowParallelLinear(K, N, bias=True, quant_config=parse_quant_config(o.quantization_config()))
        for name, t in tensors.items():
            p = getattr(layer, name)
            p.weight_loader(p, t)
        layer.bias.data.copy_(b)
        layer.init_buffers()
        layer.quant_method.process_weights(layer)  # CPU: the reference dequantize path
        _pack(layer)
        shard = slice(rank * K // 2, (rank + 1) * K // 2)
        got = row_parallel_gemv(gemv_module.gemv, x[:, shard].contiguous(), layer, residual.clone())
        torch.testing.assert_close(got, residual + x @ deq.t() + b, rtol=1e-4, atol=1e-3)


def _main_tp2() -> None:
    from tests.multiprocess import run_ranks

    run_ranks(_rank_check, 2, parallel={"tensor_parallel_size": 2})
    print("ok")


def _main_gate_up() -> None:
    import torch.nn.functional as F

    from parallel.kernels import gemv as gemv_module
    from parallel.linear import MergedColumnParallelLinear
    from parallel.quant import fused_gemv, parse_quant_config
    from parallel.quant.rtn import quantize
    from parallel.state import Group
    from workers.models.fused_decode import _streams, linear_gemv

    for method in METHODS:
        o = _options(method)
        g = torch.Generator().manual_seed(1)
        layer = MergedColumnParallelLinear(K, [N, N], group=Group(ranks=[0], rank=0),
                                           quant_config=parse_quant_config(o.quantization_config()))
        deqs = []
        for i in range(2):
            tensors, deq = quantize(torch.randn(N, K, generator=g) * 0.05, o)
            deqs.append(deq)
            for name, t in tensors.items():
                p = getattr(layer, name)
                p.weight_loader(p, t, i)
        layer.init_buffers()
        assert not _streams(layer)  # quantized, no view yet: the model keeps the unfused decoder
        _pack(layer)
        assert _streams(layer) and fused_gemv.kind_of(layer) == "paired"
        h, nw = torch.randn(1, K, generator=g) * 3, torch.rand(K, generator=g) + 0.5
        got = linear_gemv(gemv_module.gemv, h, layer, None, norm_weight=nw, eps=1e-6, silu=True)
        normed = h * torch.rsqrt(h.pow(2).mean() + 1e-6) * nw
        gate, up = normed @ deqs[0].t(), normed @ deqs[1].t()
        # fp32: the kernel's code offsets (up to 4096 x, cancelled per word) leave ~1e-4 of the output scale
        torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-3, atol=1e-3)
    print("ok")


def test_layer_kinds():
    pytest.importorskip("triton")
    from parallel.linear import QKVParallelLinear, RowParallelLinear
    from parallel.quant import fused_gemv
    from parallel.state import Group

    one = Group(ranks=[0], rank=0)
    assert fused_gemv.kind_of(QKVParallelLinear(64, 16, 4, 2, group=one)) == "paired"
    assert fused_gemv.kind_of(RowParallelLinear(64, 64, group=one)) == "residual"


TP2_SCRIPT = "from tests.test_fused_gemv_wiring_interpreted import _main_tp2; _main_tp2()"


@pytest.mark.interpreted(TP2_SCRIPT, timeout=600)
def test_quantized_row_parallel_gemv_under_tp2_in_the_triton_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the compiled kernels are tested on the GPU (tests/gpu/test_gemv_quant.py)")
    out = run_interpreted(TP2_SCRIPT)
    assert "ok" in out, out[-3000:]


GATE_UP_SCRIPT = "from tests.test_fused_gemv_wiring_interpreted import _main_gate_up; _main_gate_up()"


@pytest.mark.interpreted(GATE_UP_SCRIPT, timeout=600)
def test_quantized_gate_up_through_linear_gemv_in_the_triton_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(GATE_UP_SCRIPT,
                          timeout=600)
    assert "ok" in out, out[-3000:]


def test_fp8_and_int4pack_take_the_fused_gemv(monkeypatch):
    """FP8 and tinygemm's 4-bit layout take the fused GEMV by default (4-bit: w4_mma's fused kernel; =1 the Triton one;
    =0 the unfused decoder; anything else is refused by name); the Triton integer layout stays on the unfused decoder;
    TANDEM_FUSED_QUANT=0 turns it off."""
    pytest.importorskip("triton")
    from parallel.kernels import gemv_quant as gq
    from parallel.quant import fused_gemv

    monkeypatch.delenv("TANDEM_FUSED_QUANT", raising=False)
    monkeypatch.delenv("TANDEM_FUSED_INT4", raising=False)
    assert fused_gemv.enabled(gq.FP8) and fused_gemv.enabled(gq.INT4PACK) and not fused_gemv.enabled(gq.PACKED)
    assert fused_gemv.int4_mode() == "w4_mma"
    for v, mode in (("1", "1"), ("w4_mma", "w4_mma"), ("AUTO", "w4_mma")):
        monkeypatch.setenv("TANDEM_FUSED_INT4", v)
        assert fused_gemv.enabled(gq.INT4PACK) and not fused_gemv.enabled(gq.PACKED) and fused_gemv.int4_mode() == mode
    monkeypatch.setenv("TANDEM_FUSED_INT4", "0")
    assert not fused_gemv.enabled(gq.INT4PACK) and fused_gemv.enabled(gq.FP8)
    monkeypatch.setenv("TANDEM_FUSED_INT4", "yes")
    with pytest.raises(ValueError, match="TANDEM_FUSED_INT4='yes'"):
        fused_gemv.enabled(gq.INT4PACK)
    monkeypatch.setenv("TANDEM_FUSED_INT4", "auto")
    monkeypatch.setenv("TANDEM_FUSED_QUANT", "0")
    assert not any(fused_gemv.enabled(f) for f in (gq.FP8, gq.INT4PACK, gq.PACKED))


def _w4_layer(kind: str, w4_config: dict | None, n: int = N, k: int = K, head_dim: int = 64):
    """A gate/up, qkv or down layer holding a 4-bit weight in tinygemm's layout (built on CPU as load builds it on
    CUDA) that `w4_config` says w4_mma serves at 1-8 rows (None: tinygemm), prepared by fused_gemv.prepare."""
    from parallel.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from parallel.quant import fused_gemv, tinygemm as tg

    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    sz = tg.scales_and_zeros(torch.rand(n, k // 128) + 0.1, torch.randint(0, 16, (n, k // 128)).float(), 128, 128)
    packed = tg.Int4PackWeight(tg.int4pack_reference(tg.to_uint8_pairs(codes), 8), sz, 128, 8, n, k,
                               w4_config=w4_config)
    cls = {"gate_up": MergedColumnParallelLinear, "qkv": QKVParallelLinear, "down": RowParallelLinear}[kind]
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.packed = packed
    if kind == "gate_up":
        layer.out_shards = [n // 2, n // 2]
    if kind == "qkv":
        layer.out_shards, layer.head_dim = [n // 2, n // 4, n // 4], head_dim
    fused_gemv.prepare(layer, torch.bfloat16)
    return layer


def test_int4pack_takes_w4_mma_where_it_serves_the_layer(monkeypatch):
    """By default (TANDEM_FUSED_INT4=auto) a 4-bit layer streams through w4_mma's fused kernel when it already runs w4_mma at
    1-8 rows and fits the fused kernel as the decoder calls it; otherwise it names why and the model keeps the unfused
    decoder. Nothing is timed here (the 1-8-row choice was measured at load)."""
    pytest.importorskip("triton")
    from parallel.kernels import w4_mma

    monkeypatch.delenv("TANDEM_FUSED_INT4", raising=False)
    monkeypatch.delenv("TANDEM_FUSED_QUANT", raising=False)
    tile = w4_mma.tile_for(N, K)
    for kind in ("gate_up", "qkv", "down"):
        layer = _w4_layer(kind, tile)
        assert layer.gemv_weight.config == {"W4MMA": True} and not hasattr(layer, "gemv_skipped"), kind
        layer = _w4_layer(kind, None)
        assert getattr(layer, "gemv_weight", None) is None and "w4_mma does not serve" in layer.gemv_skipped
    layer = _w4_layer("qkv", tile, head_dim=40)  # RoPE pairs whole 8-row tiles
    assert getattr(layer, "gemv_weight", None) is None and "head_dim 40" in layer.gemv_skipped


def _int4pack_layer(monkeypatch, ours_ms: float, tiny_ms: float):
    """A gate/up layer holding a 4-bit weight in tinygemm's layout (built on CPU as load builds it on CUDA), prepared
    by fused_gemv.prepare with the two timings stubbed (the GPU measures them): (layer, what was timed)."""
    from parallel.kernels import gemv_quant as gq
    from parallel.linear import MergedColumnParallelLinear
    from parallel.quant import fused_gemv, tinygemm as tg

    codes = torch.randint(0, 16, (N, K), dtype=torch.int32)
    sz = tg.scales_and_zeros(torch.rand(N, K // 128) + 0.1, torch.randint(0, 16, (N, K // 128)).float(), 128, 128)
    packed = tg.Int4PackWeight(tg.int4pack_reference(tg.to_uint8_pairs(codes), 8), sz, 128, 8, N, K)
    layer = MergedColumnParallelLinear.__new__(MergedColumnParallelLinear)
    torch.nn.Module.__init__(layer)
    layer.out_shards, layer.packed = [N // 2, N // 2], packed
    timed = []
    stub = iter([ours_ms, tiny_ms])
    monkeypatch.setenv("TANDEM_QUANT_TUNE", "1")
    monkeypatch.setenv("TANDEM_FUSED_INT4", "1")
    monkeypatch.setattr(fused_gemv, "tune", lambda qw, dtype, kind: gq.candidates(qw, kind == "paired")[0])
    monkeypatch.setattr(fused_gemv, "_cold_time", lambda fn: timed.append(fn) or next(stub))
    fused_gemv._VS_TINYGEMM.clear()
    fused_gemv.prepare(layer, torch.bfloat16)
    return layer, timed


@pytest.mark.parametrize("faster", [True, False])
def test_int4pack_takes_the_fused_gemv_only_where_measured_faster_than_tinygemm(monkeypatch, faster):
    pytest.importorskip("triton")
    layer, timed = _int4pack_layer(monkeypatch, 0.010, 0.012 if faster else 0.008)
    assert len(timed) == 2  # ours (the fused call), then tinygemm's product on the same weight
    if faster:
        assert layer.gemv_weight.config.get("Q4") and not hasattr(layer, "gemv_skipped")
    else:
        assert getattr(layer, "gemv_weight", None) is None and "tinygemm is faster" in layer.gemv_skipped


def test_int4pack_keeps_tinygemm_unmeasured(monkeypatch):
    """TANDEM_QUANT_TUNE=0 measures nothing, so 4-bit layers keep tinygemm (the faster one wherever both were timed)."""
    pytest.importorskip("triton")
    from parallel.quant import fused_gemv

    monkeypatch.setenv("TANDEM_FUSED_INT4", "1")
    monkeypatch.setenv("TANDEM_QUANT_TUNE", "0")
    fused_gemv._VS_TINYGEMM.clear()
    assert "not measured" in fused_gemv.faster_than_tinygemm(None, None, torch.bfloat16, "paired")
