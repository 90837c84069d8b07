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
        if m <= w4_mma.MAX_ROWS:
            want = w4_mma.gemv_w4_mma(xp, w.weight, w.scales_and_zeros, 128, n, w.w4_config) + bias
        else:
            want = torch.ops.aten._weight_int4pack_mm(xp, w.weight, 128, w.scales_and_zeros) + bias
        assert torch.equal(w.apply(x, bias), want)
    assert "w4_mma" in w.describe()


def test_choice_follows_env_and_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tg.probe_w4(torch.device("cuda")) is None
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


# ---------------------------------------------------------------- the one-row fused kernel (the fused decoder's)

def _close(got: torch.Tensor, want: torch.Tensor, bit_equal: float = 0.98) -> None:
    """Bit-equal but for the odd element where the norm's fp32 sum came out in another order. Off by a bf16 step of
    the largest inputs at most: RoPE's difference of two products keeps the absolute error of its terms."""
    assert got.shape == want.shape and got.dtype == want.dtype
    same = (got == want).float().mean().item()
    assert same >= bit_equal, f"only {same:.3f} of the elements are bit-equal"
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * max(1.0, want.float().abs().max().item()))


@pytest.mark.parametrize("act_order", [False, True])
def test_fused_norm_prologue_and_perm(act_order: bool) -> None:
    from parallel.kernels.fused_ops import rms_norm

    n, k = 6144, 4096
    w = _layer(n, k, 128)
    perm = torch.randperm(k, device="cuda") if act_order else None
    h = torch.randn(1, k, device="cuda").to(torch.bfloat16) * 3
    nw = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    xin = (lambda v: v[:, perm].contiguous()) if act_order else (lambda v: v)
    plain = w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, perm=perm)
    assert torch.equal(plain, w4_mma.gemv_w4_mma(xin(h), w.weight, w.scales_and_zeros, 128, n,
                                                 w4_mma.tile_for(n, k)))
    got = w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, perm=perm, norm_weight=nw, eps=1e-5)
    _close(got, w4_mma.gemv_w4_mma(xin(rms_norm(h, nw, 1e-5)), w.weight, w.scales_and_zeros, 128, n,
                                   w4_mma.tile_for(n, k)))


@pytest.mark.parametrize("bias", [False, True])
def test_fused_silu_epilogue(bias: bool) -> None:
    from parallel.kernels.fused_ops import rms_norm, silu_and_mul

    n, k = 2 * 1536, 4096
    w = _layer(n, k, 128)
    h = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    nw = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None
    plain = w4_mma.gemv_w4_mma(h, w.weight, w.scales_and_zeros, 128, n, w4_mma.tile_for(n, k))
    got = w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, bias=b, silu=True)
    assert got.shape == (1, n // 2)
    # the bias goes onto the rounded product, as the unfused quantized linear adds it: bit-equal to plain + b
    assert torch.equal(got, silu_and_mul(plain + b if bias else plain))
    got = w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, bias=b, norm_weight=nw, eps=1e-6, silu=True)
    normed = w4_mma.gemv_w4_mma(rms_norm(h, nw, 1e-6), w.weight, w.scales_and_zeros, 128, n,
                                w4_mma.tile_for(n, k))
    _close(got, silu_and_mul(normed + b if bias else normed))


@pytest.mark.parametrize("n,k", [(4096, 14336), (4096, 4096), (256, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_residual_epilogue(n: int, k: int, bias: bool) -> None:
    w = _layer(n, k, 128)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    r = torch.randn(1, n, device="cuda").to(torch.bfloat16) * 4
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None
    plain = w4_mma.gemv_w4_mma(x, w.weight, w.scales_and_zeros, 128, n, w4_mma.tile_for(n, k))
    want = plain + b + r if bias else plain + r  # RowParallelLinear: round, add the bias (rounded), add h
    assert torch.equal(w4_mma.gemv_w4_mma_fused(x, w.weight, w.scales_and_zeros, 128, n, bias=b, residual=r), want)


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (4, 1, 64), (6, 2, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_rope_epilogue(hq: int, hkv: int, d: int, bias: bool) -> None:
    from parallel.kernels.fused_ops import rms_norm, rope
    from parallel.kernels.gemv import Rope

    k = 4096 if hq == 32 else 512
    n = (hq + 2 * hkv) * d
    w = _layer(n, k, 128)
    h = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    nw = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None
    pos = torch.tensor([777], device="cuda")
    t = torch.arange(4096, device="cuda", dtype=torch.float32)[:, None] / (10000 ** (torch.arange(0, d, 2, device="cuda") / d))
    emb = torch.cat([t, t], dim=-1)
    cos_sin = torch.stack([emb.cos(), emb.sin()], dim=1).contiguous()  # [P, 2, D]
    got = w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, bias=b, norm_weight=nw, eps=1e-5,
                                   rope=Rope(pos, cos_sin, d, (hq + hkv) * d))
    qkv = w4_mma.gemv_w4_mma(rms_norm(h, nw, 1e-5), w.weight, w.scales_and_zeros, 128, n,
                             w4_mma.tile_for(n, k))
    if bias:
        qkv = qkv + b
    q, kk, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    qr, kr = rope(pos, q.view(1, hq, d), kk.view(1, hkv, d), cos_sin)
    _close(got, torch.cat([qr.reshape(1, -1), kr.reshape(1, -1), v], dim=-1))
    no_norm = w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, bias=b,
                                       rope=Rope(pos, cos_sin, d, (hq + hkv) * d))
    qkv = w4_mma.gemv_w4_mma(h, w.weight, w.scales_and_zeros, 128, n, w4_mma.tile_for(n, k))
    q, kk, v = (qkv + b if bias else qkv).split([hq * d, hkv * d, hkv * d], dim=-1)
    qr, kr = rope(pos, q.view(1, hq, d), kk.view(1, hkv, d), cos_sin)
    assert torch.equal(no_norm, torch.cat([qr.reshape(1, -1), kr.reshape(1, -1), v], dim=-1))  # no sum to reorder


@pytest.mark.parametrize("act_order", [False, True])
def test_fused_tiles_a_cta_sum_as_one_tile_a_cta(act_order: bool) -> None:
    """Where several MMA tiles share a CTA (`tiles_per_cta`: gate/up of Llama-3.1-8B, 14 a CTA on 132 SMs) the output is
    that of one tile a CTA: bit for bit without the norm (the same K split; every tile's rows mapped alike: SiLU's gate
    and up rows, act order's permuted row, RoPE's head halves, a bias), and with it but for the odd element whose
    norm sum came out in another order (the CTA's threads split the row's squares differently)."""
    from parallel.kernels.cuda_launch import sm_count
    from parallel.kernels.gemv import Rope

    n, k = 28672, 4096
    sms = sm_count(torch.device("cuda"))
    if -(-(n // 16) // sms) >= w4_mma.STAGED_CTAS_MIN:  # an H100 / H200 (132 SMs): 14 tiles a CTA
        assert w4_mma.fused_tile(n, k, sms, staged=True)["TPC"] > 1
    w = _layer(n, k, 128)
    h = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    nw = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    perm = torch.randperm(k, device="cuda") if act_order else None
    def run(tile: dict | None, **kw) -> torch.Tensor:
        return w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, perm=perm, tile=tile, **kw)

    assert torch.equal(run({"TPC": 14}, silu=True), run({"TPC": 1}, silu=True))
    for kw in (dict(norm_weight=nw, eps=1e-5, silu=True), dict(norm_weight=nw, eps=1e-5, bias=b)):
        _close(run(None, **kw), run({"TPC": 1}, **kw))
    # RoPE's heads over grouped tiles (qkv is one tile a CTA by default: forced here)
    d, hq, hkv = 128, 32, 8
    n = (hq + 2 * hkv) * d
    w = _layer(n, k, 128)
    t = torch.arange(1024, device="cuda", dtype=torch.float32)[:, None] / (500000 ** (torch.arange(0, d, 2, device="cuda") / d))
    emb = torch.cat([t, t], dim=-1)
    rope = Rope(torch.tensor([77], device="cuda"), torch.stack([emb.cos(), emb.sin()], dim=1).contiguous(), d,
                (hq + hkv) * d)
    def qkv(tile: dict, **kw) -> torch.Tensor:
        return w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, perm=perm, rope=rope, tile=tile, **kw)

    assert torch.equal(qkv({"TPC": 3}), qkv({"TPC": 1}))
    _close(qkv({"TPC": 3}, norm_weight=nw, eps=1e-5), qkv({"TPC": 1}, norm_weight=nw, eps=1e-5))
    with pytest.raises(ValueError, match="tiles a CTA"):
        qkv({"TPC": 5})  # 384 tiles do not split in fives


@pytest.mark.parametrize("act_order", [False, True])
def test_fused_two_tiles_a_warp_group_sum_as_one(act_order: bool) -> None:
    """R = 2 (a warp group takes two MMA tiles: SiLU's two gate tiles and their up tiles, or two plain tiles) gives the
    output of R = 1 at the same K split bit for bit, with and without tiles grouped a CTA; the rows kernel at that
    tile agrees; RoPE refuses it."""
    from parallel.kernels.gemv import Rope

    n, k = 28672, 4096
    w = _layer(n, k, 128)
    h = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    nw = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    r = torch.randn(1, n, device="cuda").to(torch.bfloat16)
    perm = torch.randperm(k, device="cuda") if act_order else None

    def run(tile: dict, **kw) -> torch.Tensor:
        return w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, perm=perm, tile=tile, **kw)

    one, two = dict(R=1, KSPLIT=4), dict(R=2, KSPLIT=4)
    for kw in (dict(silu=True), dict(silu=True, bias=b), dict(norm_weight=nw, eps=1e-5, silu=True),
               dict(residual=r, bias=b), dict(norm_weight=nw, eps=1e-5)):
        want = run({**one, "TPC": 1}, **kw)
        assert torch.equal(run({**two, "TPC": 1}, **kw), want), kw
        if "norm_weight" not in kw:  # grouped CTAs split the norm's squares differently: exact only without it
            assert torch.equal(run({**two, "TPC": 4}, **kw), want), kw
    xin = h[:, perm].contiguous() if act_order else h
    rows = w4_mma.gemv_w4_mma(xin, w.weight, w.scales_and_zeros, 128, n, dict(R=2, KSPLIT=4, U=2, SUB=0))
    assert torch.equal(run({**two, "TPC": 1}), rows)
    d = 128
    rope = Rope(torch.tensor([3], device="cuda"), torch.ones(8, 2, d, device="cuda"), d, 16 * d)
    with pytest.raises(ValueError, match="RoPE"):
        w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, rope=rope, tile=two)


def test_fused_trace_stamps_every_cta() -> None:
    """`trace=` (bench_w4_chain --trace): every CTA's five %globaltimer stamps, in order, and the same output."""
    from parallel.kernels.cuda_launch import sm_count

    n, k = 28672, 4096
    w = _layer(n, k, 128)
    h = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    nw = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    ctas = w4_mma.fused_ctas(n, k, staged=True, sms=sm_count(torch.device("cuda")))
    trace = torch.zeros(ctas, 5, dtype=torch.int64, device="cuda")
    kw = dict(norm_weight=nw, eps=1e-5, silu=True)
    got = w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, trace=trace, **kw)
    assert torch.equal(got, w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, **kw))
    t = trace.cpu()
    assert (t > 0).all() and (t[:, 1:] >= t[:, :-1]).all()
    with pytest.raises(ValueError, match="trace"):
        w4_mma.gemv_w4_mma_fused(h, w.weight, w.scales_and_zeros, 128, n, trace=trace[:-1], **kw)


def test_fused_chain_in_a_graph_with_pdl_equals_eager() -> None:
    """Captured into a CUDA graph on Hopper, the fused kernels launch with programmatic dependent launch
    (cuda_launch.py): each loads its first weights before waiting for the kernel ahead. A layer's chain (o with the
    residual, gate/up with the norm and SiLU, down with the residual; then act order's staged permutation) replayed
    from the graph, inputs changed between replays, equals the same calls run eagerly, bit for bit."""
    from parallel.kernels.cuda_launch import pdl_wanted

    d, f = 512, 1024
    wo, wgu, wd = _layer(d, d, 128), _layer(2 * f, d, 128), _layer(d, f, 128)
    perm = torch.randperm(d, device="cuda")
    nw = (torch.rand(d, device="cuda") + 0.5).to(torch.bfloat16)
    x = torch.randn(1, d, device="cuda").to(torch.bfloat16)
    h = torch.randn(1, d, device="cuda").to(torch.bfloat16)

    def chain():
        h1 = w4_mma.gemv_w4_mma_fused(x, wo.weight, wo.scales_and_zeros, 128, d, residual=h)
        act = w4_mma.gemv_w4_mma_fused(h1, wgu.weight, wgu.scales_and_zeros, 128, 2 * f, norm_weight=nw, eps=1e-5,
                                       silu=True)
        h2 = w4_mma.gemv_w4_mma_fused(act, wd.weight, wd.scales_and_zeros, 128, d, residual=h1)
        return w4_mma.gemv_w4_mma_fused(h2, wo.weight, wo.scales_and_zeros, 128, d, perm=perm)

    chain()  # compiles outside the capture
    seen = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seen.append(pdl_wanted(x))
        out = chain()
    if torch.cuda.get_device_capability()[0] >= 9:
        assert seen == [True], "no PDL launch under capture on Hopper"
    for _ in range(3):
        x.copy_(torch.randn(1, d, device="cuda").to(torch.bfloat16))
        h.copy_(torch.randn(1, d, device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, chain())


def test_fused_refuses_what_it_cannot_do() -> None:
    w = _layer(256, 512, 128)
    x = torch.randn(2, 512, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="one bf16 row"):
        w4_mma.gemv_w4_mma_fused(x, w.weight, w.scales_and_zeros, 128, 256)
    assert "head_dim 40" in w4_mma.fused_fits(400, 512, 128, 8, head_dim=40)
    assert "SiLU pairs" in w4_mma.fused_fits(48, 512, 128, 8, silu=True)
    assert "shared memory" in w4_mma.fused_fits(256, 32768, 128, 8)


@pytest.mark.parametrize("method,bias", [("gptq", False), ("awq", False), ("gptq", True)])
def test_quantized_model_fused_decode_matches_unfused(tmp_path, method: str, bias: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-bit checkpoint (the project's quantizer; GPTQ with act order; AWQ; with and without biases) whose every
    decoder linear w4_mma fits, with TANDEM_FUSED_INT4=w4_mma: the batch-1 graph is captured through the fused decoder
    on w4_mma's fused kernel, and gives the unfused graph's tokens (w4_mma per linear with the separate norm, RoPE, SiLU
    and residual kernels) and log-probabilities."""
    from parallel.quant.rtn import Options
    from tandem import LLM
    from tests.models import fused_and_unfused_decode, prompts_of_lengths, tiny_model
    from tests.quant_helpers import qt
    from workers.models import fused_decode

    monkeypatch.setenv(tg.W4_ENV, "1")  # tiny layers: take w4_mma without timing it against tinygemm
    monkeypatch.setenv("TANDEM_FUSED_INT4", "w4_mma")
    src = tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                     intermediate_size=512, num_hidden_layers=2, attention_bias=bias, mlp_bias=bias)
    o = {"gptq": Options("gptq", bits=4, group_size=32, sym=False, desc_act=True), "awq": Options("awq", group_size=64)}
    dst = str(tmp_path / "q")
    qt.quantize_folder(src, dst, o[method])
    calls = []
    real = fused_decode.forward
    monkeypatch.setattr(fused_decode, "forward", lambda *a: calls.append(1) or real(*a))
    llm = LLM(dst, device="cuda", dtype="bfloat16", attention_backend="triton", max_model_len=256, block_size=16,
              num_gpu_blocks_override=128, max_num_seqs=4, enable_prefix_caching=False, show_progress=False)
    linears = fused_decode._linears(llm.llm_engine.executor.runner.model.layers["0"])
    fused, unfused = fused_and_unfused_decode(llm, prompts_of_lengths([5, 40, 17], 200, seed=3), 24)
    for lin in linears:
        assert getattr(lin, "gemv_weight", None) is not None, getattr(lin, "gemv_skipped", None)
        assert lin.gemv_weight.config.get("W4MMA")
    assert calls, "the batch-1 graph was not captured through the fused path"
    for f, u in zip(fused, unfused):
        assert f.token_ids == u.token_ids
        lf = [lp[t] for lp, t in zip(f.logprobs, f.token_ids)]
        lu = [lp[t] for lp, t in zip(u.logprobs, u.token_ids)]
        assert max(abs(a - b) for a, b in zip(lf, lu)) < 0.05, (lf, lu)
