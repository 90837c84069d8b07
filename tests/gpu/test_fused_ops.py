"""Fused RMSNorm / SiLU-and-mul / RoPE give the unfused PyTorch path's bits; fused MoE matches the expert loop."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

DEV = "cuda"


def _ref_rms(x, w, eps, res=None):
    if res is not None:
        x = x + res
        res = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = w * h.to(x.dtype)
    return out if res is None else (out, res)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [128, 4096, 5120])
def test_rms_norm(dtype, n):
    from parallel.kernels.fused_ops import rms_norm

    x = torch.randn(37, n, device=DEV).to(dtype)
    r = torch.randn(37, n, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(n, device=DEV)).to(dtype)
    a, b = rms_norm(x, w, 1e-5), _ref_rms(x, w, 1e-5)
    (a2, ar), (b2, br) = rms_norm(x, w, 1e-5, r), _ref_rms(x, w, 1e-5, r)
    assert torch.equal(ar, br)
    for got, want in ((a, b), (a2, b2)):
        # rsqrt/mean may differ in the last fp32 bit, which rounding to 16 bits almost always hides
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
        if dtype != torch.float32:
            assert (got != want).float().mean().item() < 1e-3

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_bitwise(dtype):
    from parallel.kernels.fused_ops import silu_and_mul

    x = torch.randn(19, 2 * 14336, device=DEV).to(dtype)
    g, u = x.chunk(2, -1)
    assert torch.equal(silu_and_mul(x), F.silu(g) * u)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (12, 4, 64)])
def test_rope_bitwise(dtype, hq, hkv, d):
    from parallel.kernels.fused_ops import rope
    from workers.models.layers import RotaryEmbedding, _rotate

    emb = RotaryEmbedding(types.SimpleNamespace(rope_theta=500000.0), d, 4096).to(DEV)
    emb.init_buffers()
    t = 33
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    pos = torch.randint(0, 4096, (t,), device=DEV)
    cs = emb.cos_sin[pos].to(dtype)
    cos, sin = cs[:, 0].unsqueeze(1), cs[:, 1].unsqueeze(1)
    fq, fk = rope(pos, q, k, emb.cos_sin)
    assert torch.equal(fq, _rotate(q, cos, sin)) and torch.equal(fk, _rotate(k, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (4, 1, 64)])
def test_qk_norm_rope_matches_separate_kernels(dtype, hq, hkv, d):
    """Qwen3's per-head q/k RMSNorm and RoPE in one launch = the RMSNorm kernel then the RoPE kernel,
    but for the odd element whose norm sum (two halves here, one pass there) rounds the other way."""
    from parallel.kernels.fused_ops import qk_norm_rope, rms_norm, rope
    from workers.models.layers import RotaryEmbedding

    emb = RotaryEmbedding(types.SimpleNamespace(rope_theta=1000000.0), d, 4096).to(DEV)
    emb.init_buffers()
    t = 29
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV).to(dtype) * 3
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    qw = (1 + 0.1 * torch.randn(d, device=DEV)).to(dtype)
    kw = (1 + 0.1 * torch.randn(d, device=DEV)).to(dtype)
    pos = torch.randint(0, 4096, (t,), device=DEV)
    got_q, got_k = qk_norm_rope(pos, q, k, qw, kw, 1e-6, emb.cos_sin)
    want_q, want_k = rope(pos, rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6), emb.cos_sin)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert (got != want).float().mean().item() < 1e-2


@pytest.mark.parametrize("t,e,k,h,i", [(1, 128, 8, 2048, 768), (7, 8, 2, 256, 512), (300, 16, 4, 512, 256), (2048, 128, 8, 2048, 768)])
def test_fused_moe_matches_expert_loop(t, e, k, h, i):
    from parallel.kernels.fused_moe import fused_moe
    from workers.models.moe import Experts

    torch.manual_seed(t)
    ex = Experts(e, h, i).to(DEV).to(torch.bfloat16)
    ex.w13.data.normal_(0, h ** -0.5)
    ex.w2.data.normal_(0, i ** -0.5)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    probs = torch.softmax(torch.randn(t, e, device=DEV), -1)
    w, ids = torch.topk(probs, k, -1)
    ex.use_fused = False
    ref = ex(x, ids, w)
    out = fused_moe(x, ex.w13, ex.w2, ids, w)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, err


@pytest.mark.parametrize("t,k,e,start,hi", [(1, 8, 128, 0, 128), (256, 8, 128, 0, 128), (37, 2, 8, 0, 8), (20, 2, 4, 4, 16)])
def test_align_kernel_matches_torch(t, k, e, start, hi):
    from parallel.kernels.fused_moe import _align_torch, align_by_expert

    ids = torch.randint(0, hi, (t, k), device=DEV)
    a = align_by_expert(ids, e, 16, start)
    b = _align_torch(ids - start, e, 16)
    n_pad = b[2].item()
    assert torch.equal(a[2], b[2]) and torch.equal(a[0], b[0])
    assert torch.equal(a[1][: n_pad // 16], b[1][: n_pad // 16])


def test_fused_moe_expert_parallel_slice():
    """Experts [4, 8) of 16 held here: pairs routed elsewhere contribute nothing."""
    from parallel.kernels.fused_moe import fused_moe
    from workers.models.moe import Experts

    ex = Experts(16, 256, 128, local_experts=range(4, 8)).to(DEV).to(torch.bfloat16)
    ex.w13.data.normal_(0, 256 ** -0.5)
    ex.w2.data.normal_(0, 128 ** -0.5)
    x = torch.randn(50, 256, device=DEV, dtype=torch.bfloat16)
    w, ids = torch.topk(torch.softmax(torch.randn(50, 16, device=DEV), -1), 4, -1)
    ex.use_fused = False
    ref = ex(x, ids, w)
    out = fused_moe(x, ex.w13, ex.w2, ids, w, 4, 16)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("start", [0, 64128])
def test_vocab_rows_match_the_masked_lookup(tokens, start):
    """A TP rank's share of the embedding in one kernel (TANDEM_TP_EMBED=kernel/push) is bit for bit the PyTorch
    form's masked lookup: its slice's rows, zeros (+0) for ids another rank holds."""
    from parallel.kernels.fused_ops import vocab_rows

    rows, d = 64128, 4096
    weight = torch.randn(rows, d, device=DEV, dtype=torch.bfloat16)
    ids = torch.randint(0, 2 * rows, (tokens,), device=DEV)
    local = (ids >= start) & (ids < start + rows)
    want = F.embedding(torch.where(local, ids - start, 0), weight)
    want.masked_fill_(~local.unsqueeze(-1), 0)
    got = vocab_rows(ids, weight, start)
    assert torch.equal(got, want) and not torch.signbit(got[~local]).any()
