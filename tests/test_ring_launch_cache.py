"""The ring's host path (parallel/ring_attention.py `_RingSteps`, parallel/kernels/ring_attention_triton.py
`StepLaunch`): each launch planned once per ring plan and kept there without any call's tensors (a short chunk's
accumulators kept there too), later calls run with their own queries, K/V and output; repeated launches through the
compiled kernel's handle, keyed by what Triton specialises on; the first launch issued before what later launches
need is made; the defaults by SP size. The kernels run in Triton's interpreter (a subprocess); the handle path, which needs a compiled kernel, runs
against a stand-in kernel that records its launches."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.interpreter import run_interpreted

REUSE_SCRIPT = r'''
import gc
import weakref

import torch
from parallel import ring_attention as ra
from parallel.ring_attention import _RingSteps, attention_with_lse, ring_rank_attention, split_for_ranks
from workers.sp_plan import owned_positions

D = 16
S = D ** -0.5
torch.manual_seed(0)
checked = 0


def causal(q, k, v):
    pos = torch.arange(q.shape[0])
    return attention_with_lse(q.float(), k.float(), v.float(), S, pos[:, None] >= pos[None, :])[0]


# Two "layers" over the same shards (the plan, cached on the query shard, is shared): the second call plans nothing,
# runs its own q / K/V through the first call's launches and gets its own output; the first call's output is not
# touched by the second; the kept launches hold none of the first call's tensors (freed once the caller drops them).
for sp, cfg in ((2, "32,16,4,1,pack"), (2, "16,16,4,1,pack,hybrid,oneloop"), (4, "16,16,4,1,fuse,batchcopy"),
                (4, "32,16,4,1,pack,fuse"), (3, "16,16,4,1,pack,split=2"), (2, None), (4, None),
                (2, "16,16,4,1,pack,hybrid,overlap"), (4, "16,16,4,1,fuse,batchcopy,overlap"),
                (4, "16,16,4,1,fuse,batchcopy,oneloop0"), (4, "16,16,4,1,fuse,batchcopy,oneloop0,plain0"),
                (4, "16,16,4,1,pack,fuse,batchcopy,hband=1"), (3, "16,16,4,1,hband=1,split=2"),
                (4, "32,32,4,1,pack,fuse,batchcopy,first=16/2/2"), (4, "32,32,4,1,pack,fuse,batchcopy,first=16/2/2/16"),
                (2, "32,16,4,1,pack,hybrid,oneloop,first=16/2/1/16"), (4, "32,16,4,1,pack,fuse,batchcopy,first=16/2/1/32")):
    n = 45
    positions = [owned_positions(0, n, r, sp, 4) for r in range(sp)]
    layers = [tuple(torch.randn(n, h, D) for h in (4, 2, 2)) for _ in range(2)]
    parts = [split_for_ranks(q, k, v, positions) for q, k, v in layers]
    shards = parts[0][2]
    for r in range(sp):
        outs, plans = [], []
        for li, (qs, blocks, _) in enumerate(parts):
            srcs = [(r - s) % sp for s in range(sp)]
            steps = _RingSteps(qs[r], blocks[r], shards[r], [shards[s] for s in srcs], S, None, True, cfg)
            if li == 1:  # planned by the first layer: the same launch objects, released, and accumulators
                assert steps.plan is plans[0] and all(x is not None for x in steps.launches), (sp, cfg, r)
                assert [id(x) for x in steps.launches] == [id(x) for x in plans[0].launches]
                assert steps.acc is steps.plan.acc is not None  # a short chunk's: kept in the plan
            for s, src in enumerate(srcs):
                steps.step(s, blocks[src])
            outs.append(steps.result())
            plans.append(steps.plan)
            assert all(x.q is None and x.acc is None and x.out is None for x in steps.plan.launches), (sp, cfg)
            # A short chunk's fused buffer is the plan's too; RingConfig.overlap's side stream is CUDA's only.
            assert (steps.fused_kv is steps.plan.kv is not None) == (steps.fused or steps.hybrid), (sp, cfg)
            assert steps.side is None and steps.recv_stream() is None
            # oneloop0: the first launch's programs in one loop, the others as the config says
            assert [x.kw["ONELOOP"] for x in steps.plan.launches] == [
                steps.config.oneloop or (steps.config.oneloop0 and j == 0) for j in range(steps.n_launch)], (sp, cfg)
            # hband: the programs' order by head-group bands where it divides a launch's groups (none here is hybrid
            # with bands, so every launch has all groups: 4 query heads, or 2 KV heads packed)
            # first: the first launch's BLOCK_N / warps / stages, the others the config's
            tiles0 = [(x.kw["BLOCK_N"], x.kw["num_warps"], x.kw["num_stages"]) for x in steps.plan.launches]
            cfg_tiles = (steps.config.block_n, steps.config.num_warps, steps.config.num_stages)
            first = steps.config.first[:3]
            assert tiles0 == [first or cfg_tiles] + [cfg_tiles] * (steps.n_launch - 1), (sp, cfg, tiles0)
            # first's BLOCK_M: the first launch's, its table in 8-token rows (16 rows of 2 packed heads), unsplit
            m0 = steps.config.first[3] if len(steps.config.first) == 4 else 0
            assert [x.kw["BLOCK_M"] for x in steps.plan.launches] == [m0 or steps.config.block_m] + [
                steps.config.block_m] * (steps.n_launch - 1), (sp, cfg)
            assert steps.plan.block_m0 == (m0 if m0 != steps.config.block_m else 0), (sp, cfg)
            if m0:
                assert steps.plan.tables[0][1] is None
                t0 = steps.plan.tables[0][0]
                assert int((t0[:, 1] - t0[:, 0]).max()) <= m0 // 2, (sp, cfg)
            groups, band = 4 // steps.config.heads_per_program(2), steps.config.hband
            assert all(x.kw["HBAND"] == (band if 0 < band < groups and groups % band == 0 else 0)
                       for x in steps.plan.launches if not x.empty), (sp, cfg)
        assert outs[0] is not outs[1]
        for li, (q, k, v) in enumerate(layers):
            torch.testing.assert_close(outs[li], causal(q, k, v)[positions[r]], rtol=1e-5, atol=1e-5,
                                       msg=str((sp, cfg, r, li)))
            checked += 1
        # The plan keeps no call's tensors: a dropped q is freed.
        q_probe = parts[1][0][r].clone()
        ref = weakref.ref(q_probe)
        srcs = [(r - s) % sp for s in range(sp)]
        again = ring_rank_attention(q_probe, parts[1][1], shards, r, S, "triton", kernel_config=cfg)
        torch.testing.assert_close(again, outs[1], rtol=0, atol=0)
        del q_probe, again
        gc.collect()
        assert ref() is None, (sp, cfg, r)

# Longer chunks than KEEP_ACC_TOKENS: the accumulators are each call's own (none kept in the plan), results the same.
ra.KEEP_ACC_TOKENS = 8
for sp, cfg in ((2, "32,16,4,1,pack"), (4, "16,16,4,1,fuse,batchcopy")):
    n = 45
    positions = [owned_positions(0, n, r, sp, 4) for r in range(sp)]
    for _ in range(2):
        q, k, v = (torch.randn(n, h, D) for h in (4, 2, 2))
        qs, blocks, shards = split_for_ranks(q, k, v, positions)
        srcs = [(1 - s) % sp for s in range(sp)]
        steps = _RingSteps(qs[1], blocks[1], shards[1], [shards[s] for s in srcs], S, None, True, cfg)
        assert steps.plan.acc is None and steps.acc is not None and steps.plan.kv is None
        for s, src in enumerate(srcs):
            # ... and the fused buffer (not kept either) made at the launch that needs it (batchcopy: the last step's)
            assert steps.fused_kv is None, (sp, cfg, s)
            steps.step(s, blocks[src])
        assert (steps.fused_kv is not None) == steps.fused
        torch.testing.assert_close(steps.result(), causal(q, k, v)[positions[1]], rtol=1e-5, atol=1e-5)
        checked += 1
ra.KEEP_ACC_TOKENS = 8192

# A ring's first launch comes before its output is made (at the launch that needs it): after step 0 of a two-launch
# ring, no output yet; a short chunk's fused buffer is the plan's (made with it).
for sp, cfg in ((2, "32,16,4,1,pack"), (4, "16,16,4,1,fuse,batchcopy"), (2, "16,16,4,1,pack,hybrid")):
    n = 45
    positions = [owned_positions(0, n, r, sp, 4) for r in range(sp)]
    q, k, v = (torch.randn(n, h, D) for h in (4, 2, 2))
    qs, blocks, shards = split_for_ranks(q, k, v, positions)
    srcs = [(1 - s) % sp for s in range(sp)]
    steps = _RingSteps(qs[1], blocks[1], shards[1], [shards[s] for s in srcs], S, None, True, cfg)
    assert steps.out is None and steps.acc is not None
    assert steps.fused_kv is steps.plan.kv and (steps.fused_kv is not None) == (steps.fused or steps.hybrid)
    steps.step(0, blocks[srcs[0]])
    assert steps.out is None, (sp, cfg)
    for s in range(1, sp):
        steps.step(s, blocks[srcs[s]])
    torch.testing.assert_close(steps.result(), causal(q, k, v)[positions[1]], rtol=1e-5, atol=1e-5)
    checked += 1
print("ok", checked)
'''


@pytest.mark.interpreted(REUSE_SCRIPT, timeout=900)
def test_launches_planned_once_per_plan_in_the_triton_interpreter():
    out = run_interpreted(REUSE_SCRIPT)
    want = 2 * (2 + 2 + 4 + 4 + 3 + 2 + 4 + 2 + 4 + 4 + 4 + 4 + 3 + 4 + 4 + 2 + 4) + 2 * 2 + 3  # every rank of each case, twice
    assert out.strip().split()[-2:] == ["ok", str(want)], out[-800:]


class _Compiled:
    """A stand-in for Triton's CompiledKernel: `kernel[grid](*args)` records the launch."""

    def __init__(self, log: list, form: str = "all"):
        self.log, self.form = log, form

    def run(self, *args):  # noqa: D401 - only its presence matters (StepLaunch checks for it)
        raise AssertionError("not called directly")

    def __getitem__(self, grid):
        def runner(*args):
            if self.form == "runtime" and any(isinstance(a, bool) for a in args[-3:]):
                raise TypeError("this launcher takes the runtime arguments only")
            self.log.append(("handle", grid, len(args)))
        return runner


class _Jit:
    """A stand-in for the @triton.jit ring kernel: `kernel[grid](*args, **kw)` records the launch and returns the
    compiled stand-in, as Triton's JIT returns the CompiledKernel it launched."""

    def __init__(self, form: str = "all"):
        self.log: list = []
        self.compiled = _Compiled(self.log, form)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("jit", grid, len(args)))
            return self.compiled
        return launch


def _step(rt, q: torch.Tensor, acc, out):
    tiles = torch.zeros((3, rt.TILE_FIELDS), dtype=torch.int32)
    return rt.StepLaunch(q, 8, 2, 0.25, tiles, None, None, rt.RingConfig(16, 16, 4, 1), acc, True, False, out,
                         False, None, None, True)


@pytest.mark.parametrize("form", ["all", "runtime"])
def test_direct_launches_through_the_kept_kernel(monkeypatch, form: str):
    """The first launch of a specialisation goes through the JIT and keeps its compiled kernel; later ones (a new
    plan for the same shapes too) through the kept kernel, with the constexprs where the launcher takes them; a q
    of another 16-byte alignment (which Triton specialises on) goes through the JIT again; released, a launch runs
    with each call's own tensors."""
    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    jit = _Jit(form)
    monkeypatch.setattr(rt, "_ring_kernel", jit)
    monkeypatch.setattr(rt, "direct_launch_ok", lambda device: True)
    monkeypatch.setattr(rt, "_HANDLES", {})
    q = torch.randn(16, 4, 16)
    acc = (torch.empty(16, 4, 16), torch.empty(16, 4))
    out = torch.empty(16, 4, 16)
    k = v = torch.randn(8, 2, 16)
    launch = _step(rt, q, acc, out).release()
    assert launch.q is None and launch.acc is None and launch.out is None
    with pytest.raises(ValueError):
        launch(k, v)  # released: only with a call's tensors
    launch.run(k, v, q, acc, out)
    launch.run(k, v, torch.randn(16, 4, 16), (torch.empty(16, 4, 16), torch.empty(16, 4)), torch.empty(16, 4, 16))
    _step(rt, q, acc, out).run(k, v, q, acc, out)  # a new plan, the same specialisation: the kept kernel
    n_args = jit.log[0][2]
    handle_args = n_args + (len(rt._CONSTEXPRS) if form == "all" else 0)
    assert jit.log == [("jit", (12,), n_args), ("handle", (12, 1, 1), handle_args),
                       ("handle", (12, 1, 1), handle_args)], jit.log  # 3 tile rows x 4 heads
    assert len(rt._HANDLES) == 1
    jit.log.clear()
    shifted = torch.randn(16 * 4 * 16 + 1)[1:].view(16, 4, 16)  # 4 bytes off: another alignment class
    assert shifted.data_ptr() % 16 != 0
    launch.run(k, v, shifted, acc, out)
    launch.run(k, v, shifted, acc, out)
    assert [e[0] for e in jit.log] == ["jit", "handle"] and len(rt._HANDLES) == 2, jit.log


def test_default_configs_by_sp_size(monkeypatch):
    """What the 16K runs on one H100 (2026-11-27) measured best is the default there: fuse with batchcopy at SP=4
    (chunks up to FUSE_MAX_TOKENS), hybrid with oneloop and early at SP=2 (up to HYBRID_MAX_TOKENS); elsewhere as
    before, and an unknown SP size or TANDEM_RING_KERNEL gets no SP-specific flag. `overlap` parses and prints."""
    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    from parallel.ring_attention import _first_tiles

    monkeypatch.delenv(rt.ENV, raising=False)
    base = rt.CONFIGS[128][0]
    assert rt.default_config(4096, 128, 2, True, 4) == dataclasses.replace(base, fuse=True, batchcopy=True)
    assert rt.default_config(4096, 128, 2, True, 8) == dataclasses.replace(base, fuse=True)
    assert rt.default_config(4096, 128, 2, True) == dataclasses.replace(base, fuse=True)
    assert rt.default_config(rt.HYBRID_MAX_TOKENS, 128, 2, True, 2) == dataclasses.replace(base, hybrid=True,
                                                                                           oneloop=True, early=True)
    assert rt.default_config(rt.HYBRID_MAX_TOKENS + 1, 128, 2, True, 2) == base
    assert rt.default_config(16384, 128, 2, True, 4) == base
    assert rt.default_config(rt.HYBRID_MAX_TOKENS, 128, 2, True, 1) == base
    monkeypatch.setenv(rt.ENV, "64,64,4,2,pack")
    assert rt.default_config(4096, 128, 2, True, 2) == rt.RingConfig(64, 64, 4, 2, True)
    first = rt.RingConfig.parse("128,128,8,3,pack,fuse,batchcopy,first=64/8/4")
    assert first.first == (64, 8, 4) and rt.RingConfig.parse(str(first)) == first
    first_m = rt.RingConfig.parse("128,128,8,3,pack,fuse,batchcopy,first=64/4/2/64")
    assert first_m.first == (64, 4, 2, 64) and rt.RingConfig.parse(str(first_m)) == first_m
    # the first launch's BLOCK_M and rows per tile: 64 / G; none where it is the config's or would pack fewer heads
    assert _first_tiles(first_m, 32, 8) == (64, 16) and _first_tiles(first, 32, 8) == (0, 0)
    assert _first_tiles(rt.RingConfig.parse("128,128,8,3,pack,first=64/4/2/128"), 32, 8) == (0, 0)
    assert _first_tiles(rt.RingConfig.parse("128,128,8,3,pack,first=64/4/2/16"), 32, 1) == (0, 0)  # G = 32 > 16
    assert _first_tiles(rt.RingConfig.parse("128,128,8,3,first=64/4/2/64"), 32, 8) == (64, 64)  # unpacked
    for bad in ("128,128,8,3,first=48/8/3", "128,128,8,3,first=64/8", "128,128,8,3,first=64/8/3/48",
                "128,128,8,3,first=64/8/3/8", "128,128,8,3,first=64/8/3/64/1"):
        with pytest.raises(ValueError):
            rt.RingConfig.parse(bad)
    band = rt.RingConfig.parse("128,128,8,3,pack,fuse,batchcopy,hband=2")
    assert band.hband == 2 and str(band).endswith(",hband=2") and rt.RingConfig.parse(str(band)) == band
    with pytest.raises(ValueError):
        rt.RingConfig.parse("128,128,8,3,hband=x")
    plain = rt.RingConfig.parse("128,128,8,3,pack,fuse,batchcopy,oneloop0,plain0")
    assert plain.plain0 and plain.oneloop0 and not plain.oneloop and rt.RingConfig.parse(str(plain)) == plain
    over = rt.RingConfig.parse("128,128,8,3,pack,fuse,batchcopy,overlap")
    assert over.overlap and not base.overlap and str(over).endswith(",batchcopy,overlap")
    assert rt.RingConfig.parse(str(over)) == over
    with pytest.raises(ValueError):
        rt.RingConfig.parse("128,128,8,3,overlap,overlap")
    first = rt.RingConfig.parse("128,128,8,3,pack,fuse,oneloop0")
    assert first.oneloop0 and not first.oneloop and rt.RingConfig.parse(str(first)) == first


TRIM_SCRIPT = r'''
import torch
from parallel import ring_attention as ra
from parallel.kernels import ring_attention_triton as rt
from parallel.ring_attention import TokenShard, _RingSteps, attention_with_lse, ring_rank_attention, split_for_ranks
from workers.sp_plan import owned_positions

D = 16
S = D ** -0.5
torch.manual_seed(0)
checked = 0


def causal(q, k, v, qp, kp):
    return attention_with_lse(q.float(), k.float(), v.float(), S, qp[:, None] >= kp[None, :])[0]


# RingConfig.trim0: the first launch over the own keys from row R on, the own block's first R rows scattered with the
# other ranks' blocks into the fused launch's buffer; every rank exact against dense causal attention, call after call
# (a second "layer" through the kept plan), the rows no first-launch program writes set once (LSE -inf, output 0).
for sp, n, cfg in ((4, 256, "16,16,4,1,fuse,batchcopy,trim0"), (3, 257, "16,16,4,1,fuse,batchcopy,trim0"),
                   (4, 300, "32,16,4,1,pack,fuse,batchcopy,oneloop0,plain0,trim0"),
                   (4, 264, "16,16,4,1,fuse,batchcopy,overlap,trim0")):
    positions = [owned_positions(0, n, r, sp, 4) for r in range(sp)]
    layers = [tuple(torch.randn(n, h, D) for h in (4, 2, 2)) for _ in range(2)]
    parts = [split_for_ranks(q, k, v, positions) for q, k, v in layers]
    shards = parts[0][2]
    for r in range(sp):
        srcs = [(r - s) % sp for s in range(sp)]
        for li, part in enumerate(parts):
            if li and r:  # the second "layer" through the kept plan: rank 0 of each config (the interpreter is slow)
                continue
            qs, blocks, _ = part
            steps = _RingSteps(qs[r], blocks[r], shards[r], [shards[s] for s in srcs], S, None, True, cfg)
            rows = rt.rows_per_tile(steps.config, 4, 2)
            trim = steps.plan.trim
            assert trim == shards[r].num_tokens // rt.TRIM0_SHARE // rows * rows and trim > 0, (sp, cfg, r, trim)
            assert steps.plan.fused_tokens == n - shards[r].num_tokens + trim
            first_key = shards[r].positions[0][trim]
            unseen = sum(p < first_key for p in shards[r].positions[0])
            assert unseen > 0 and int(steps.tables[0][0][:, 0].min()) == unseen, (sp, cfg, r)
            for s, src in enumerate(srcs):
                steps.step(s, blocks[src])
            got = steps.result()
            assert torch.isneginf(steps.acc[1][:unseen]).all() and (steps.acc[0][:unseen] == 0).all()
            q, k, v = layers[li]
            pos = torch.arange(n)
            want = causal(q, k, v, pos, pos)[positions[r]]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str((sp, cfg, r, li)))
            if not (li or r):  # the public entry point, bitwise the same: once per config
                again = ring_rank_attention(qs[r], blocks, shards, r, S, "triton", kernel_config=cfg)
                torch.testing.assert_close(again, got, rtol=0, atol=0)
            checked += 1
        # The planned scatter (ScatterLaunch, the own block its last source) and the per-call fallback agree bitwise.
        buf = torch.empty_like(steps.plan.kv)
        ra._scatter_all(buf, [blocks[s] for s in srcs[1:]] + [blocks[r]], steps.plan.dst)
        assert torch.equal(buf, steps.plan.kv), (sp, cfg, r)

# Where trim0 does not apply: no batchcopy, two sequences on the rank, or a chunk too short for a whole query tile.
for cfg, seqs, n in (("16,16,4,1,fuse,trim0", 1, 256), ("16,16,4,1,fuse,batchcopy,trim0", 2, 128),
                     ("16,16,4,1,fuse,batchcopy,trim0", 1, 100)):
    sp = 4
    pos = [[p for b in range(seqs) for p in owned_positions(0, n, r, sp, 4)] for r in range(sp)]
    shards = [TokenShard([owned_positions(0, n, r, sp, 4)] * seqs) for r in range(sp)]
    rows = sum(len(x) for x in shards[0].positions)
    q = torch.randn(rows, 4, D)
    block = torch.randn(2, rows, 2, D)
    steps = _RingSteps(q, block, shards[0], [shards[s] for s in (0, 3, 2, 1)], S, None, True, cfg)
    assert steps.plan.trim == 0, (cfg, seqs, n)
    checked += 1
print("ok", checked)
'''


@pytest.mark.interpreted(TRIM_SCRIPT, timeout=900)
def test_trimmed_first_launch_in_the_triton_interpreter():
    out = run_interpreted(TRIM_SCRIPT)
    assert out.strip().split()[-2:] == ["ok", str((4 + 3 + 4 + 4) + 4 + 3)], out[-800:]


def test_plain_loads_for_the_first_launch_only(monkeypatch):
    """RingConfig.plain0: where K/V can be read by TMA, the ring's first launch is planned with plain loads (no tensor
    descriptors on the host's way to it) and the later ones with TMA; without plain0 every launch uses TMA."""
    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    from parallel.ring_attention import _RingSteps, split_for_ranks
    from workers.sp_plan import owned_positions

    monkeypatch.setattr(rt, "tma_ok_block", lambda block: True)  # as a Hopper GPU would answer (planning only)
    n, sp = 64, 4
    positions = [owned_positions(0, n, r, sp, 4) for r in range(sp)]
    qs, blocks, shards = split_for_ranks(*(torch.randn(n, h, 16) for h in (4, 2, 2)), positions)
    srcs = [(1 - s) % sp for s in range(sp)]
    for cfg, first_tma in (("16,16,4,1,fuse,batchcopy,plain0", False), ("16,16,4,1,fuse,batchcopy", True),
                           ("16,16,4,1,pack,plain0", False)):
        steps = _RingSteps(qs[1], blocks[1], shards[1], [shards[s] for s in srcs], 0.25, None, True, cfg)
        assert steps.tma
        kinds = [steps._launch(i).kw["TMA"] for i in range(steps.n_launch)]
        assert kinds == [first_tma] + [True] * (steps.n_launch - 1), (cfg, kinds)


def test_tma_check_of_a_block():
    """`tma_ok_block` answers as `tma_ok` over the block's K and V (no TMA off CUDA; a strided block falls back)."""
    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    block = torch.randn(2, 8, 2, 16)
    assert rt.tma_ok_block(block) is False and rt.tma_ok_block(block[:, ::2]) == rt.tma_ok(block[0, ::2], block[1, ::2])


def test_scatter_launches_through_the_kept_kernel(monkeypatch):
    """`scatter_blocks` (a fused or hybrid ring's copy between two attention launches): the first launch of a
    specialisation through the JIT, later ones through the kept kernel with the same arguments and BLOCK; another
    alignment of a source through the JIT again; TANDEM_RING_DIRECT=0 always the JIT."""
    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    from parallel.kernels.direct_launch import Handles

    jit = _Jit()
    monkeypatch.setattr(rt, "_scatter_kernel", jit)
    monkeypatch.setattr(rt, "direct_launch_ok", lambda device: rt.os.environ.get(rt.DIRECT_ENV) != "0")
    monkeypatch.setattr(rt, "_SCATTER_HANDLES", Handles())
    monkeypatch.delenv(rt.DIRECT_ENV, raising=False)
    buf = torch.zeros(2, 12, 2, 16)
    blocks = [torch.randn(2, 4, 2, 16) for _ in range(3)]
    runs = [(1, torch.arange(4) * 3 + j) for j in range(3)]
    for _ in range(3):
        rt.scatter_blocks(buf, blocks, runs)
    n_args = jit.log[0][2]
    grid = (4, 2 * rt.SCATTER_SOURCES, 1)
    assert jit.log == [("jit", grid, n_args)] + [("handle", grid, n_args + 1)] * 2, jit.log
    jit.log.clear()
    odd = torch.randn(2 * 4 * 2 * 16 + 2)[2:].view(2, 4, 2, 16)  # 8 bytes off 16-byte alignment
    rt.scatter_blocks(buf, [odd] + blocks[1:], runs)
    monkeypatch.setenv(rt.DIRECT_ENV, "0")
    rt.scatter_blocks(buf, blocks, runs)
    assert [e[0] for e in jit.log] == ["jit", "jit"], jit.log


SCATTER_PLAN_SCRIPT = r'''
import torch
from parallel.kernels import ring_attention_triton as rt
from parallel.ring_attention import TokenShard, _fused_layout
from workers.sp_plan import owned_positions

checked = 0
# A planned scatter (ScatterLaunch) against scatter_blocks, bitwise, twice (new blocks each time): SP=3, 4 and 8 (three
# launches of up to three blocks), 4- and 2-token runs, and a 6-token prompt at SP=4 whose ranks 2 and 3 hold nothing.
for n, sp, bs in ((45, 3, 4), (64, 4, 4), (100, 8, 2), (6, 4, 4)):
    shards = [TokenShard([owned_positions(0, n, r, sp, bs)]) for r in range(sp)]
    fused, dst = _fused_layout(shards[0], shards[1:], torch.device("cpu"))
    planned = torch.full((2, fused.num_tokens, 2, 16), float("nan"))
    scatter = rt.ScatterLaunch(planned, dst, [s.num_tokens for s in shards[1:]])
    for _ in range(2):
        keys = torch.randn(n, 2, 16)
        blocks = [torch.stack([keys[s.positions[0]], -keys[s.positions[0]]]) for s in shards]
        want = torch.zeros(2, fused.num_tokens, 2, 16)
        used = [(b, d) for b, d in zip(blocks[1:], dst) if b.shape[1]]
        rt.scatter_blocks(want, [b for b, _ in used], [d for _, d in used])
        assert scatter(blocks[1:]) is True
        assert torch.equal(planned, want), (n, sp)
        assert torch.equal(planned[0], keys[fused.positions[0]]), (n, sp)
        checked += 1
    # Blocks it was not planned for launch nothing: one row too many, or strided (every block of the right size).
    before = planned.clone()
    wrong = [torch.randn(2, s.num_tokens + 1, 2, 16) for s in shards[1:]]
    strided = [torch.randn(2, s.num_tokens, 4, 16)[:, :, ::2] for s in shards[1:]]
    assert scatter(wrong) is False and scatter(strided[:1] + blocks[2:]) is False, (n, sp)
    assert torch.equal(planned, before), (n, sp)
print("ok", checked)
'''


@pytest.mark.interpreted(SCATTER_PLAN_SCRIPT, timeout=900)
def test_planned_scatter_in_the_triton_interpreter():
    """`ScatterLaunch` (a fused or hybrid ring's one scatter, planned with its kept buffer) copies what
    `scatter_blocks` does, bitwise, call after call; blocks of other sizes launch nothing."""
    out = run_interpreted(SCATTER_PLAN_SCRIPT)
    assert out.strip().split()[-2:] == ["ok", "8"], out[-800:]


def test_planned_scatter_through_the_kept_kernel(monkeypatch):
    """`ScatterLaunch` on the handle path: the first call through the JIT (keeping the compiled kernel), later ones
    through a runner for its fixed 3-D grid with BLOCK after the runtime arguments; a source of another 16-byte
    alignment through the JIT again."""
    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    jit = _Jit()
    monkeypatch.setattr(rt, "_scatter_kernel", jit)
    monkeypatch.setattr(rt, "direct_launch_ok", lambda device: True)
    monkeypatch.setattr(rt, "_SCATTER_KERNELS", {})
    buf = torch.zeros(2, 12, 2, 16)
    runs = [(1, torch.arange(4) * 3 + j) for j in range(3)]
    scatter = rt.ScatterLaunch(buf, runs, [4, 4, 4])
    blocks = [torch.randn(2, 4, 2, 16) for _ in range(3)]
    for _ in range(3):
        assert scatter(blocks)
    n_args = jit.log[0][2]
    grid = (4, 2 * rt.SCATTER_SOURCES, 1)
    assert jit.log == [("jit", grid, n_args)] + [("handle", grid, n_args + 1)] * 2, jit.log
    jit.log.clear()
    odd = torch.randn(2 * 4 * 2 * 16 + 2)[2:].view(2, 4, 2, 16)  # 8 bytes off 16-byte alignment
    assert scatter([odd] + blocks[1:]) and scatter([odd] + blocks[1:])
    assert [e[0] for e in jit.log] == ["jit", "handle"] and len(rt._SCATTER_KERNELS) == 2, jit.log
