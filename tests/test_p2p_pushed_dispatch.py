"""TANDEM_P2P_PUSHED (parallel/p2p_allreduce.py): which messages the P2P all-reduce hands to the pushed kernel
(parallel/kernels/pushed_reduce.py; the kernel itself: tests/test_pushed_reduce_interpreted.py). The switch is
parsed and a bad value refused by name; with the kernel set, messages above its size and within its slots go to it,
the rest to the one-shot / two-shot kernels as before, and `staging` (the GEMM writing into the two-shot kernel's
buffer) steps aside for the sizes it takes. The P2P object is built without symmetric memory (CPU), its kernels
replaced by recorders."""
from __future__ import annotations

import pytest
import torch

from parallel.p2p_allreduce import PUSHED_ENV, P2PAllReduce, pushed_min_bytes


def test_the_switch_is_parsed_and_a_bad_value_refused():
    assert pushed_min_bytes(1 << 20, {}) is None and pushed_min_bytes(1 << 20, {PUSHED_ENV: "off"}) is None
    assert pushed_min_bytes(1 << 20, {PUSHED_ENV: " On"}) == 1 << 20
    assert pushed_min_bytes(1 << 20, {PUSHED_ENV: "from:256"}) == 256 << 10
    for bad in ("yes", "from:", "from:x", "256"):
        with pytest.raises(ValueError, match=PUSHED_ENV):
            pushed_min_bytes(1 << 20, {PUSHED_ENV: bad})


class _Pushed:
    def __init__(self, width: int):
        self.width, self.calls = width, []

    def __call__(self, x: torch.Tensor) -> bool:
        if x.numel() > self.width:
            return False
        self.calls.append(x.numel())
        x.mul_(2)
        return True


def _p2p(pushed: _Pushed | None, pushed_min: int) -> tuple[P2PAllReduce, list]:
    p2p = P2PAllReduce.__new__(P2PAllReduce)
    kernels: list = []
    p2p.dtype, p2p.one_shot_max, p2p.two_shot_max = torch.bfloat16, 1 << 10, 1 << 16
    p2p.max_bytes, p2p.group_name = p2p.two_shot_max, "g"
    p2p.buffer = torch.zeros(p2p.max_bytes // 2, dtype=torch.bfloat16)
    p2p.one_shot = lambda buf, x, op, name, out: kernels.append(("one", x.numel()))
    p2p.two_shot = lambda staged, op, name, out: kernels.append(("two", out.numel()))
    p2p.pushed, p2p.pushed_min = pushed, pushed_min
    return p2p, kernels


def test_messages_above_its_size_and_within_its_slots_go_to_the_pushed_kernel():
    pushed = _Pushed(width=8192)
    p2p, kernels = _p2p(pushed, pushed_min=1 << 10)
    small, mid, big = (torch.ones(n, dtype=torch.bfloat16) for n in (256, 4096, 16384))
    assert p2p(small) and p2p(mid) and p2p(big)
    assert pushed.calls == [4096] and bool((mid == 2).all())  # 8 KiB: pushed, summed in place
    assert kernels == [("one", 256), ("two", 16384)]  # 512 B: one-shot; 32 KiB, longer than the slots: two-shot
    assert p2p.staging(4, 1024, torch.bfloat16) is None  # the pushed kernel's size: no staging in the mapped buffer
    assert p2p.staging(16, 1024, torch.bfloat16) is not None  # beyond its slots: the two-shot's staging as before
    off, kernels = _p2p(None, 0)
    assert off(mid) and kernels == [("two", 4096)] and off.staging(4, 1024, torch.bfloat16) is not None
