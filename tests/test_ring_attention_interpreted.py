"""The Triton ring-attention step (parallel/kernels/ring_attention_triton.py) on CPU, through Triton's
interpreter (TRITON_INTERPRET=1, in a subprocess since it must be set before the kernels are defined),
against the dense fp32 reference `attention_with_lse`: causal diagonal, fully visible, fully masked,
rows that see nothing beside rows that do, the SP layout's interleaved positions, non-causal, GQA/MQA,
lengths that are not a multiple of the tiles, fp32 and fp16, plain and TMA loads, the in-place merge;
then one SP rank's whole ring (`ring_rank_attention`, backend="triton") for SP=2 and 4 against full causal
attention. bf16 is left to tests/gpu/test_ring_attention_triton.py: the interpreter's tl.dot mis-reads
bf16 (a plain bf16 dot of 16 x 16 comes back ~1e10). Shapes stay tiny: the interpreter runs every
program in Python."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

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
        for tiles, tma in (((16, 16, 4, 1), False), (None, False), ((16, 16, 4, 1), True)):
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


def test_ring_step_kernel_in_the_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().split()[-2:] == ["ok", "55"], done.stdout[-500:]


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
