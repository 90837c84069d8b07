"""workers/host_fetch.py on a GPU: CUDA tensors listed through the thread's pinned staging buffer."""
from __future__ import annotations

import threading

import pytest
import torch

from workers import host_fetch
from workers.host_fetch import host_lists

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_tensors_of_mixed_dtypes_and_layouts_come_back_exactly():
    g = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randn(37, 2, device="cuda", dtype=torch.float64, generator=g)
    ids = torch.randint(0, 128_000, (37,), device="cuda", generator=g)
    lps = torch.randn(37, device="cuda", generator=g)
    cpu = torch.tensor([7])
    keep = lps > 0  # bool: speculative decoding's accept mask (workers/spec_decode/verify.py)
    got = host_lists(ids, packed.t(), cpu, lps, torch.empty(0, device="cuda"), keep)
    assert got == [ids.tolist(), packed.t().tolist(), [7], lps.tolist(), [], keep.tolist()]


def test_the_staging_buffer_grows_and_each_thread_has_its_own():
    small = host_lists(torch.arange(4, device="cuda"))
    big = torch.arange(1 << 16, device="cuda")  # 512 KiB: past the first buffer
    assert host_lists(big)[0] == big.tolist() and small == [[0, 1, 2, 3]]
    mine = host_fetch._local.buf
    other = {}
    thread = threading.Thread(target=lambda: other.update(lists=host_lists(torch.arange(3, device="cuda")),
                                                          buf=host_fetch._local.buf))
    thread.start()
    thread.join()
    assert other["lists"] == [[0, 1, 2]] and other["buf"].data_ptr() != mine.data_ptr()
