"""The Triton ring-attention step compiled on a GPU (its CPU twin runs in Triton's interpreter,
tests/test_ring_attention_interpreted.py) against PyTorch SDPA: Llama-3.1-8B heads (32 query, 8 KV, D 128)
and other GQA ratios, bf16/fp16/fp32, plain and TMA loads, causal chunk pairs of the SP layout (diagonal,
interleaved, fully masked, fully visible), ragged lengths; one SP rank's whole ring (`ring_rank_attention`)
for SP=2 and 4 against full causal SDPA; split-K (forced counts and the automatic rule on this GPU's SMs) the
same ways; and `ring_attention`'s default picks the kernel on CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import parallel.ring_attention as ring_mod
from parallel.kernels import ring_attention_triton as rt
from parallel.kernels.paged_attention import _tma_supported
from parallel.ring_attention import TokenShard, _RingSteps, ring_rank_attention, split_for_ranks
from parallel.ulysses import ulysses_rank_attention
from workers.sp_plan import owned_positions

DEV = "cuda"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def sdpa_with_lse(q, k, v, scale, q_pos, k_pos):
    """fp32 SDPA (output) and logsumexp of the masked scores (lse); rows that see nothing: out 0, lse -inf."""
    qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kf, vf = kf.repeat_interleave(g, 0), vf.repeat_interleave(g, 0)
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=DEV) if q_pos is None else \
        q_pos[:, None] >= k_pos[None, :]
    scores = (qf @ kf.transpose(1, 2)) * scale
    lse = scores.masked_fill(~mask, float("-inf")).logsumexp(-1).transpose(0, 1)
    seen = mask.any(1)
    full = torch.zeros_like(qf)
    if seen.any():
        full[:, seen] = F.scaled_dot_product_attention(qf[:, seen], kf, vf, attn_mask=mask[seen], scale=scale)
    return full.transpose(0, 1), lse


def layout(n: int, sp: int, rank: int) -> torch.Tensor:
    return torch.tensor(owned_positions(0, n, rank, sp, 16), device=DEV)


CASES = {  # q positions, k positions (None, None: no mask)
    "diagonal": lambda: (torch.arange(1000, device=DEV), torch.arange(1000, device=DEV)),
    "sp2 rank1 x rank0": lambda: (layout(2100, 2, 1), layout(2100, 2, 0)),
    "sp4 rank0 x rank3": lambda: (layout(2100, 4, 0), layout(2100, 4, 3)),
    "fully masked": lambda: (torch.arange(300, device=DEV), torch.arange(200, device=DEV) + 500),
    "fully visible": lambda: (torch.arange(333, device=DEV) + 900, torch.arange(777, device=DEV)),
    "non-causal": lambda: (None, None),
}


def _case_inputs(case: str, hq: int = 32, hkv: int = 8, d: int = 128, dtype: torch.dtype = torch.bfloat16,
                 seed_extra: int = 0) -> tuple:
    """A CASES entry's positions and random q [Tq, hq, d], k and v [Tk, hkv, d] (517 x 1029 tokens when it has no
    positions), seeded by the token counts: (q_pos, k_pos, q, k, v)."""
    q_pos, k_pos = CASES[case]()
    tq, tk = (q_pos.numel(), k_pos.numel()) if q_pos is not None else (517, 1029)
    g = torch.Generator(device=DEV).manual_seed(tq + tk + seed_extra)
    q = torch.randn(tq, hq, d, device=DEV, generator=g).to(dtype)
    k, v = (torch.randn(tk, hkv, d, device=DEV, generator=g).to(dtype) for _ in range(2))
    return q_pos, k_pos, q, k, v


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 1, 64), (4, 4, 128)])
@pytest.mark.parametrize("tma", [False, True])
def test_chunk_attention_matches_sdpa(case, dtype, hq, hkv, d, tma):
    if tma and not _tma_supported(torch.empty(16, 16, device=DEV)):  # 2-D: a 16-byte row stride, as k/v have
        pytest.skip("TMA needs Hopper")
    q_pos, k_pos, q, k, v = _case_inputs(case, hq, hkv, d, dtype, seed_extra=hq)
    scale = d ** -0.5
    out, lse = rt.chunk_attention(q, k, v, scale, q_pos, k_pos, tma=tma)
    ref_out, ref_lse = sdpa_with_lse(q, k, v, scale, q_pos, k_pos)
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead) and (out[dead] == 0).all()
    torch.testing.assert_close(out, ref_out, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(lse[~dead], ref_lse[~dead], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("tma", [False, True])
def test_one_loop_chunk_attention_matches_sdpa(case, tma):
    """RingConfig.oneloop (the masked key tiles in the unmasked tiles' loop, by a branch per tile) against SDPA, bf16,
    Llama-8B heads packed and not."""
    if tma and not _tma_supported(torch.empty(16, 16, device=DEV)):
        pytest.skip("TMA needs Hopper")
    q_pos, k_pos, q, k, v = _case_inputs(case)
    ref_out, ref_lse = sdpa_with_lse(q, k, v, 128 ** -0.5, q_pos, k_pos)
    dead = torch.isneginf(ref_lse)
    for config in ("128,128,8,3,pack,oneloop", "128,64,8,3,oneloop"):
        out, lse = rt.chunk_attention(q, k, v, 128 ** -0.5, q_pos, k_pos, tiles=rt.RingConfig.parse(config), tma=tma)
        assert torch.equal(torch.isneginf(lse), dead) and (out[dead] == 0).all(), config
        torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2, msg=config)
        torch.testing.assert_close(lse[~dead], ref_lse[~dead], rtol=1e-3, atol=1e-3, msg=config)


def _prompt_and_full_attention(seed: int, n: int = 4099, hq: int = 32, hkv: int = 8, d: int = 128):
    """A bf16 prompt's q [n, Hq, D], k/v [n, Hkv, D] and its full causal attention by SDPA."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(n, hq, d, device=DEV, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(n, hkv, d, device=DEV, generator=g, dtype=torch.bfloat16) for _ in range(2))
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                          enable_gqa=True).transpose(0, 1)
    return q, k, v, want


@pytest.mark.parametrize("config", [None, "128,128,8,3,pack", "128,128,8,3,pack,split=2",
                                    "128,128,8,3,pack,hybrid,oneloop,early,overlap",
                                    "128,128,8,3,pack,fuse,batchcopy,overlap",
                                    "128,128,8,3,pack,fuse,batchcopy,oneloop0,plain0", "128,128,8,3,pack,plain0",
                                    "128,128,8,3,pack,fuse,batchcopy,trim0"])
def test_a_kept_plan_runs_each_layers_tensors(config):
    """A ring plan (cached on the query shard) keeps its launches across calls: three "layers" over the same shards,
    twice round, each call bitwise the ring of a fresh plan (new shards) for that layer, and within bf16 tolerance
    of SDPA; one layer's q a view of a wider projection output (other strides: a plan of its own) and one 8 bytes
    off 16-byte alignment (another specialisation of the kernel: through the JIT, then its own handle)."""
    layers = [_prompt_and_full_attention(20 + i) for i in range(3)]
    q1 = layers[1][0]
    wide = torch.zeros(q1.shape[0], q1.shape[1] + 16, q1.shape[2], device=DEV, dtype=q1.dtype)
    wide[:, :q1.shape[1]] = q1
    n, hq, d = q1.shape
    for sp in (2, 4):
        positions = [owned_positions(0, n, r, sp, 16) for r in range(sp)]
        shards = split_for_ranks(*layers[0][:3], positions)[2]
        parts = [split_for_ranks(q, k, v, positions)[:2] for q, k, v, _ in layers]
        odd = torch.empty(q1.numel() + 4, device=DEV, dtype=q1.dtype)[4:]
        qs_view = [wide[torch.tensor(p, device=DEV)][:, :hq] for p in positions]  # rows of Hq + 16 heads
        for _ in range(2):
            for li, (qs, blocks) in enumerate(parts):
                for r in range(sp):
                    q = qs_view[r] if li == 1 else qs[r]
                    if li == 2:
                        q = odd[:qs[r].numel()].view(qs[r].shape).copy_(qs[r])
                        assert q.data_ptr() % 16 != 0
                    got = ring_rank_attention(q, blocks, shards, r, d ** -0.5, "triton", kernel_config=config)
                    fresh = split_for_ranks(*layers[0][:3], positions)[2]
                    want = ring_rank_attention(qs[r], blocks, fresh, r, d ** -0.5, "triton", kernel_config=config)
                    assert torch.equal(got, want), (sp, li, r)
                    torch.testing.assert_close(got.float(), layers[li][3][positions[r]].float(), rtol=2e-2,
                                               atol=2e-2)


@pytest.mark.parametrize("config", [None, "128,128,8,3,pack,hybrid", "128,128,8,3,pack,split=2,pdl,early",
                                    "128,128,8,3,pack,fuse,batchcopy", "128,128,8,3,pack,hybrid,oneloop",
                                    "128,128,8,3,pack,hybrid,oneloop,early,overlap",
                                    "128,128,8,3,pack,fuse,batchcopy,overlap", "128,128,8,3,pack,fuse,batchcopy,trim0",
                                    "128,128,8,3,pack,fuse,batchcopy,hband=2"])
def test_direct_launches_match_the_jit_path(config, monkeypatch):
    """By default (TANDEM_RING_DIRECT unset) a ring's repeated launches go through the compiled kernel's handle
    (rt._HANDLES, no binding or cache lookup): bitwise the output of launches through Triton's JIT path
    (TANDEM_RING_DIRECT=0), SP=2 and 4."""
    q, k, v, want = _prompt_and_full_attention(11)
    n, _, d = q.shape
    for sp in (2, 4):
        positions = [owned_positions(0, n, r, sp, 16) for r in range(sp)]
        qs, blocks, shards = split_for_ranks(q, k, v, positions)
        monkeypatch.setenv(rt.DIRECT_ENV, "0")
        jit = [ring_rank_attention(qs[r], blocks, shards, r, d ** -0.5, "triton", kernel_config=config)
               for r in range(sp)]
        monkeypatch.delenv(rt.DIRECT_ENV, raising=False)
        rt._HANDLES.clear()
        for _ in range(2):  # the first call fills the handles, the second launches through them
            direct = [ring_rank_attention(qs[r], blocks, shards, r, d ** -0.5, "triton", kernel_config=config)
                      for r in range(sp)]
        assert rt._HANDLES, "no launch went through a handle"
        for r in range(sp):
            assert torch.equal(direct[r], jit[r]), (sp, r)
            torch.testing.assert_close(direct[r].float(), want[positions[r]].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("config", [None, "128,128,8,3,pack", "64,64,4,2", "128,64,8,2,pack",
                                    "128,128,8,3,pack,split=2", "128,64,8,3,split=4", "128,128,8,3,pack,acc16",
                                    "128,128,8,3,pack,early", "128,128,8,3,pack,pdl", "128,128,8,3,pack,early,pdl",
                                    "128,128,8,3,early,pdl,acc16", "128,64,8,3,pack,split=2,early,pdl",
                                    "128,128,8,3,pack,fuse", "128,128,8,3,pack,fuse,early,pdl",
                                    "128,128,8,3,pack,fuse,split=1", "128,128,8,3,pack,gather",
                                    "128,128,8,3,pack,oneloop", "128,128,8,3,pack,fuse,split=1,oneloop,early",
                                    "128,128,8,3,pack,hybrid", "128,128,8,3,hybrid,oneloop,early",
                                    "128,128,8,3,pack,fuse,batchcopy", "128,128,8,3,pack,hybrid,oneloop,early,overlap",
                                    "128,128,8,3,pack,fuse,batchcopy,overlap", "128,128,8,3,pack,fuse,batchcopy,oneloop0",
                                    "128,128,8,3,pack,fuse,batchcopy,oneloop0,plain0", "128,128,8,3,pack,plain0",
                                    "128,128,8,3,pack,fuse,batchcopy,trim0",
                                    "128,128,8,3,pack,fuse,batchcopy,oneloop0,plain0,trim0",
                                    "128,128,8,3,pack,fuse,batchcopy,hband=2", "128,128,8,3,pack,hband=4",
                                    "128,128,8,3,pack,hband=1",
                                    "128,128,8,3,pack,hybrid,oneloop,early,hband=2", "128,128,8,3,hband=8,split=2",
                                    "128,128,8,3,pack,fuse,batchcopy,first=64/8/3", "128,128,8,3,pack,first=64/8/4",
                                    "128,128,8,3,pack,fuse,batchcopy,first=64/4/2/64", "128,128,8,3,first=64/4/2/64",
                                    "128,128,8,3,pack,hybrid,oneloop,early,first=64/4/3/64"])
def test_rank_work_matches_full_causal_sdpa(sp: int, config: str | None):
    """Every rank's ring (default launch config, and GQA packing / other tiles / split-K / steps that start from the
    accumulators / steps chained by programmatic dependent launch / the steps after the first fused into one launch
    over the other blocks in position order) against full causal SDPA."""
    q, k, v, want = _prompt_and_full_attention(sp)
    n, _, d = q.shape
    positions = [owned_positions(0, n, r, sp, 16) for r in range(sp)]
    qs, blocks, shards = split_for_ranks(q, k, v, positions)
    for r in range(sp):
        got = ring_rank_attention(qs[r], blocks, shards, r, d ** -0.5, backend="triton", kernel_config=config)
        torch.testing.assert_close(got.float(), want[positions[r]].float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got, ring_rank_attention(qs[r], blocks, shards, r, d ** -0.5, backend="torch"),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", ["diagonal", "sp2 rank1 x rank0", "fully visible", "non-causal"])
@pytest.mark.parametrize("config", ["128,128,8,3,pack,split=3", "128,64,8,3,split=2", "64,64,4,2,split=4"])
@pytest.mark.parametrize("tma", [False, True])
def test_split_chunk_attention_matches_sdpa(case, config, tma):
    """Split-K pieces merged by LSE (bf16, Llama-8B heads) against SDPA, output and LSE; the table must split."""
    if tma and not _tma_supported(torch.empty(16, 16, device=DEV)):
        pytest.skip("TMA needs Hopper")
    q_pos, k_pos, q, k, v = _case_inputs(case)
    cfg = rt.RingConfig.parse(config)
    table = rt._device_tiles(None if q_pos is None else q_pos.int(), None if k_pos is None else k_pos.int(),
                             q.shape[0], k.shape[0],
                             rt.rows_per_tile(cfg, 32, 8), q.device).cpu().numpy()
    assert (rt.split_counts(table, cfg.block_n, 1, 1, cfg.splits) > 1).any()
    out, lse = rt.chunk_attention(q, k, v, 128 ** -0.5, q_pos, k_pos, tiles=cfg, tma=tma)
    ref_out, ref_lse = sdpa_with_lse(q, k, v, 128 ** -0.5, q_pos, k_pos)
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead) and (out[dead] == 0).all()
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse[~dead], ref_lse[~dead], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("pack", [False, True])
def test_automatic_split_of_a_small_grid(pack: bool):
    """64 new tokens over 16K tokens of context in one step (a ring of one): a grid of a few programs with long
    key ranges, which the automatic rule splits on this GPU's SMs; the result against causal SDPA."""
    n, new = 16384, 64
    g = torch.Generator(device=DEV).manual_seed(7)
    q = torch.randn(new, 32, 128, device=DEV, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(n, 8, 128, device=DEV, generator=g, dtype=torch.bfloat16) for _ in range(2))
    pos = torch.arange(n, device=DEV)
    want, _ = sdpa_with_lse(q, k, v, 128 ** -0.5, pos[n - new:], pos)  # 64 x 16K scores per head: small
    q_shard, kv_shard = TokenShard([list(range(n - new, n))]), TokenShard([list(range(n))])
    config = "128,128,8,3,pack" if pack else "128,128,8,3"
    steps = _RingSteps(q, torch.stack([k, v]), q_shard, [kv_shard], 128 ** -0.5, None, True, config)
    assert steps.tables[0][2] > 0, "the automatic rule did not split a grid of a few programs"
    steps.step(0, torch.stack([k, v]))
    torch.testing.assert_close(steps.result().float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_rank_work_matches_full_causal_sdpa(sp: int):
    q, k, v, want = _prompt_and_full_attention(sp)
    hq, d = q.shape[1:]
    for r in range(sp):
        got = ulysses_rank_attention(q, k, v, r, sp, d ** -0.5)  # the Triton kernel: the CUDA default
        heads = slice(r * hq // sp, (r + 1) * hq // sp)
        torch.testing.assert_close(got.float(), want[:, heads].float(), rtol=2e-2, atol=2e-2)


def test_cuda_default_is_the_triton_kernel(monkeypatch):
    """`ring_attention`'s steps on CUDA run the kernel, not the PyTorch tiles."""
    def no_tiles(*a):
        raise AssertionError("the PyTorch tiles ran on CUDA")

    monkeypatch.setattr(ring_mod, "_tile_scores", no_tiles)
    q, k, v = (torch.randn(64, h, 128, device=DEV, dtype=torch.bfloat16) for h in (8, 2, 2))
    qs, blocks, shards = split_for_ranks(q, k, v, [owned_positions(0, 64, r, 2, 16) for r in range(2)])
    ring_rank_attention(qs[0], blocks, shards, 0, 0.1)


@pytest.mark.parametrize("sp", [2, 4])
def test_a_block_larger_than_l2_bands_the_head_groups(sp: int):
    """The default config of a chunk whose own K/V block outgrows this GPU's L2 runs the head groups one band at a
    time (hband=1, what made 128K tokens at SP=2 0.49x of SP=1 instead of 0.57x on an H200), every rank's ring equal
    to full causal SDPA."""
    l2 = rt.l2_bytes(torch.device(DEV))
    if not l2:
        pytest.skip("this GPU does not report its L2 size")
    hkv, d = 8, 128
    chunk = l2 // (2 * hkv * d * 2) + 4096  # a rank's keys: its K/V block [2, chunk, Hkv, D] bf16 just over L2
    n = sp * chunk
    g = torch.Generator(device=DEV).manual_seed(7)
    q = torch.randn(n, 32, d, device=DEV, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(n, hkv, d, device=DEV, generator=g, dtype=torch.bfloat16) for _ in range(2))
    # Flash SDPA over the heads repeated (4-D, MHA: GQA or 3-D inputs would take the math path, O(n^2) memory).
    kr, vr = (x.repeat_interleave(32 // hkv, dim=1).transpose(0, 1).unsqueeze(0) for x in (k, v))
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
        want = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kr, vr, is_causal=True)[0].transpose(0, 1)
    del kr, vr
    positions = [owned_positions(0, n, r, sp, 16) for r in range(sp)]
    qs, blocks, shards = split_for_ranks(q, k, v, positions)
    for r in range(sp):
        assert blocks[r].nbytes > l2
        steps = _RingSteps(qs[r], blocks[r], shards[r], [shards[(r - s) % sp] for s in range(sp)], d ** -0.5, None,
                           True)
        assert steps.config.hband == 1 and not (steps.fused or steps.hybrid), steps.config
        got = ring_rank_attention(qs[r], blocks, shards, r, d ** -0.5, backend="triton")
        torch.testing.assert_close(got.float(), want[positions[r]].float(), rtol=2e-2, atol=2e-2)
