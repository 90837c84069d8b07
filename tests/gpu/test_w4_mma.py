"""The decode-batch W4A16 tensor-core GEMV (parallel/kernels/w4_mma.py, CUDA through NVRTC) on a GPU.

* Every tile family (the two `tile_for` picks, two 16-row tiles a CTA, 16 warps splitting K, eight steps in flight, the
  bf16 subtract-8 variant) at 1-8 rows, group sizes 32 / 64 / 128 / 256, symmetric and asymmetric codes, equals
  x @ the dequantized weight (tinygemm's layout as `_convert_weight_to_int4pack` writes it) within one bf16 rounding of
  each value plus fp32 summation noise, and agrees with tinygemm's own product.
* K not a multiple of the warps' split (uneven ranges, warps with no step) and a 16-row N are exact too.
* Replayed from a CUDA graph it gives the same output.
* `Int4PackWeight.apply` takes it at 1-8 rows when the weight carries a tile (with act order's permutation and a bias),
  tinygemm from 9 rows; `choose_w4` follows TANDEM_W4_GEMV and the load-time measurement; the probe passes here.
"""
from __future__ import annotations

import pytest
import torch

from parallel.kernels import w4_mma
from parallel.quant import tinygemm as tg

TILES = [dict(R=1, KSPLIT=8, U=2, SUB=0), dict(R=1, KSPLIT=2, U=4, SUB=0), dict(R=2, KSPLIT=4, U=2, SUB=0),
         dict(R=1, KSPLIT=16, U=8, SUB=0), dict(R=1, KSPLIT=8, U=4, SUB=1), dict(R=1, KSPLIT=1, U=1, SUB=0)]


def _layer(n: int, k: int, gs: int, sym: bool = False, seed: int = 0) -> tg.Int4PackWeight:
    g = torch.Generator(device="cpu").manual_seed(seed + n + k + gs)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = torch.rand(n, k // gs, generator=g) * 2e-2 + 1e-3
    zeros = None if sym else torch.randint(0, 16, (n, k // gs), generator=g).float().cuda()
    w = tg.build(codes.cuda(), scales.cuda(), zeros, gs)
    assert not isinstance(w, str), w
    return w


def _check(y: torch.Tensor, want: torch.Tensor) -> None:
    step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 8)  # half a bf16 step: round to nearest
    excess = ((y.float() - want).abs() - step).max().item()
    assert excess <= 2e-4 * want.abs().max().item(), excess


@pytest.mark.parametrize("tile", TILES, ids=lambda t: "r{R}k{KSPLIT}u{U}s{SUB}".format(**t))
@pytest.mark.parametrize("gs", [32, 64, 128, 256])
def test_tiles_rows_groups(tile: dict, gs: int) -> None:
    for sym in (False, True):
        w = _layer(256, 1024, gs, sym)
        ref = w.dense(torch.float32)
        for m in range(1, w4_mma.MAX_ROWS + 1):
            x = torch.randn(m, 1024, device="cuda").to(torch.bfloat16)
            want = x.float() @ ref.t()
            y = w4_mma.gemv_w4_mma(x, w.weight, w.scales_and_zeros, w.group_size, 256, tile)
            assert y.shape == (m, 256) and y.dtype == torch.bfloat16
            _check(y, want)
            tiny = torch.ops.aten._weight_int4pack_mm(x, w.weight, w.group_size, w.scales_and_zeros)
            assert (y.float() - tiny.float()).abs().max().item() <= 0.02 * want.abs().max().item()


def test_uneven_split_and_llama_shape() -> None:
    for n, k in ((16, 384), (48, 1152), (6144, 4096), (4096, 14336)):  # 3 and 9 steps over 8 warps; real shapes
        w = _layer(n, k, 128)
        want_w = w.dense(torch.float32)
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            for tile in (w4_mma.tile_for(n, k), TILES[3]):
                _check(w4_mma.gemv_w4_mma(x, w.weight, w.scales_and_zeros, 128, n, tile), x.float() @ want_w.t())


def test_cuda_graph_replay() -> None:
    w = _layer(4096, 4096, 128)
    x = torch.randn(4, 4096, device="cuda").to(torch.bfloat16)
    eager = w4_mma.gemv_w4_mma(x, w.weight, w.scales_and_zeros, 128, 4096)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4_mma.gemv_w4_mma(x, w.weight, w.scales_and_zeros, 128, 4096)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
    x.copy_(torch.randn(4, 4096, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, w4_mma.gemv_w4_mma(x, w.weight, w.scales_and_zeros, 128, 4096))


def test_apply_takes_it_at_decode_rows() -> None:
    n, k = 512, 2048
    w = _layer(n, k, 128)
    perm = torch.randperm(k, device="cuda")
    w.perm = perm
    w.w4_config = w4_mma.tile_for(n, k)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for m in (1, 8, 9):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        xp = x[:, perm].contiguous()
        if m <= tg.W4_MAX_ROWS:
            want = w4_mma.gemv_w4_mma(xp, w.weight, w.scales_and_zeros, 128, n, w.w4_config) + bias
        else:
            want = torch.ops.aten._weight_int4pack_mm(xp, w.weight, 128, w.scales_and_zeros) + bias
        assert torch.equal(w.apply(x, bias), want)
    assert "w4_mma" in w.describe()


def test_choice_follows_env_and_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tg.probe_w4(torch.device("cuda")) is None
    assert tg.W4_MAX_ROWS == w4_mma.MAX_ROWS
    w = _layer(4096, 4096, 128)
    monkeypatch.setenv(tg.W4_ENV, "0")
    assert tg.choose_w4(w) is None
    monkeypatch.setenv(tg.W4_ENV, "1")
    assert tg.choose_w4(w) == w4_mma.tile_for(4096, 4096)
    monkeypatch.setenv(tg.W4_ENV, "auto")
    tg._W4_CHOICE.clear()
    tg.W4_MEASURED.clear()
    got = tg.choose_w4(w)
    rec = tg.W4_MEASURED[-1]
    assert (got is not None) == rec["chosen"] == (rec["w4_us"] <= tg.W4_MARGIN * rec["tinygemm_us"])
    w_odd = _layer(4096, 4096, 128)
    w_odd.inner_k_tiles = 4  # a layout the kernel does not read
    monkeypatch.setenv(tg.W4_ENV, "1")
    assert tg.choose_w4(w_odd) is None
