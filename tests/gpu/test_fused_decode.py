"""The batch-1 decode GEMV with RMSNorm / SiLU-and-mul / residual folded in equals the unfused kernels,
and a model's fused decode graph gives the unfused graph's tokens and log-probabilities."""
from __future__ import annotations

import pytest
import torch

from tests.models import fused_and_unfused_decode, prompts_of_lengths, tiny_model
from tandem import LLM

DEV = "cuda"


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal but for the odd element where the norm's fp32 sum came out in another order."""
    assert got.shape == want.shape and got.dtype == want.dtype
    same = (got == want).float().mean().item()
    assert same >= 0.98, f"only {same:.3f} of the elements are bit-equal"
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n,k", [(6144, 4096), (1000, 320), (37, 4104)])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_prologue(n, k, bias):
    from parallel.kernels.fused_ops import rms_norm
    from parallel.kernels.gemv import gemv

    torch.manual_seed(n + k)
    h = torch.randn(1, k, device=DEV, dtype=torch.bfloat16) * 3
    nw = torch.rand(k, device=DEV, dtype=torch.bfloat16) + 0.5
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
    _close(gemv(h, w, b, norm_weight=nw, eps=1e-5), gemv(rms_norm(h, nw, 1e-5), w, b))


@pytest.mark.parametrize("n,k", [(14336, 4096), (1024, 256), (300, 520)])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_epilogue_with_norm(n, k, bias):
    from parallel.kernels.fused_ops import rms_norm, silu_and_mul
    from parallel.kernels.gemv import gemv

    torch.manual_seed(n)
    h = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    nw = torch.rand(k, device=DEV, dtype=torch.bfloat16) + 0.5
    w = (torch.randn(2 * n, k, device=DEV) / k**0.5).to(torch.bfloat16)
    b = torch.randn(2 * n, device=DEV, dtype=torch.bfloat16) if bias else None
    want = silu_and_mul(gemv(rms_norm(h, nw, 1e-6), w, b))
    _close(gemv(h, w, b, norm_weight=nw, eps=1e-6, silu=True), want)
    assert torch.equal(gemv(h, w, b, silu=True), silu_and_mul(gemv(h, w, b)))  # no norm: no sum to reorder


@pytest.mark.parametrize("n,k", [(4096, 14336), (4096, 4096), (96, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_residual_epilogue(n, k, bias):
    from parallel.kernels.gemv import gemv

    torch.manual_seed(k)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(torch.bfloat16)
    r = torch.randn(1, n, device=DEV, dtype=torch.bfloat16) * 4
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
    want = gemv(x, w) + b + r if bias else gemv(x, w) + r  # RowParallelLinear adds its bias after the matmul
    assert torch.equal(gemv(x, w, b, residual=r), want)


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (5, 1, 64), (4, 4, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_rope_epilogue(hq, hkv, d, bias):
    """q and k heads rotated at positions[0] exactly as the RoPE kernel rotates the GEMV's output; v untouched."""
    from parallel.kernels.fused_ops import rope
    from parallel.kernels.gemv import Rope, gemv

    torch.manual_seed(hq * d)
    k = 4096 if hq == 32 else 320
    n = (hq + 2 * hkv) * d
    h = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    nw = torch.rand(k, device=DEV, dtype=torch.bfloat16) + 0.5
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
    pos = torch.tensor([777], device=DEV)
    t = torch.arange(4096, device=DEV, dtype=torch.float32)[:, None] / (10000 ** (torch.arange(0, d, 2, device=DEV) / d))
    emb = torch.cat([t, t], dim=-1)
    cos_sin = torch.stack([emb.cos(), emb.sin()], dim=1).contiguous()  # [P, 2, D]
    got = gemv(h, w, b, norm_weight=nw, eps=1e-5, rope=Rope(pos, cos_sin, d, (hq + hkv) * d))
    qkv = gemv(h, w, b, norm_weight=nw, eps=1e-5)
    q, kk, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    qr, kr = rope(pos, q.view(1, hq, d), kk.view(1, hkv, d), cos_sin)
    want = torch.cat([qr.reshape(1, -1), kr.reshape(1, -1), v], dim=-1)
    assert torch.equal(got, want)


ARCHS = [
    ("llama", dict(hidden_size=320, num_attention_heads=5, num_key_value_heads=1, head_dim=64, intermediate_size=520,
                   num_hidden_layers=3, attention_bias=True, mlp_bias=True)),
    ("qwen3", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=768,
                   num_hidden_layers=3)),
]


@pytest.mark.parametrize("arch,overrides", ARCHS, ids=[a for a, _ in ARCHS])
def test_fused_decode_graph_matches_unfused(arch, overrides, monkeypatch):
    from workers.models import fused_decode

    path = tiny_model(arch, **overrides)
    calls = []
    real = fused_decode.forward
    monkeypatch.setattr(fused_decode, "forward", lambda *a: calls.append(1) or real(*a))
    # No prefix caching: the second pass must prefill exactly as the first (a prefix hit would read the
    # prompt's keys from the cache in other tiles, moving logprobs by bf16 rounding), so only decode differs.
    llm = LLM(path, device="cuda", dtype="bfloat16", attention_backend="triton", max_model_len=256, block_size=16,
              num_gpu_blocks_override=128, max_num_seqs=4, enable_prefix_caching=False, show_progress=False)
    fused, unfused = fused_and_unfused_decode(llm, prompts_of_lengths([5, 40, 17], 200, seed=3), 24)
    assert calls, "the batch-1 graph was not captured through the fused path"
    for f, u in zip(fused, unfused):
        assert f.token_ids == u.token_ids
        lf = [lp[t] for lp, t in zip(f.logprobs, f.token_ids)]
        lu = [lp[t] for lp, t in zip(u.logprobs, u.token_ids)]
        assert lf[0] == lu[0], "the prefill (same kernels in both passes) must be deterministic"
        assert max(abs(a - b) for a, b in zip(lf, lu)) < 0.05, (lf, lu)
