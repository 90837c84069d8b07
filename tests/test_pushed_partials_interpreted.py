"""Row-parallel partial sums pushed instead of all-reduced (parallel/kernels/gemv.py `push` / `take` /
`sum_pushed`, parallel/p2p_allreduce.PushedPartials) on CPU, through Triton's interpreter (TRITON_INTERPRET=1,
in a subprocess since it must be set before the kernels are defined).

Two TP ranks are played in one process: each has its own slots tensor, and each rank's `ptrs` hold both
tensors' addresses, as symmetric memory maps them on GPUs. Checked: every rank's pushed part lands in every
rank's slots; the GEMV that takes a site gives the same bits as the plain fused GEMV on the all-reduced h (the
parts summed in rank order), for the norm prologue alone and with RoPE; it hands h on and marks the previous site
empty; `sum_pushed` gives h for the final norm; a -0 is pushed as +0 (else it would read as "not yet written");
and a taking GEMV whose peer has not pushed yet waits for it instead of reading the empty marks. Then four ranks
(TP=4: the parts summed in rank order). fp16 (the interpreter has no bf16; both mark emptiness with the same 16-bit
-0). The compiled kernels and their two-rank run are tested in tests/gpu/test_gemv.py and
tests/gpu/test_two_gpu_bf16.py."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import threading, time
import torch
import triton
import triton.language as tl
from parallel.kernels import gemv as G
from parallel.p2p_allreduce import EMPTY_BITS
from tests.pushed_slots import played_slots

torch.manual_seed(0)
dt, world, sites = torch.float16, 2, 3
K, KH, N, D = 64, 32, 96, 16  # hidden, each rank's half of the row-parallel input, the next GEMV's width, head_dim
slots, site = played_slots(world, sites, K, dt)

def empty(t):
    return bool((t.view(torch.int16) == EMPTY_BITS).all())

x = [torch.randn(1, KH, dtype=dt) for _ in range(world)]
w = [(torch.randn(K, KH) * 0.2).to(dt) for _ in range(world)]
b, resid = torch.randn(K, dtype=dt), torch.randn(1, K, dtype=dt)
parts = [G.gemv(x[0], w[0], b, residual=resid), G.gemv(x[1], w[1])]  # what the all-reduce would sum
h_ref = (parts[0].float() + parts[1].float()).to(dt)

def push(rank, s):
    assert G.gemv(x[rank], w[rank], b if rank == 0 else None, residual=resid if rank == 0 else None,
                  push=site(rank, s)) is None

slots[0][0].fill_(1.0)  # the previous site's slots, left written: the taking GEMV must mark them empty
for r in range(world):
    push(r, 1)
for r in range(world):
    for p in range(world):
        assert torch.equal(slots[r][1][p], parts[p][0]), (r, p)
wq, nw = (torch.randn(N, K) * 0.1).to(dt), torch.randn(K, dtype=dt)
want = G.gemv(h_ref, wq, None, norm_weight=nw, eps=1e-5)
h = torch.empty(1, K, dtype=dt)
assert torch.equal(G.gemv(h, wq, None, norm_weight=nw, eps=1e-5, take=site(0, 1)), want)
assert torch.equal(h, h_ref) and empty(slots[0][0]) and not empty(slots[0][1])

rope = G.Rope(torch.tensor([5]), torch.randn(8, 2, D), D, 4 * D)  # 4 rotated heads of 6
wr, br = (torch.randn(6 * D, K) * 0.1).to(dt), torch.randn(6 * D, dtype=dt)
want = G.gemv(h_ref, wr, br, norm_weight=nw, eps=1e-5, rope=rope)
h = torch.empty(1, K, dtype=dt)
assert torch.equal(G.gemv(h, wr, br, norm_weight=nw, eps=1e-5, rope=rope, take=site(1, 1)), want)
assert torch.equal(h, h_ref) and empty(slots[1][0])
assert torch.equal(G.sum_pushed(site(1, 1), torch.empty(1, K, dtype=dt)), h_ref)

@triton.jit
def push_kernel(y_ptr, ptrs, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    G._push(tl.load(y_ptr + offs, mask=offs < n).to(tl.float32), offs, offs < n, ptrs, 2, tl.float16)

y = torch.tensor([-0.0, 0.0, -1.5, 2.0], dtype=dt)
push_kernel[(1,)](y, site(0, 2).ptrs, 4, BLOCK=4)
got = slots[1][2][0][:4]
assert got.view(torch.int16).tolist() == [0, 0] + y[2:].view(torch.int16).tolist(), got.view(torch.int16)

# The wait: rank 0 takes site 2 before rank 1's part is there; rank 1's part arrives 1 s later, written from
# another thread (the interpreter runs one kernel at a time), and the taking GEMV must have waited for it.
slots[0][2].view(torch.int16).fill_(EMPTY_BITS)
push(0, 2)
late = threading.Timer(1.0, lambda: slots[0][2][1].copy_(parts[1][0]))
t0 = time.monotonic()
late.start()
h = torch.empty(1, K, dtype=dt)
y = G.gemv(h, wq, None, norm_weight=nw, eps=1e-5, take=site(0, 2))
assert time.monotonic() - t0 >= 1.0, "took a site before every rank had pushed to it"
late.join()
assert torch.equal(h, h_ref) and torch.equal(y, G.gemv(h_ref, wq, None, norm_weight=nw, eps=1e-5))
for bad in (dict(take=site(0, 1)), dict(push=site(0, 1), silu=True)):
    try:
        G.gemv(torch.empty(1, K, dtype=dt), wq, **bad)
        raise AssertionError(f"gemv took {sorted(bad)}")
    except ValueError:
        pass

# Four ranks (TP=4): every rank's part in every rank's slots, summed in rank order (left to right, in fp32).
W4, KQ = 4, 16
slots4, site4 = played_slots(W4, 2, K, dt)
x4 = [torch.randn(1, KQ, dtype=dt) for _ in range(W4)]
w4 = [(torch.randn(K, KQ) * 0.3).to(dt) for _ in range(W4)]
parts4 = [G.gemv(x4[r], w4[r], b if r == 0 else None, residual=resid if r == 0 else None) for r in range(W4)]
acc = torch.zeros(1, K)
for part in parts4:
    acc = acc + part.float()
h4_ref = acc.to(dt)
for r in range(W4):
    G.gemv(x4[r], w4[r], b if r == 0 else None, residual=resid if r == 0 else None, push=site4(r, 1))
for r in (0, 3):
    h = torch.empty(1, K, dtype=dt)
    y = G.gemv(h, wq, None, norm_weight=nw, eps=1e-5, take=site4(r, 1))
    assert torch.equal(h, h4_ref) and torch.equal(y, G.gemv(h4_ref, wq, None, norm_weight=nw, eps=1e-5)), r
    assert empty(slots4[r][0])
print("ok")
'''


@pytest.mark.interpreted(SCRIPT, timeout=600)
def test_pushed_partials_in_the_triton_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(SCRIPT).strip()
    assert out.endswith("ok"), out[-3000:]
