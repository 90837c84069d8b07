"""The Triton ring-attention step (parallel/kernels/ring_attention_triton.py) on CPU, through Triton's
interpreter (TRITON_INTERPRET=1, in a subprocess since it must be set before the kernels are defined),
against the dense fp32 reference `attention_with_lse`: causal diagonal, fully visible, fully masked,
rows that see nothing beside rows that do, the SP layout's interleaved positions, non-causal, GQA/MQA,
lengths that are not a multiple of the tiles, fp32 and fp16, plain and TMA loads, the in-place merge;
then one SP rank's whole ring (`ring_rank_attention`, backend="triton") for SP=2 and 4 against full causal
attention; split-K (pieces of a key range merged by LSE) through the same kinds of cases and rings. bf16 is
left to tests/gpu/test_ring_attention_triton.py: the interpreter's tl.dot mis-reads bf16 (a plain bf16 dot
of 16 x 16 comes back ~1e10). Shapes stay tiny: the interpreter runs every program in Python."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
from parallel.kernels import ring_attention_triton as rt
from parallel.ring_attention import attention_with_lse, merge_into, ring_rank_attention, split_for_ranks
from workers.sp_plan import owned_positions

D = 16
S = D ** -0.5
torch.manual_seed(0)


def dense(q, k, v, qp, kp):
    mask = None if qp is None else qp[:, None] >= kp[None, :]
    return attention_with_lse(q.float(), k.float(), v.float(), S, mask)


def same(out, lse, ref, tol, what):
    ref_out, ref_lse = ref
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead), what
    assert (out[dead] == 0).all(), what
    torch.testing.assert_close(out.float(), ref_out, rtol=tol, atol=tol, msg=what)
    torch.testing.assert_close(lse[~dead], ref_lse[~dead], rtol=tol, atol=tol, msg=what)


ar = torch.arange
layout = [torch.tensor(owned_positions(0, 80, r, 2, 4)) for r in range(2)]  # SP=2, 4-token blocks: 40 each
CASES = [  # name, Hq, Hkv, Tq, Tk, q positions, k positions
    ("diagonal", 4, 2, 37, 37, ar(37), ar(37)),
    ("sp layout, rank 1 queries x rank 0 keys", 3, 1, 40, 40, layout[1], layout[0]),
    ("sp layout, rank 0 queries x rank 1 keys", 4, 4, 40, 40, layout[0], layout[1]),
    ("fully visible", 4, 2, 20, 33, ar(20) + 100, ar(33)),
    ("fully masked", 4, 2, 10, 24, ar(10), ar(24) + 50),
    ("some rows see nothing", 2, 1, 30, 20, ar(30), ar(20) + 10),
    ("non-causal", 4, 1, 29, 45, None, None),
]
launches = 0
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
    for name, hq, hkv, tq, tk, qp, kp in CASES:
        q = torch.randn(tq, hq, D).to(dtype)
        k, v = (torch.randn(tk, hkv, D).to(dtype) for _ in range(2))
        ref = dense(q, k, v, qp, kp)
        # oneloop: the masked key tiles in the unmasked tiles' loop (a branch per tile): the same results.
        for tiles, tma in (((16, 16, 4, 1), False), (None, False), ((16, 16, 4, 1), True),
                           (rt.RingConfig.parse("16,16,4,1,oneloop"), False),
                           (rt.RingConfig.parse("32,16,4,1,pack,oneloop"), True)):
            if dtype != torch.float32 and tma:
                continue
            out, lse = rt.chunk_attention(q, k, v, S, qp, kp, tiles=tiles, tma=tma)
            launches += 1
            assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:2]
            same(out, lse, ref, tol, (name, dtype, tiles, tma))
        out, _ = rt.chunk_attention(q, k, v, S, qp, kp, out_dtype=dtype, tiles=(16, 16, 4, 1))
        assert out.dtype == dtype
        same(out, lse, ref, tol, (name, dtype, "out_dtype"))

# The in-place merge: keys split in two parts (the second also wholly in the future of every query, which
# must leave the accumulators bit for bit), merged into the first part's result, equals attention over all.
q, k, v = torch.randn(37, 4, D), torch.randn(45, 2, D), torch.randn(45, 2, D)
qp, kp = ar(37) + 8, ar(45)
for lo, hi in ((0, 20), (5, 45)):
    part = ar(45)[(ar(45) < lo) | (ar(45) >= hi)], ar(lo, hi)
    acc_out, acc_lse = rt.chunk_attention(q, k[part[0]], v[part[0]], S, qp, kp[part[0]], tiles=(16, 16, 4, 1))
    want_out, want_lse = acc_out.clone(), acc_lse.clone()
    rt.chunk_attention_merge_(acc_out, acc_lse, q, k[part[1]], v[part[1]], S, qp, kp[part[1]], tiles=(16, 16, 4, 1))
    o, l = dense(q, k[part[1]], v[part[1]], qp, kp[part[1]])
    merge_into(want_out, want_lse, o, l)
    same(acc_out, acc_lse, (want_out, want_lse), 1e-5, ("merge", lo, hi))
    same(acc_out, acc_lse, dense(q, k, v, qp, kp), 1e-5, ("merge vs all", lo, hi))
before = acc_out.clone(), acc_lse.clone()
rt.chunk_attention_merge_(acc_out, acc_lse, q, k, v, S, qp, kp + 1000, tiles=(16, 16, 4, 1))
assert torch.equal(acc_out, before[0]) and torch.equal(acc_lse, before[1])

# One rank's whole ring through the kernel: SP=2 and 4, the block-owned layout of a 45-token prompt.
n = 45
q, k, v = torch.randn(n, 4, D), torch.randn(n, 2, D), torch.randn(n, 2, D)
full, _ = dense(q, k, v, ar(n), ar(n))
for sp in (2, 4):
    positions = [owned_positions(0, n, r, sp, 4) for r in range(sp)]
    qs, blocks, shards = split_for_ranks(q, k, v, positions)
    for r in range(sp):
        out = ring_rank_attention(qs[r], blocks, shards, r, S, backend="triton")
        torch.testing.assert_close(out, full[positions[r]], rtol=1e-5, atol=1e-5, msg=("rank", sp, r))
        launches += sp
print("ok", launches)
'''


# The ring's own launches (`_RingSteps`: one launch per step over a tile table; the first step writes the
# accumulators, the last writes the output; a ring of one writes the output directly), with and without GQA
# packing, tiles that straddle the layout's blocks, a ragged batch in one launch, empty key blocks.
RING_SCRIPT = r'''
import torch
from parallel.ring_attention import (TokenShard, _RingSteps, attention_by_positions, attention_with_lse,
                                     ring_rank_attention, split_for_ranks)
from workers.sp_plan import owned_positions

D = 16
S = D ** -0.5
torch.manual_seed(0)
checked = 0
# packed: 4 query rows x G=4 heads; 16 x 4. early: each step starts from the accumulators (no merge after).
# fuse: with 3+ ranks the steps after the first are one launch over the other blocks in position order.
# oneloop: a program's masked key tiles in its one loop (a branch on the tile), not a second loop. batchcopy: the
# fused step's blocks copied into position order in one launch at the last step, not each as it arrives.
CONFIGS = ["16,16,4,1", "16,16,4,1,pack", "64,32,4,1,pack", "16,16,4,1,early", "32,16,4,1,pack,early",
           "32,16,4,1,pack,fuse", "16,16,4,1,fuse,early", "32,16,4,1,pack,oneloop",
           "16,16,4,1,oneloop,early,fuse,batchcopy"]
FUSED = [c for c in CONFIGS if "fuse" in c]


def causal(q, k, v, qp=None, kp=None):
    qp = torch.arange(q.shape[0]) if qp is None else torch.as_tensor(qp)
    kp = torch.arange(k.shape[0]) if kp is None else torch.as_tensor(kp)
    return attention_with_lse(q.float(), k.float(), v.float(), S, qp[:, None] >= kp[None, :])[0]


# 1. One rank's whole ring of a 45-token prompt (SP=2 and 4, 4-token blocks) and of a 6-token one at SP=4
# (ranks 2 and 3 hold nothing: empty key blocks in the ring), against dense causal attention.
for dtype, tol, hq, hkv, cfgs, lengths in (
        (torch.float32, 1e-5, 4, 1, CONFIGS, ((45, (2, 4)), (6, (4,)))),
        (torch.float32, 1e-5, 4, 2, CONFIGS, ((45, (2,)),)),
        (torch.float16, 1e-2, 4, 1, CONFIGS[1:2] + CONFIGS[4:], ((45, (2, 4)), (6, (4,))))):
    for n, sps in lengths:
        q, k, v = (torch.randn(n, h, D).to(dtype) for h in (hq, hkv, hkv))
        full = causal(q, k, v)
        for sp in sps:
            positions = [owned_positions(0, n, r, sp, 4) for r in range(sp)]
            qs, blocks, shards = split_for_ranks(q, k, v, positions)
            for cfg in cfgs:
                for r in range(sp):
                    out = ring_rank_attention(qs[r], blocks, shards, r, S, backend="triton", kernel_config=cfg)
                    assert out.dtype == dtype and out.shape == qs[r].shape
                    torch.testing.assert_close(out.float(), full[positions[r]], rtol=tol, atol=tol,
                                               msg=str((dtype, hq, hkv, n, sp, cfg, r)))
                    checked += 1

# 2. A ragged batch, one launch per step: a fresh 30-token prompt; the last 19 tokens of a 40-token prompt
# over all 40 keys (queries and keys different token sets); a 3-token prompt of which rank 1 holds nothing.
lens, hq, hkv = (30, 40, 3), 4, 2
qf, kf, vf = ([torch.randn(n, h, D) for n in lens] for h in (hq, hkv, hkv))
want = [causal(qf[b], kf[b], vf[b]) for b in range(3)]


def ragged_layout(sp):
    """The ragged batch's query shards, key shards and K/V blocks of each rank at this SP size."""
    q_shards = [TokenShard([owned_positions(lo, n, r, sp, 4) for lo, n in ((0, 30), (21, 40), (0, 3))])
                for r in range(sp)]
    kv_shards = [TokenShard([owned_positions(0, n, r, sp, 4) for n in lens]) for r in range(sp)]
    blocks = [torch.stack([torch.cat([x[b][p] for b, p in enumerate(kv.positions)]) for x in (kf, vf)])
              for kv in kv_shards]
    return q_shards, kv_shards, blocks


def ragged_ring(cfg, sp, layout, check=lambda steps: None):
    """Every rank's ring over the ragged batch with `cfg`, against causal attention per sequence; `check(steps)`
    asserts on each rank's launch plan before it runs. Returns the number of ranks checked."""
    q_shards, kv_shards, blocks = layout
    for r in range(sp):
        q = torch.cat([qf[b][p] for b, p in enumerate(q_shards[r].positions)])
        steps = _RingSteps(q, blocks[r], q_shards[r], [kv_shards[(r - s) % sp] for s in range(sp)], S, None, True, cfg)
        check(steps)
        for s in range(sp):
            steps.step(s, blocks[(r - s) % sp])
        ref = torch.cat([want[b][p] for b, p in enumerate(q_shards[r].positions)])
        torch.testing.assert_close(steps.result(), ref, rtol=1e-5, atol=1e-5, msg=str((cfg, sp, r)))
    return sp


def check_fused(steps):
    assert steps.fused and len(steps.tables) == 2


def check_gather(steps):
    assert steps.fused and len(steps.tables) == 1 and steps.acc is None


def check_hybrid(steps):
    assert steps.hybrid and not steps.fused and len(steps.tables) == 3


def assert_banded(steps):
    assert steps.config.hband == 1 and not (steps.fused or steps.hybrid), steps.config


layout2 = ragged_layout(2)
for cfg in CONFIGS:
    checked += ragged_ring(cfg, 2, layout2)

# 2b. The same ragged batch at SP=3, fused: each sequence's other-rank keys scattered into one position-ordered
# buffer (a 3-token prompt of which ranks 1 and 2 hold nothing), one launch after the own block's.
layout3 = ragged_layout(3)
for cfg in FUSED:
    checked += ragged_ring(cfg, 3, layout3, check_fused)

# 2c. gather: every block, the own one too, scattered into one position-ordered buffer and one launch in all, no
# accumulators (the same ragged batch at SP=2 and 3; at SP=3 ranks 1 and 2 hold nothing of the 3-token prompt).
GATHER = ["32,16,4,1,pack,gather", "16,16,4,1,gather,early"]
for sp, layout in ((2, layout2), (3, layout3)):
    for cfg in GATHER:
        checked += ragged_ring(cfg, sp, layout, check_gather)

# 2d. hybrid (SP=2): the own block for the first head groups, then both blocks in position order for the others and
# the other block for the first ones, merged: the ragged batch, and a 45-token prompt with 4 and 8 query heads.
HYBRID = ["32,16,4,1,pack,hybrid", "16,16,4,1,hybrid,oneloop,early"]
sp = 2
for cfg in HYBRID:
    checked += ragged_ring(cfg, 2, layout2, check_hybrid)
for hq in (4, 8):
    q, k, v = torch.randn(45, hq, D), torch.randn(45, 2, D), torch.randn(45, 2, D)
    positions = [owned_positions(0, 45, r, sp, 4) for r in range(sp)]
    qs, blocks, shards = split_for_ranks(q, k, v, positions)
    for cfg in HYBRID:
        for r in range(sp):
            out = ring_rank_attention(qs[r], blocks, shards, r, S, backend="triton", kernel_config=cfg)
            torch.testing.assert_close(out, causal(q, k, v)[positions[r]], rtol=1e-5, atol=1e-5, msg=str((hq, cfg, r)))
            checked += 1

# 2e. hband: the head groups one band at a time (4 query heads over 2 KV heads: 4 groups unpacked, 2 packed), and the
# default config of a long chunk whose K/V block outgrows L2 (here an L2 of one byte, fuse and hybrid off), which
# bands them one at a time.
for cfg in ("16,16,4,1,hband=1", "16,16,4,1,hband=2", "32,16,4,1,pack,hband=1"):
    checked += ragged_ring(cfg, 2, layout2)
from parallel.kernels import ring_attention_triton as rt
saved = rt.l2_bytes, rt.FUSE_MAX_TOKENS, rt.HYBRID_MAX_TOKENS
rt.l2_bytes, rt.FUSE_MAX_TOKENS, rt.HYBRID_MAX_TOKENS = (lambda device: 1), 0, 0
for sp, layout in ((2, layout2), (3, layout3)):
    checked += ragged_ring(None, sp, layout, assert_banded)
rt.l2_bytes, rt.FUSE_MAX_TOKENS, rt.HYBRID_MAX_TOKENS = saved


# 3. A ring of one (Ulysses' attention): the output straight from the kernel, no accumulators.
q, k, v = torch.randn(37, 4, D), torch.randn(37, 1, D), torch.randn(37, 1, D)
shard = TokenShard([list(range(37))])
for cfg in CONFIGS:
    steps = _RingSteps(q, torch.stack([k, v]), shard, [shard], S, None, True, cfg)
    assert steps.acc is None
    steps.step(0, torch.stack([k, v]))
    torch.testing.assert_close(steps.result(), causal(q, k, v), rtol=1e-5, atol=1e-5)
    checked += 1
out = attention_by_positions(q, torch.stack([k, v]), shard, shard, S, use_triton=True)
torch.testing.assert_close(out, causal(q, k, v), rtol=1e-5, atol=1e-5)
checked += 1

# 4. `ring_attention` itself on the kernel, its exchange replaced by one that hands each step the block the
# previous rank would have sent: SP=3 of a 45-token prompt, packed.
import types
import parallel.ring_attention as ring_mod

n, sp = 45, 3
q, k, v = torch.randn(n, 4, D), torch.randn(n, 2, D), torch.randn(n, 2, D)
positions = [owned_positions(0, n, r, sp, 4) for r in range(sp)]
qs, blocks, shards = split_for_ranks(q, k, v, positions)
full = causal(q, k, v)
ring_mod.triton_is_default = lambda q, block: True
os_env = __import__("os").environ
for r, env in [(r, env) for env in ("16,16,4,1,pack", "16,16,4,1,pack,fuse", "16,16,4,1,pack,gather")
               for r in range(sp)]:
    os_env["TANDEM_RING_KERNEL"] = env  # fuse: every exchange issued before the first step, each sending the last
    held = [r]

    class Exchange:
        def __init__(self, group, send, recv_tokens):
            assert torch.equal(send, blocks[held[-1]])
            held.append((held[-1] - 1) % sp)
            self.recv = blocks[held[-1]]
            assert self.recv.shape[1] == recv_tokens
            log.append("exchange")

        def wait(self, stream=None):
            assert stream is None  # RingConfig.overlap's side stream is CUDA's only
            return self.recv

    log = []
    step = ring_mod._RingSteps.step
    ring_mod._RingSteps.step = lambda self, i, block: (log.append("step"), step(self, i, block))[1]
    ring_mod._RingExchange = Exchange
    out = ring_mod.ring_attention(qs[r], blocks[r][0], blocks[r][1], shards[r], shards, S,
                                  types.SimpleNamespace(size=sp, rank=r))
    ring_mod._RingSteps.step = step
    assert held == [r, (r - 1) % sp, (r - 2) % sp]
    # Fused, no exchange may be issued after the first step's kernel (NCCL's stream would wait for it).
    assert log == (["exchange"] * 2 + ["step"] * 3 if "fuse" in env or "gather" in env
                   else ["exchange", "step"] * 2 + ["step"]), log
    torch.testing.assert_close(out, full[positions[r]], rtol=1e-5, atol=1e-5)
    checked += 1

# SP=2 with the default config (no TANDEM_RING_KERNEL): hybrid, oneloop and early for short chunks, through
# ring_attention's exchange (the own block's launch, then the received block's scatter and two launches).
del os_env["TANDEM_RING_KERNEL"]
sp = 2
positions = [owned_positions(0, n, r, sp, 4) for r in range(sp)]
qs, blocks, shards = split_for_ranks(q, k, v, positions)
for r in range(sp):
    class Exchange2:
        def __init__(self, group, send, recv_tokens):
            assert torch.equal(send, blocks[r])
            self.recv = blocks[1 - r]

        def wait(self, stream=None):
            assert stream is None
            return self.recv

    ring_mod._RingExchange = Exchange2
    seen = []
    run = ring_mod._RingSteps._run
    ring_mod._RingSteps._run = lambda self, i, block: (seen.append((self.config.hybrid, self.config.early, i)),
                                                       run(self, i, block))[1]
    out = ring_mod.ring_attention(qs[r], blocks[r][0], blocks[r][1], shards[r], shards, S,
                                  types.SimpleNamespace(size=sp, rank=r))
    ring_mod._RingSteps._run = run
    assert seen == [(True, True, 0), (True, True, 1), (True, True, 2)], seen
    torch.testing.assert_close(out, full[positions[r]], rtol=1e-5, atol=1e-5)
    checked += 1
print("ok", checked)
'''


# Split-K: a query tile's key range cut into pieces (one program each, partials merged by LSE in a second
# launch, then finished as an unsplit step: written, merged in place, or the output). Every case checks that
# the table did split (else it would only re-test the unsplit kernel).
SPLIT_SCRIPT = r'''
import torch
from parallel.kernels import ring_attention_triton as rt
from parallel.ring_attention import TokenShard, _RingSteps, attention_with_lse, ring_rank_attention, split_for_ranks
from workers.sp_plan import owned_positions

D = 16
S = D ** -0.5
torch.manual_seed(1)
checked = 0
ar = torch.arange


def dense(q, k, v, qp, kp):
    mask = None if qp is None else qp[:, None] >= kp[None, :]
    return attention_with_lse(q.float(), k.float(), v.float(), S, mask)


def same(out, lse, ref, tol, what):
    dead = torch.isneginf(ref[1])
    assert torch.equal(torch.isneginf(lse), dead), what
    assert (out[dead] == 0).all(), what
    torch.testing.assert_close(out.float(), ref[0], rtol=tol, atol=tol, msg=what)
    torch.testing.assert_close(lse[~dead], ref[1][~dead], rtol=tol, atol=tol, msg=what)


def splits_happen(qp, kp, tq, tk, cfg, hq, hkv):
    # Whether chunk_attention under cfg splits some row (as _launch decides): each case must test a split.
    rows = rt.rows_per_tile(cfg, hq, hkv)
    table = rt._device_tiles(None if qp is None else qp.to(torch.int32), None if kp is None else kp.to(torch.int32),
                             tq, tk, rows, torch.device("cpu")).numpy()
    return bool((rt.split_counts(table, cfg.block_n, 1, 1, cfg.splits) > 1).any())


layout = [torch.tensor(owned_positions(0, 96, r, 2, 4)) for r in range(2)]
CASES = [  # name, Hq, Hkv, Tq, Tk, q positions, k positions: several key tiles per query tile, so pieces exist
    ("diagonal", 4, 2, 37, 61, ar(37) + 24, ar(61)),
    ("sp layout, rank 1 queries x rank 0 keys", 3, 1, 48, 48, layout[1], layout[0]),
    ("fully visible", 4, 4, 20, 53, ar(20) + 100, ar(53)),
    ("some rows see nothing", 2, 1, 30, 50, ar(30) + 20, ar(50) + 25),
    ("non-causal, uneven", 4, 1, 29, 45, None, None),
]
for name, hq, hkv, tq, tk, qp, kp in CASES:
    q = torch.randn(tq, hq, D)
    k, v = (torch.randn(tk, hkv, D) for _ in range(2))
    ref = dense(q, k, v, qp, kp)
    for cfg, tma in (("16,16,4,1,split=2", False), ("16,16,4,1,split=3", True), ("32,16,4,1,pack,split=4", False)):
        cfg = rt.RingConfig.parse(cfg)
        assert splits_happen(qp, kp, tq, tk, cfg, hq, hkv), (name, str(cfg))
        out, lse = rt.chunk_attention(q, k, v, S, qp, kp, tiles=cfg, tma=tma)
        same(out, lse, ref, 1e-5, (name, str(cfg), tma))
        checked += 1
# fp16 inputs, the output in fp16 straight from the merge kernel.
q, k, v = torch.randn(37, 4, D).half(), torch.randn(61, 2, D).half(), torch.randn(61, 2, D).half()
cfg = rt.RingConfig.parse("16,16,4,1,split=2")
out, lse = rt.chunk_attention(q, k, v, S, ar(37) + 24, ar(61), out_dtype=torch.float16, tiles=cfg)
assert out.dtype == torch.float16
same(out, lse, dense(q, k, v, ar(37) + 24, ar(61)), 1e-2, "fp16")
checked += 1

# The in-place merge, split: accumulators of one part of the keys, then the other part merged in by pieces.
q, k, v = torch.randn(37, 4, D), torch.randn(70, 2, D), torch.randn(70, 2, D)
qp, kp = ar(37) + 40, ar(70)
part = ar(70)[(ar(70) < 10) | (ar(70) >= 60)], ar(10, 60)
acc_out, acc_lse = rt.chunk_attention(q, k[part[0]], v[part[0]], S, qp, kp[part[0]], tiles=(16, 16, 4, 1))
rt.chunk_attention_merge_(acc_out, acc_lse, q, k[part[1]], v[part[1]], S, qp, kp[part[1]],
                          tiles=rt.RingConfig.parse("16,16,4,1,split=3"))
same(acc_out, acc_lse, dense(q, k, v, qp, kp), 1e-5, "split merge vs all")
checked += 1

# One rank's whole ring, split: SP=2 and 4 of a 45-token prompt, GQA 4/1 and 4/2, packed and not.
n = 45
for hq, hkv in ((4, 1), (4, 2)):
    q, k, v = torch.randn(n, hq, D), torch.randn(n, hkv, D), torch.randn(n, hkv, D)
    full, _ = dense(q, k, v, ar(n), ar(n))
    for sp in (2, 4):
        positions = [owned_positions(0, n, r, sp, 4) for r in range(sp)]
        qs, blocks, shards = split_for_ranks(q, k, v, positions)
        for cfg in ("16,16,4,1,split=2", "32,16,4,1,pack,split=3", "16,16,4,1,split=2,early",
                    "32,16,4,1,pack,split=2,oneloop"):
            for r in range(sp):
                out = ring_rank_attention(qs[r], blocks, shards, r, S, backend="triton", kernel_config=cfg)
                torch.testing.assert_close(out, full[positions[r]], rtol=1e-5, atol=1e-5,
                                           msg=str((hq, hkv, sp, cfg, r)))
                checked += 1

# The automatic rule with a GPU's worth of "SMs": SP=2 of a 45-token prompt and SP=4 of a 6-token one (empty
# key blocks in the ring); pieces of one 16-key tile allowed, as the shapes are tiny.
rt.SPLIT_MIN_TILES = 1
rt.sm_count = lambda device: 132
q, k, v = torch.randn(n, 4, D), torch.randn(n, 2, D), torch.randn(n, 2, D)
for n_tok, sp in ((45, 2), (6, 4)):
    positions = [owned_positions(0, n_tok, r, sp, 4) for r in range(sp)]
    qs, blocks, shards = split_for_ranks(q[:n_tok], k[:n_tok], v[:n_tok], positions)
    want = dense(q[:n_tok], k[:n_tok], v[:n_tok], ar(n_tok), ar(n_tok))[0]
    split_seen = False
    for r in range(sp):
        srcs = [(r - s) % sp for s in range(sp)]
        steps = _RingSteps(qs[r], blocks[r], shards[r], [shards[s] for s in srcs], S, None, True, "16,16,4,1")
        split_seen |= any(t[2] > 0 for t in steps.tables)
        for i, s in enumerate(srcs):
            steps.step(i, blocks[s])
        torch.testing.assert_close(steps.result(), want[positions[r]], rtol=1e-5, atol=1e-5, msg=str((n_tok, sp, r)))
        checked += 1
    assert split_seen == (n_tok > 16), (n_tok, sp)  # 6 tokens: every key range is one tile, nothing to split

# A ring of one (Ulysses' attention), split: the merge kernel writes the output itself, no accumulators.
q, k, v = torch.randn(37, 4, D), torch.randn(37, 1, D), torch.randn(37, 1, D)
shard = TokenShard([list(range(37))])
steps = _RingSteps(q, torch.stack([k, v]), shard, [shard], S, None, True, "16,16,4,1,pack,split=2")
assert steps.acc is None and steps.tables[0][2] > 0
steps.step(0, torch.stack([k, v]))
torch.testing.assert_close(steps.result(), dense(q, k, v, ar(37), ar(37))[0], rtol=1e-5, atol=1e-5)
checked += 1

# A ragged batch in one launch per step, split: three prompts, queries a suffix of the keys in one of them.
lens, hq, hkv, sp = (30, 40, 3), 4, 2, 2
qf, kf, vf = ([torch.randn(m, h, D) for m in lens] for h in (hq, hkv, hkv))
want = [dense(qf[b], kf[b], vf[b], ar(lens[b]), ar(lens[b]))[0] for b in range(3)]
q_shards = [TokenShard([owned_positions(lo, m, r, sp, 4) for lo, m in ((0, 30), (21, 40), (0, 3))]) for r in range(sp)]
kv_shards = [TokenShard([owned_positions(0, m, r, sp, 4) for m in lens]) for r in range(sp)]
blocks = [torch.stack([torch.cat([x[b][p] for b, p in enumerate(kv.positions)]) for x in (kf, vf)]) for kv in kv_shards]
for r in range(sp):
    q = torch.cat([qf[b][p] for b, p in enumerate(q_shards[r].positions)])
    steps = _RingSteps(q, blocks[r], q_shards[r], [kv_shards[(r - s) % sp] for s in range(sp)], S, None, True,
                       "16,16,4,1,split=2")
    assert steps.tables[0][2] > 0, [t[2] for t in steps.tables]  # the first step split (writes the accumulators)
    for s in range(sp):
        steps.step(s, blocks[(r - s) % sp])
    ref = torch.cat([want[b][p] for b, p in enumerate(q_shards[r].positions)])
    torch.testing.assert_close(steps.result(), ref, rtol=1e-5, atol=1e-5, msg=str(r))
    checked += 1

# acc16: the running output kept in fp16 between steps (LSE fp32), split or not: SP=4, within fp16 tolerance.
q, k, v = (torch.randn(n, h, D).half() for h in (4, 2, 2))
full, _ = dense(q, k, v, ar(n), ar(n))
positions = [owned_positions(0, n, r, 4, 4) for r in range(4)]
qs, blocks, shards = split_for_ranks(q, k, v, positions)
for cfg in ("16,16,4,1,acc16", "32,16,4,1,pack,split=2,acc16", "32,16,4,1,pack,acc16,early"):
    for r in range(4):
        steps = _RingSteps(qs[r], blocks[r], shards[r], [shards[(r - s) % 4] for s in range(4)], S, None, True, cfg)
        assert steps.acc[0].dtype == torch.float16 and steps.acc[1].dtype == torch.float32
        for s in range(4):
            steps.step(s, blocks[(r - s) % 4])
        torch.testing.assert_close(steps.result().float(), full[positions[r]], rtol=1e-2, atol=1e-2, msg=str((cfg, r)))
        checked += 1
print("ok", checked)
'''


# The fused step's scatter in one launch per three blocks (`scatter_blocks`) against one copy per block and against
# the positions themselves (row j of the buffer holds the key at the fused shard's position j): SP=3, 4 and 8 (7
# blocks: three launches), K and V apart, blocks of different run lengths (a rank whose two layout blocks meet).
SCATTER_SCRIPT = r'''
import torch
from parallel.kernels import ring_attention_triton as rt
from parallel.ring_attention import TokenShard, _fused_layout, _scatter_runs
from workers.sp_plan import owned_positions

checked = 0
for n, sp, bs in ((45, 3, 4), (64, 4, 4), (100, 8, 2)):
    shards = [TokenShard([owned_positions(0, n, r, sp, bs)]) for r in range(sp)]
    keys = torch.randn(n, 2, 16)
    blocks = [torch.stack([keys[s.positions[0]], -keys[s.positions[0]]]) for s in shards]
    fused, dst = _fused_layout(shards[0], shards[1:], torch.device("cpu"))
    want, got = torch.zeros(2, fused.num_tokens, 2, 16), torch.full((2, fused.num_tokens, 2, 16), float("nan"))
    for block, (run, index) in zip(blocks[1:], dst):
        _scatter_runs(want, block, run, index)
    rt.scatter_blocks(got, blocks[1:], dst)
    assert torch.equal(got, want), (n, sp)
    assert torch.equal(got[0], keys[fused.positions[0]]) and torch.equal(got[1], -keys[fused.positions[0]]), (n, sp)
    checked += 1
print("ok", checked)
'''


@pytest.mark.interpreted(SCATTER_SCRIPT, timeout=900)
def test_fused_scatter_in_the_triton_interpreter():
    out = run_interpreted(SCATTER_SCRIPT)
    assert out.strip().split()[-2:] == ["ok", "3"], out[-500:]


@pytest.mark.interpreted(SCRIPT, timeout=900)
def test_ring_step_kernel_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT)
    assert out.strip().split()[-2:] == ["ok", "76"], out[-500:]


@pytest.mark.interpreted(RING_SCRIPT, timeout=900)
def test_ring_launches_in_the_triton_interpreter():
    out = run_interpreted(RING_SCRIPT)
    configs, fused, fp16, gathered, hybrid, banded = 9, 3, 6, 2 * (2 + 3), 2 * 2 + 2 * 2 * 2, 3 * 2 + 2 + 3
    assert out.strip().split()[-2:] == ["ok", str(configs * (6 + 4) + configs * 2 + fp16 * (6 + 4) + configs * 2
                                                  + fused * 3 + gathered + hybrid + banded + configs + 1 + 3 * 3 + 2)
                                        ], out[-500:]


@pytest.mark.interpreted(SPLIT_SCRIPT, timeout=900)
def test_split_k_in_the_triton_interpreter():
    out = run_interpreted(SPLIT_SCRIPT)
    assert out.strip().split()[-2:] == ["ok", str(5 * 3 + 1 + 1 + 2 * 4 * (2 + 4) + (2 + 4) + 1 + 2 + 3 * 4)], out[-500:]


def _inputs(tq=8, tk=8, hq=4, hkv=2, d=16, dtype=torch.float32):
    return torch.randn(tq, hq, d, dtype=dtype), torch.randn(tk, hkv, d, dtype=dtype), torch.randn(tk, hkv, d, dtype=dtype)


@pytest.mark.parametrize("bad", ["dtypes", "head_dim", "heads", "one_position", "position_shape", "accumulators"])
def test_bad_inputs_are_value_errors(bad: str):
    """Checked on the host before any launch, so no interpreter is needed."""
    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    q, k, v = _inputs()
    pos = torch.arange(8)
    call = {
        "dtypes": lambda: rt.chunk_attention(q.half(), k, v, 0.25),
        "head_dim": lambda: rt.chunk_attention(*_inputs(d=24), 0.25),
        "heads": lambda: rt.chunk_attention(*_inputs(hq=3, hkv=2), 0.25),
        "one_position": lambda: rt.chunk_attention(q, k, v, 0.25, pos, None),
        "position_shape": lambda: rt.chunk_attention(q, k, v, 0.25, pos[:5], pos),
        "accumulators": lambda: rt.chunk_attention_merge_(torch.zeros(8, 4, 16, dtype=torch.float16),
                                                          torch.zeros(8, 4), q, k, v, 0.25),
    }[bad]
    with pytest.raises(ValueError):
        call()


def test_no_keys_or_no_queries_launch_nothing():
    """Empty sides are answered on the host: no keys is 'nothing seen' (out 0, lse -inf; a merge leaves the
    accumulators alone), no queries is empty outputs."""
    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    q, k, v = _inputs(tk=0)
    out, lse = rt.chunk_attention(q, k, v, 0.25, torch.arange(8), torch.arange(0))
    assert (out == 0).all() and torch.isneginf(lse).all()
    acc_out, acc_lse = torch.randn(8, 4, 16), torch.randn(8, 4)
    before = acc_out.clone(), acc_lse.clone()
    rt.chunk_attention_merge_(acc_out, acc_lse, q, k, v, 0.25)
    assert torch.equal(acc_out, before[0]) and torch.equal(acc_lse, before[1])
    out, lse = rt.chunk_attention(*_inputs(tq=0), 0.25)
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)


def _layouts():
    """(q positions, k positions) per sequence: the SP layout's interleaved blocks, chunks with queries a
    suffix of the keys, queries wholly before / after the keys, empty sides."""
    from workers.sp_plan import owned_positions

    rng = np.random.default_rng(0)
    yield [owned_positions(0, 300, 1, 2, 16)], [owned_positions(0, 300, 0, 2, 16)]
    yield [owned_positions(0, 300, 0, 4, 16)], [owned_positions(0, 300, 3, 4, 16)]
    yield [list(range(40, 100)), list(range(10)), [], list(range(5))], [list(range(100)), list(range(50, 60)), [3], []]
    for _ in range(20):  # three sequences of random ascending positions each side
        yield tuple([sorted(rng.choice(200, size=int(rng.integers(0, 60)), replace=False).tolist()) for _ in range(3)]
                    for _ in range(2))


@pytest.mark.parametrize("block_q", [1, 7, 16, 32])
@pytest.mark.parametrize("cover", [False, True])
def test_tile_table_against_brute_force(block_q: int, cover: bool):
    """Every row of `build_tiles` is one sequence's query rows with exactly the key ranges its queries see:
    keys [k0, k_full) seen by all of them, none past k_end, k_end what its last query sees; tiles cover the
    queries that see a key (every query with `cover`), once each; most keys first."""
    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    for q_pos, k_pos in _layouts():
        q_off = np.cumsum([0] + [len(p) for p in q_pos]).tolist()
        k_off = np.cumsum([0] + [len(p) for p in k_pos]).tolist()
        table = rt.build_tiles([np.asarray(p, dtype=np.int64) for p in q_pos],
                               [np.asarray(p, dtype=np.int64) for p in k_pos], q_off[:-1], k_off[:-1], block_q, cover)
        assert table.dtype == np.int32 and table.shape[1] == rt.TILE_FIELDS
        work = table[:, 4] - table[:, 2]
        assert (np.diff(work) <= 0).all()
        seen_rows = []
        assert (table[:, 6] == -1).all()  # no slots: build_tiles never splits
        for q0, q1, k0, k_full, k_end, causal, _ in table.tolist():
            b = int(np.searchsorted(q_off, q0, side="right")) - 1
            assert q_off[b] <= q0 < q1 <= q_off[b + 1] and q1 - q0 <= block_q and k0 == k_off[b]
            qp, kp = np.asarray(q_pos[b]), np.asarray(k_pos[b])
            sees = [int((kp <= qp[i - q_off[b]]).sum()) for i in range(q0, q1)]
            assert k_full - k0 == sees[0] and k_end - k0 == sees[-1] == max(sees)
            assert causal == int(k_full < k_end)
            seen_rows += list(range(q0, q1))
        want = [i for b, qp in enumerate(q_pos) for j, p in enumerate(qp)
                if cover or any(kp <= p for kp in k_pos[b])
                for i in [q_off[b] + j]]
        assert sorted(seen_rows) == want


def test_launch_configs(monkeypatch):
    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    cfg = rt.RingConfig.parse("128,64,8,3,pack")
    assert cfg == rt.RingConfig(128, 64, 8, 3, True) and rt.RingConfig.parse(str(cfg)) == cfg
    assert rt.RingConfig.parse("64,128,4,2") == rt.RingConfig(64, 128, 4, 2, False)
    for bad in ("128,64,8", "100,64,8,3", "128,64,0,3", "128,64,8,3,pack,1"):
        with pytest.raises(ValueError):
            rt.RingConfig.parse(bad)
    # Packing takes the GQA group into M where it is a power of two that divides BLOCK_M; else one head.
    assert cfg.heads_per_program(4) == 4 and rt.rows_per_tile(cfg, 32, 8) == 32
    assert cfg.heads_per_program(3) == 1 and cfg.heads_per_program(1) == 1
    assert rt.RingConfig(16, 16, 4, 1, True).heads_per_program(32) == 1
    assert rt.RingConfig(128, 64, 8, 3).heads_per_program(4) == 1
    assert cfg.splits == 0 and rt.RingConfig.parse("128,64,8,3,split=4") == rt.RingConfig(128, 64, 8, 3, False, 4)
    split = rt.RingConfig.parse("128,128,8,3,pack,split2")
    assert split == rt.RingConfig(128, 128, 8, 3, True, 2) and rt.RingConfig.parse(str(split)) == split
    assert rt.RingConfig.parse("128,128,8,3,split=auto,pack") == rt.RingConfig(128, 128, 8, 3, True, 0)
    acc16 = rt.RingConfig.parse("128,128,8,3,acc16,pack")
    assert acc16 == rt.RingConfig(128, 128, 8, 3, True, 0, True) and rt.RingConfig.parse(str(acc16)) == acc16
    early = rt.RingConfig.parse("128,128,8,3,pack,pdl,early")
    assert early == rt.RingConfig(128, 128, 8, 3, True, early=True, pdl=True) and str(early).endswith(",early,pdl")
    assert rt.RingConfig.parse(str(early)) == early and not cfg.early and not cfg.pdl and not cfg.fuse
    assert rt.RingConfig.parse("128,128,8,3,fuse,pack").fuse and str(rt.RingConfig.parse("128,128,8,3,fuse")).endswith(
        ",fuse")
    one = rt.RingConfig.parse("128,128,8,3,oneloop,pack")
    assert one.oneloop and not cfg.oneloop and rt.RingConfig.parse(str(one)) == one and str(one).endswith(",oneloop")
    batch = rt.RingConfig.parse("128,128,8,3,fuse,batchcopy,pack")
    assert batch.batchcopy and not cfg.batchcopy and rt.RingConfig.parse(str(batch)) == batch
    hybrid = rt.RingConfig.parse("128,128,8,3,hybrid,pack")
    assert hybrid.hybrid and not cfg.hybrid and rt.RingConfig.parse(str(hybrid)) == hybrid
    gather = rt.RingConfig.parse("128,128,8,3,gather,pack,fuse")
    assert gather.gather and gather.fuse and not cfg.gather and rt.RingConfig.parse(str(gather)) == gather
    assert rt.parse_config("128,128,8,3,pack,gather") is rt.parse_config("128,128,8,3,pack,gather")  # parsed once
    for bad in ("128,64,8,3,split=x", "128,64,8,3,split=2,split=3", "128,64,8,3,split=99", "128,64,8,3,acc16,acc16",
                "128,64,8,3,early,early", "128,64,8,3,pdl2", "128,64,8,3,gather,gather"):
        with pytest.raises(ValueError):
            rt.RingConfig.parse(bad)
    monkeypatch.delenv(rt.ENV, raising=False)
    assert rt.default_config(65536, 128, 2, True) == rt.CONFIGS[128][0]
    assert rt.default_config(65536, 128, 2, False) == rt.CONFIGS[128][1]
    # Short chunks fuse the steps after the first (from SP=3 on); longer ones keep the plain ring (O(chunk) K/V).
    assert rt.default_config(4096, 128, 2, True) == dataclasses.replace(rt.CONFIGS[128][0], fuse=True)
    assert rt.default_config(rt.FUSE_MAX_TOKENS, 128, 2, True).fuse
    assert not rt.default_config(rt.FUSE_MAX_TOKENS + 1, 128, 2, True).fuse
    assert rt.default_config(40, 128, 2, True).block_m == 64
    # Long chunks whose own K/V block outgrows L2 take the head groups one at a time (hband=1); within L2, or where
    # L2 is not known, the heads-fastest order; fused and hybrid rings (short chunks) never.
    mib = 2 ** 20
    assert rt.default_config(65536, 128, 2, True, 2, 256 * mib, 60 * mib).hband == 1
    assert rt.default_config(16384, 128, 2, True, 4, 64 * mib, 60 * mib).hband == 1
    assert rt.default_config(16384, 128, 2, True, 4, 32 * mib, 60 * mib).hband == 0
    assert rt.default_config(65536, 128, 2, True, 2, 256 * mib, 0).hband == 0
    assert rt.default_config(4096, 128, 2, True, 4, 256 * mib, 1 * mib).hband == 0
    assert rt.default_config(8192, 128, 2, True, 2, 256 * mib, 1 * mib).hband == 0
    monkeypatch.setattr(rt, "HBAND_L2", False)
    assert rt.default_config(65536, 128, 2, True, 2, 256 * mib, 60 * mib).hband == 0
    monkeypatch.setenv(rt.ENV, "64,64,4,2,pack")
    assert rt.default_config(65536, 128, 2, True) == rt.RingConfig(64, 64, 4, 2, True)


def test_ring_variables_reach_the_rank_actors(monkeypatch):
    """TANDEM_RING_KERNEL and TANDEM_RING_HBAND_L2 set in the driver are in the rank actors' environment (the SP ranks
    run the ring, and `default_config` reads them there)."""
    from cluster.ray_runtime import rank_runtime_env

    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    monkeypatch.setenv(rt.ENV, "128,128,8,3,pack,hband=2")
    monkeypatch.setenv("TANDEM_RING_HBAND_L2", "0")
    env = rank_runtime_env()["env_vars"]
    assert env[rt.ENV] == "128,128,8,3,pack,hband=2" and env["TANDEM_RING_HBAND_L2"] == "0"


@pytest.mark.parametrize("block_n", [1, 16, 64])
def test_split_tiles_cover_each_key_range_once(block_n: int):
    """`split_tiles`: a row's pieces tile its keys [k0, k_end) in order at BLOCK_N boundaries from k0, each with
    the k_full / causal of its own range and a slot of its own (consecutive per row); the merge table lists
    every row once with its first slot and piece count; pieces with no split rows leave the table as it was."""
    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    rng = np.random.default_rng(block_n)
    for q_pos, k_pos in _layouts():
        q_off = np.cumsum([0] + [len(p) for p in q_pos]).tolist()
        k_off = np.cumsum([0] + [len(p) for p in k_pos]).tolist()
        tiles = rt.build_tiles([np.asarray(p, dtype=np.int64) for p in q_pos],
                               [np.asarray(p, dtype=np.int64) for p in k_pos], q_off[:-1], k_off[:-1], 16, True)
        counts = rng.integers(1, 5, size=len(tiles))
        table, merge = rt.split_tiles(tiles, counts, block_n)
        if not (counts > 1).any():
            assert table is tiles and merge.shape == (0, rt.MERGE_FIELDS)
            continue
        assert table.dtype == merge.dtype == np.int32 and table.shape == (counts.sum(), rt.TILE_FIELDS)
        assert (np.diff(table[:, 4] - table[:, 2]) <= 0).all()  # heaviest first
        assert sorted(table[:, 6].tolist()) == list(range(counts.sum()))
        assert merge.tolist() == [[*row[:2], first, c] for row, first, c in
                                  zip(tiles.tolist(), np.cumsum(counts) - counts, counts)]
        by_slot = table[np.argsort(table[:, 6])]
        for (q0, q1, k0, k_full, k_end, causal, _), first, c in zip(tiles.tolist(), merge[:, 2], merge[:, 3]):
            pieces = by_slot[first:first + c]
            assert (pieces[:, :2] == [q0, q1]).all()
            edges = [k0, *pieces[:, 4].tolist()]
            assert pieces[:, 2].tolist() == edges[:-1] and edges[-1] == k_end  # in order, no gap, no overlap
            assert all((lo - k0) % block_n == 0 for lo in pieces[:, 2].tolist())
            assert (pieces[:, 3] == np.clip(k_full, pieces[:, 2], pieces[:, 4])).all()
            assert (pieces[:, 5] == (pieces[:, 3] < pieces[:, 4]) * causal).all()


def test_split_counts_by_work_per_sm():
    """Forced counts cap at the row's key tiles; the automatic rule leaves a large grid alone (16K tokens at SP=4,
    Llama-8B heads packed: 1,024 programs on 132 SMs) and splits a small one (a few query tiles against long
    keys) into pieces of at least SPLIT_MIN_TILES key tiles, so no program exceeds ~1/SPLIT_TAIL of an SM's work."""
    rt = pytest.importorskip("parallel.kernels.ring_attention_triton")
    from workers.sp_plan import owned_positions_array

    table = np.array([[0, 32, 0, 0, 4096, 1, -1], [32, 64, 0, 100, 100, 0, -1], [64, 96, 0, 0, 0, 0, -1]], np.int32)
    assert rt.split_counts(table, 128, 8, 132, 4).tolist() == [4, 1, 1]
    assert rt.split_counts(table, 128, 8, 132, 1).tolist() == [1, 1, 1]
    for step in range(4):  # 16K tokens, SP=4, rank 0 against each rank's keys: never split
        q = owned_positions_array(0, 16384, 0, 4, 16)
        k = owned_positions_array(0, 16384, (0 - step) % 4, 4, 16)
        tiles = rt.build_tiles([q], [k], [0], [0], 32, step in (0, 3))
        assert (rt.split_counts(tiles, 128, 8, 132) == 1).all()
    # The fused launch of 16K tokens at SP=4 (rank 0's queries over the other ranks' keys in position order): 1,024
    # programs of up to 96 key tiles, ~372 per SM, heaviest first: never split (SPLIT_WAVES).
    q = owned_positions_array(0, 16384, 0, 4, 16)
    others = np.sort(np.concatenate([owned_positions_array(0, 16384, r, 4, 16) for r in (1, 2, 3)]))
    tiles = rt.build_tiles([q], [others], [0], [0], 32, True)
    fused_tiles = -(-(tiles[:, 4] - tiles[:, 2]) // 128)
    share = fused_tiles.sum() * 8 / 132
    # The cap alone (share / SPLIT_TAIL) would split the longest rows.
    assert len(tiles) == 129 and fused_tiles.max() == 96 and np.ceil(share / rt.SPLIT_TAIL) < 96 <= share
    assert (rt.split_counts(tiles, 128, 8, 132) == 1).all()
    # 64 new tokens after 64K tokens of context (one query tile per head group): 8 programs of 512 key tiles.
    tiles = rt.build_tiles([np.arange(65536, 65600)], [np.arange(65600)], [0], [0], 32, True)
    counts = rt.split_counts(tiles, 128, 8, 132)
    key_tiles = -(-(tiles[:, 4] - tiles[:, 2]) // 128)
    share = key_tiles.sum() * 8 / 132
    assert (counts > 1).all() and (counts <= rt.MAX_SPLITS).all()
    assert (np.ceil(key_tiles / counts) >= rt.SPLIT_MIN_TILES).all()
    assert (np.ceil(key_tiles / counts) <= max(rt.SPLIT_MIN_TILES, np.ceil(share / rt.SPLIT_TAIL)) + 1).all() or \
        (counts == rt.MAX_SPLITS).all()
