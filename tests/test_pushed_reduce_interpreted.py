"""The pushed all-reduce of prefill-sized row-parallel outputs (parallel/kernels/pushed_reduce.py,
TANDEM_TP_ROW_REDUCE=pushed) on CPU, through Triton's interpreter, with two and then four TP ranks played in one
process (each rank's slots its own tensor, each rank's pointers every rank's row addresses, as symmetric memory maps
them on GPUs): every rank pushes, then every rank sums. Checked, over more uses than there are sites and with
message sizes that shrink and grow: every rank gets the parts summed in rank order (the same bits everywhere), a -0
travels as +0, each use empties the previous site's peer rows over that use's whole length (a longer message
later must not read stale values), the turn advances once a use and the tickets return to zero, and a rank whose
peers have not pushed waits instead of summing the empty marks. fp16 (the interpreter has no bf16; both mark
emptiness with the same 16-bit -0). The compiled kernel's two-GPU run: tests/gpu/test_two_gpu_bf16.py."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import threading, time
import torch
from parallel.kernels import pushed_reduce as P
from parallel.p2p_allreduce import EMPTY_BITS, mark_empty

def played(world, width, dt):
    slots = [torch.empty(P.SITES, world, width, dtype=dt) for _ in range(world)]
    for t in slots:
        mark_empty(t)
    size = torch.empty(0, dtype=dt).element_size()
    ptrs = [torch.tensor([[slots[q].data_ptr() + (s * world + r) * width * size for q in range(world)]
                          for s in range(P.SITES)], dtype=torch.int64) for r in range(world)]
    return slots, ptrs, [P.new_state("cpu") for _ in range(world)]

def empty_rows(t, rank):
    return all(bool((t[p].view(torch.int16) == EMPTY_BITS).all()) for p in range(t.shape[0]) if p != rank)

def check(world, sizes, dt=torch.float16):
    torch.manual_seed(world)
    width = max(sizes)
    slots, ptrs, state = played(world, width, dt)
    for use, n in enumerate(sizes):
        parts = [torch.randn(n, dtype=dt) for _ in range(world)]
        parts[0][:3] = -0.0
        want = parts[0].float()
        for q in parts[1:]:
            want = want + q.float()
        want = want.to(dt)
        xs = [p.clone() for p in parts]
        for r in range(world):
            P.pushed_all_reduce(xs[r], slots[r], ptrs[r], state[r], r, world, reduce=False, grid=2)
        for r in range(world):
            P.pushed_all_reduce(xs[r], slots[r], ptrs[r], state[r], r, world, push=False, grid=2)
        for r in range(world):
            assert torch.equal(xs[r].view(torch.int16), xs[0].view(torch.int16)), (world, use, r)
            assert torch.equal(xs[r], want), (world, use, r, (xs[r].float() - want.float()).abs().max())
            assert int(state[r][0]) == use + 1 and int(state[r][1]) == 0, state[r]
            assert int(state[r][2 + use % P.SITES]) == n
            prev = (use - 1) % P.SITES
            if use:
                assert empty_rows(slots[r][prev], r), (world, use, r)  # the whole previous use, even if longer
        assert not torch.equal(xs[0][:3].view(torch.int16), torch.full((3,), EMPTY_BITS, dtype=torch.int16))
    return len(sizes)

print("two", check(2, [5000, 300, 4096, 9000, 2048, 7000, 10]))
print("four", check(4, [3000, 6000, 100, 4100]))

# A rank whose peer has not pushed waits: rank 0 sums on a thread, rank 1 pushes 0.3 s later.
slots, ptrs, state = played(2, 4096, torch.float16)
xs = [torch.ones(4096, dtype=torch.float16), torch.full((4096,), 2.0, dtype=torch.float16)]
P.pushed_all_reduce(xs[0], slots[0], ptrs[0], state[0], 0, 2, reduce=False, grid=1)
done = []
t = threading.Thread(target=lambda: done.append(P.pushed_all_reduce(xs[0], slots[0], ptrs[0], state[0], 0, 2,
                                                                    push=False, grid=1)))
t.start()
time.sleep(0.3)
waited = not done
P.pushed_all_reduce(xs[1], slots[1], ptrs[1], state[1], 1, 2, reduce=False, grid=1)
t.join(60)
print("waited", waited, bool((xs[0] == 3).all()))
'''


@pytest.mark.interpreted(SCRIPT, timeout=600)
def test_pushed_all_reduce_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT).strip().splitlines()
    assert out[-3:] == ["two 7", "four 4", "waited True True"], out
