"""The batch-1 W4A16 GEMV (parallel/kernels/gemv_w4.py) compiled on CUDA.

* Every tile family (one or two steps prefetched by hand, Triton's pipeline, split K, tensor cores) on Llama-3.1-8B-like
  shapes (K 4096 and 14336) equals x @ the dequantized weight (tinygemm layout built by `_convert_weight_to_
  int4pack` itself, as load builds it): within one bf16 rounding of each value (the GPU rounds to nearest), and through
  split K's fp32 sums within 1e-5 of the output's magnitude; and it agrees with tinygemm's own product.
* Replayed from a CUDA graph it gives the same output (no host sync, split K's zeroing and cast captured too).
* `Int4PackWeight.apply` at batch 1 takes it when the weight carries a tile (`w4_config`), batch > 1 keeps tinygemm.
"""
from __future__ import annotations

import pytest
import torch

from parallel.kernels import gemv_w4 as w4
from parallel.quant import tinygemm as tg

TILES = [dict(BLOCK_N=8, C=32, num_warps=1, PREFETCH=1), dict(BLOCK_N=4, C=32, num_warps=1, PREFETCH=2),
         dict(BLOCK_N=8, C=128, num_warps=4, PREFETCH=1), dict(BLOCK_N=16, C=32, num_warps=1, PREFETCH=0, NUM_STAGES=3),
         dict(BLOCK_N=8, C=64, num_warps=2, PREFETCH=2),
         dict(MMA=True, BLOCK_N=64, G=2, num_warps=4, NUM_STAGES=4), dict(MMA=True, BLOCK_N=32, G=4, num_warps=2,
                                                                         NUM_STAGES=3)]


def _layer(n: int, k: int, gs: int = 128) -> tg.Int4PackWeight:
    g = torch.Generator(device="cpu").manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = torch.rand(n, k // gs, generator=g) * 2e-3 + 1e-3
    zeros = torch.randint(0, 16, (n, k // gs), generator=g).float()
    w = tg.build(codes.cuda(), scales.cuda(), zeros.cuda(), gs)
    assert not isinstance(w, str), w
    return w


def _check(y: torch.Tensor, want: torch.Tensor) -> None:
    step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 8)  # half a bf16 step: round to nearest
    excess = ((y.float() - want).abs() - step).max().item()
    assert excess <= 1e-5 * want.abs().max().item(), excess


@pytest.mark.parametrize("n,k", [(1024, 4096), (4096, 14336)])
@pytest.mark.parametrize("tile", range(len(TILES)))
def test_tiles_equal_the_dequantized_product(n: int, k: int, tile: int) -> None:
    w = _layer(n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    want = x.float() @ w.dense(torch.float32).t()
    cfg = TILES[tile]
    _check(w4.gemv_w4(x, w.weight, w.scales_and_zeros, w.group_size, n, cfg), want)
    tiny = torch.ops.aten._weight_int4pack_mm(x, w.weight, w.group_size, w.scales_and_zeros)
    assert ((tiny.float() - want).abs().max() / want.abs().max()).item() < 1e-2  # the reference itself is tinygemm's
    steps = k // (128 * cfg["G"]) if cfg.get("MMA") else -(-(k // 32) // cfg["C"])
    if steps % 2 == 0:
        yf = torch.zeros(n, device="cuda")
        w4.gemv_w4(x, w.weight, w.scales_and_zeros, w.group_size, n, {**cfg, "SPLIT_K": 2}, out_fp32=yf)
        assert ((yf - want[0]).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize("split", [1, 2])
def test_graph_replay(split: int) -> None:
    w = _layer(4096, 4096)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = dict(BLOCK_N=8, C=32, num_warps=1, PREFETCH=2, SPLIT_K=split)
    eager = w4.gemv_w4(x, w.weight, w.scales_and_zeros, w.group_size, 4096, cfg)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w4.gemv_w4(x, w.weight, w.scales_and_zeros, w.group_size, 4096, cfg)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = w4.gemv_w4(x, w.weight, w.scales_and_zeros, w.group_size, 4096, cfg)
    for _ in range(3):  # split K zeroes its fp32 sums inside the graph: replays do not accumulate
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)


def test_apply_takes_it_at_batch_1_only() -> None:
    w = _layer(1024, 4096)
    w.w4_config = dict(BLOCK_N=8, C=32, num_warps=1, PREFETCH=1)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(w.apply(x, None), w4.gemv_w4(x, w.weight, w.scales_and_zeros, w.group_size, 1024, w.w4_config))
    x2 = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(w.apply(x2, None), torch.ops.aten._weight_int4pack_mm(x2, w.weight, w.group_size,
                                                                             w.scales_and_zeros))


def test_load_time_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped TABLE (every tile slower than tinygemm) leaves tinygemm; a tile the table calls faster is still
    refused when the load-time graph timing finds it slower; TANDEM_W4_GEMV=0 never and =1 always take the kernel."""
    w = _layer(4096, 4096)
    monkeypatch.setattr(tg, "_W4_CHOICE", {})
    assert tg.choose_w4(w) is None
    slow = dict(BLOCK_N=2, C=32, num_warps=1, PREFETCH=0)  # one step at a time: far slower than tinygemm
    monkeypatch.setattr(w4, "TABLE", {(4096, 4096): (slow, 1.0, 2.0)})  # as if measured faster offline
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    ours = tg.graph_time(lambda: w4.gemv_w4(x, w.weight, w.scales_and_zeros, w.group_size, 4096, slow))
    tiny = tg.graph_time(lambda: torch.ops.aten._weight_int4pack_mm(x, w.weight, w.group_size, w.scales_and_zeros))
    assert 0 < tiny < ours
    assert tg.choose_w4(w) is None
    monkeypatch.setenv("TANDEM_W4_GEMV", "0")
    assert tg.choose_w4(w) is None
    monkeypatch.setenv("TANDEM_W4_GEMV", "1")
    assert tg.choose_w4(w) == slow
