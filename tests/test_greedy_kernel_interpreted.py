"""The greedy kernels (parallel/kernels/sampling.py: what a decode graph runs on the logits) on CPU through Triton's
interpreter, against torch: one program a row, and a row split over chunks (few rows) merged by a second kernel. The
token is the first maximum (ties across a chunk boundary and inside one), padded columns at -inf never win, and the
log-probability is the fp32 log-softmax's. Under TP each rank's slice gives (max, first argmax + its first token id,
log-sum-exp) (`greedy_parts`) and `greedy_combine` picks the token of the whole row from the ranks' (ties across
ranks: the lowest rank's, the first maximum), as the PyTorch form of `ParallelLMHead.greedy_packed` does."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
from parallel.kernels.sampling import BLOCK, greedy_chunks, greedy_combine, greedy_pack, greedy_parts

def reference(logits):
    raw = logits.float()
    tokens = raw.argmax(dim=-1)
    lps = raw.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(raw, dim=-1)
    return torch.stack([tokens.double(), lps.double()], dim=1)

g = torch.Generator().manual_seed(0)
checked = 0
for rows, vocab in ((1, 5000), (3, 2 * BLOCK + 7), (2, 300)):
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[0, vocab - 5:] = float("-inf")  # padding columns
    if rows > 1:  # equal maxima in two chunks (and, at 2 * BLOCK + 7 columns, across a chunk boundary)
        top = logits[1].max() + 1
        logits[1, BLOCK + 3 if vocab > BLOCK + 3 else vocab // 2] = top
        logits[1, vocab - 1] = top
    want = reference(logits)
    for chunks in (None, 1, 2, 3, 64):
        got = greedy_pack(logits.to(torch.bfloat16).float(), chunks) if chunks == 64 else greedy_pack(logits, chunks)
        ref = reference(logits.to(torch.bfloat16).float()) if chunks == 64 else want
        assert torch.equal(got[:, 0], ref[:, 0]), (rows, vocab, chunks, got[:, 0], ref[:, 0])
        assert torch.allclose(got[:, 1], ref[:, 1], rtol=1e-5, atol=1e-5), (rows, vocab, chunks)
        checked += 1
# TP: a row split in tp vocabulary slices, each rank's three numbers, combined
for rows, vocab, tp in ((1, 3 * BLOCK, 2), (3, 600, 3), (2, 4 * BLOCK + 8, 4)):
    logits = torch.randn(rows, vocab, generator=g) * 4
    width = vocab // tp
    top = logits.max() + 1
    logits[0, width - 1] = top  # a tie across ranks: rank 0's last column and rank 1's first
    logits[0, width] = top
    want = reference(logits)
    for chunks in (1, 2):
        parts = torch.stack([greedy_parts(logits[:, r * width:(r + 1) * width], r * width, chunks) for r in range(tp)])
        for r in range(tp):  # each rank's (max, id, log-sum-exp) of its slice
            sl = logits[:, r * width:(r + 1) * width]
            assert torch.equal(parts[r, :, 1], (sl.argmax(-1) + r * width).double())
            assert torch.equal(parts[r, :, 0], sl.max(-1).values.double())
            assert torch.allclose(parts[r, :, 2], torch.logsumexp(sl, -1).double(), rtol=1e-6, atol=1e-6)
        got = greedy_combine(parts)  # [2, rows]
        assert torch.equal(got[0], want[:, 0]), (rows, vocab, tp, chunks, got[0], want[:, 0])
        assert torch.allclose(got[1], want[:, 1], rtol=1e-5, atol=1e-5)
        checked += 1
assert greedy_chunks(1, 128256, 132) == 63 and greedy_chunks(300, 128256, 132) == 1 and greedy_chunks(4, 1000, 132) == 1
print("ok", checked)
'''


@pytest.mark.interpreted(SCRIPT, timeout=600)
def test_greedy_kernels_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT).strip()
    assert out.startswith("ok") and int(out.split()[-1]) == 21, out


PUSHED_SCRIPT = r'''
import threading, time
import torch
from parallel.kernels.sampling import BLOCK, greedy_combine, greedy_parts
from parallel.p2p_allreduce import EMPTY_BITS64
from tests.pushed_slots import played_slots

def empty(t):
    return bool((t.view(torch.int64) == EMPTY_BITS64).all())

g = torch.Generator().manual_seed(1)
world, sites, max_rows = 2, 3, 4
slots, site = played_slots(world, sites, 3 * max_rows, torch.float64)
turn = 0
for rows, vocab, chunks in ((1, 2 * BLOCK, 2), (3, 600, 1), (4, 900, 1), (2, 2 * BLOCK + 2, 3)):
    logits = torch.randn(rows, vocab, generator=g) * 4
    width = vocab // world
    top = logits.max() + 1
    logits[0, width - 1] = top  # a tie across the two ranks' slices
    logits[0, width] = top
    logits[-1, 5] = -0.0  # a row whose max is -0: pushed as +0, never read as "not yet written"
    logits[-1, 6:] = -1.0
    logits[-1, :5] = -1.0
    slices = [logits[:, r * width:(r + 1) * width] for r in range(world)]
    gathered = greedy_combine(torch.stack([greedy_parts(slices[r], r * width, chunks) for r in range(world)]))
    s = turn % sites
    for r in range(world):  # every rank pushes its rows into every rank's slots of site s
        assert greedy_parts(slices[r], r * width, chunks, push=site(r, s)) is None
    for r in range(world):
        written = slots[r][s][:, :3 * rows].view(torch.int64)
        assert bool((written != EMPTY_BITS64).all()) and empty(slots[r][s][:, 3 * rows:])
        got = greedy_combine(None, site=site(r, s), rows=rows)
        assert torch.equal(got, gathered), (rows, vocab, r, got, gathered)
        assert empty(slots[r][(s - 1) % sites])  # the site before is emptied for the next turn
    turn += 1

# The wait: rank 1's rows land 1 s after rank 0 combines, written from another thread; the combine waits for them.
logits = torch.randn(2, 500, generator=g)
slices = [logits[:, :250], logits[:, 250:]]
want = greedy_combine(torch.stack([greedy_parts(slices[r], r * 250) for r in range(world)]))
s = turn % sites
greedy_parts(slices[0], 0, push=site(0, s))
greedy_parts(slices[1], 250, push=site(1, s))  # lands in both ranks' slots...
held = slots[0][s][1].clone()
slots[0][s][1].view(torch.int64).fill_(EMPTY_BITS64)  # ...and is taken back from rank 0's, to arrive late
timer = threading.Timer(1.0, lambda: slots[0][s][1].copy_(held))
t0 = time.monotonic()
timer.start()
got = greedy_combine(None, site=site(0, s), rows=2)
assert time.monotonic() - t0 >= 1.0, "combined before every rank had pushed"
timer.join()
assert torch.equal(got, want)
try:
    greedy_parts(torch.randn(max_rows + 1, 100), 0, push=site(0, 0))
    raise AssertionError("pushed more rows than the site holds")
except ValueError:
    pass
print("ok", turn)
'''


@pytest.mark.interpreted(PUSHED_SCRIPT, timeout=600)
def test_pushed_greedy_rows_in_the_triton_interpreter():
    """TANDEM_TP_GREEDY_GATHER=push: each rank's (max, id, log-sum-exp) rows pushed into every rank's float64 slots
    of a site (two ranks played in one process, tests/pushed_slots.py) and combined from there equal the all-gathered
    combine, bit for bit; the combine empties the site before; a max of +-0 is never read as the empty mark; a
    combine waits for rows that land late; a site holds at most its rows."""
    out = run_interpreted(PUSHED_SCRIPT).strip()
    assert out == "ok 4", out
