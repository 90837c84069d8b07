"""workers/launched_step.py on a GPU: a launched step's tokens reach the host, with the copy on the compute stream or
on a side stream (TANDEM_TOKEN_COPY=side), while the stream goes on to overwrite the memory they came from."""
from __future__ import annotations

import pytest
import torch

from workers.launched_step import TOKEN_COPY_ENV, LaunchedStep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("mode", ["stream", "side"])
def test_tokens_arrive_whole_while_the_stream_runs_on(mode, monkeypatch):
    monkeypatch.setenv(TOKEN_COPY_ENV, mode)
    big = torch.randn(4096, 4096, device="cuda")
    steps, want = [], []
    for i in range(8):
        ids = torch.arange(i * 1000, i * 1000 + 64, device="cuda", dtype=torch.float64)
        packed = torch.stack([ids, -ids / 7])  # [2, B]: this step's own tensor
        want.append(packed.tolist())
        for _ in range(3):  # long work queued behind the copy, as the next step's kernels are
            big = big @ big / 64
        steps.append(LaunchedStep([f"s{j}" for j in range(64)], packed, None, owned=True))
        del packed, ids  # its memory goes back to the allocator while the copy may still be reading it
        junk = torch.full((2, 64), float("nan"), device="cuda", dtype=torch.float64)  # may take that memory
        del junk
    for step, (ids, lps) in zip(steps, want):
        seq_ids, tokens, logprobs, _ = step.finish().columns
        assert tokens == [int(t) for t in ids] and logprobs == lps
    assert steps[0].next_ids.tolist() == [int(t) for t in want[0][0]]


def test_a_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv(TOKEN_COPY_ENV, "sideways")
    with pytest.raises(ValueError, match="TANDEM_TOKEN_COPY='sideways'"):
        LaunchedStep(["a"], torch.zeros(2, 1, device="cuda", dtype=torch.float64), None, owned=True)
