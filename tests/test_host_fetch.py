"""workers/host_fetch.py: a step's results listed through one pinned staging buffer per thread."""
from __future__ import annotations

import torch

from workers.host_fetch import host_lists


def test_cpu_tensors_are_listed_as_they_are():
    a, b = torch.tensor([1, 2, 3]), torch.tensor([[0.5, -1.0]], dtype=torch.float64)
    assert host_lists(a, b) == [[1, 2, 3], [[0.5, -1.0]]]
    assert host_lists(torch.tensor([], dtype=torch.int64)) == [[]]
