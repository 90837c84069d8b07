"""The batch-1 fused decode's row-parallel step under TP=2 (workers/models/fused_decode.py
`row_parallel_gemv`), on CPU through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess since it
must be set before the kernels are defined) over two gloo ranks: the first rank's GEMV epilogue adds the
bias and the residual, the other's neither, and the all-reduce must give residual + x @ W.T + b, as the
unfused RowParallelLinear does. The whole model under TP=2 with CUDA graphs is checked on GPUs in
tests/gpu/test_fused_decode.py."""
from __future__ import annotations

import pytest
import torch

from tests.interpreter import run_interpreted

K, N = 64, 48  # the full input width (each rank holds half) and the output width


def _rank_check(rank: int) -> None:
    from parallel.kernels import gemv as gemv_module
    from parallel.linear import RowParallelLinear
    from parallel.state import tp_group
    from workers.models.fused_decode import row_parallel_gemv

    g = torch.Generator().manual_seed(0)  # every rank draws the same full tensors
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    x, residual = torch.randn(1, K, generator=g), torch.randn(1, N, generator=g)
    tp = tp_group()
    assert tp.size == 2
    linear = RowParallelLinear(K, N, bias=True)
    shard = slice(rank * K // 2, (rank + 1) * K // 2)
    linear.weight.data.copy_(w[:, shard])
    linear.bias.data.copy_(b)
    want = residual + x @ w.t() + b
    got = row_parallel_gemv(gemv_module.gemv, x[:, shard].contiguous(), linear, residual.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x[:, shard].contiguous()) + residual, want, rtol=1e-5, atol=1e-4)


def _main() -> None:
    from tests.multiprocess import run_ranks

    run_ranks(_rank_check, 2, parallel={"tensor_parallel_size": 2})
    print("ok")


TP2_SCRIPT = "from tests.test_fused_decode_tp_interpreted import _main; _main()"


@pytest.mark.interpreted(TP2_SCRIPT, timeout=600)
def test_row_parallel_gemv_under_tp2_in_the_triton_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the compiled kernels are tested on the GPU (tests/gpu/test_fused_decode.py)")
    out = run_interpreted(TP2_SCRIPT)
    assert "ok" in out, out[-3000:]
