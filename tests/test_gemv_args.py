"""`gemv.gemv`'s argument checks, which run before any launch (so on CPU too)."""
import pytest
import torch

from parallel.kernels import gemv


def test_gemv_refuses_a_transposed_weight_or_input():
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w = torch.randn(64, 32, dtype=torch.bfloat16).t()  # [32, 64] whose rows are strided
    with pytest.raises(ValueError, match="contiguous"):
        gemv.gemv(x, w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv.gemv(torch.randn(64, 2, dtype=torch.bfloat16)[:, :1].t(), w.contiguous())  # x [1, 64], stride 2
