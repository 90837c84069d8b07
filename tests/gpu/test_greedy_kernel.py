"""The one-kernel greedy decode equals Sampler's PyTorch path: same token (first maximum on ties),
log-probability within fp32 rounding of the log-sum-exp."""
from __future__ import annotations

import pytest
import torch

DEV = "cuda"


def _reference(logits: torch.Tensor) -> torch.Tensor:
    raw = logits.float()
    tokens = raw.argmax(dim=-1)
    lps = raw.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(raw, dim=-1)
    return torch.stack([tokens.double(), lps.double()], dim=1)


@pytest.mark.parametrize("rows,vocab", [(1, 128256), (37, 151936), (5, 1000), (3, 2049)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_torch(rows, vocab, dtype):
    from parallel.kernels.sampling import greedy_pack

    torch.manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, device=DEV) * 5).to(dtype)
    logits[0, vocab - 7:] = float("-inf")  # padded vocabulary columns
    if rows > 1:  # a tie: the first of the equal maxima wins
        top = logits[1].max() + 1
        logits[1, vocab // 3] = top
        logits[1, vocab // 2] = top
    got, want = greedy_pack(logits), _reference(logits)
    assert torch.equal(got[:, 0], want[:, 0])
    torch.testing.assert_close(got[:, 1], want[:, 1], rtol=1e-5, atol=1e-5)


def test_sampler_uses_it_for_cuda_logits():
    from workers.sampler import Sampler

    logits = torch.randn(4, 5000, device=DEV)
    assert torch.equal(Sampler.greedy_pack(logits)[:, 0], logits.argmax(-1).double())


@pytest.mark.parametrize("rows", [1, 4])
def test_split_rows_in_a_cuda_graph(rows):
    """A few rows are split over chunks and merged by a second kernel (launched programmatically in a graph): the
    replay equals eager and torch."""
    from parallel.kernels.sampling import greedy_chunks, greedy_pack

    assert greedy_chunks(rows, 128256, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    logits = (torch.randn(rows, 128256, device=DEV) * 5).to(torch.bfloat16)
    eager = greedy_pack(logits)
    greedy_pack(logits)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = greedy_pack(logits)
    logits.copy_((torch.randn(rows, 128256, device=DEV) * 5).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    want = _reference(logits)
    assert torch.equal(replayed[:, 0], want[:, 0])
    torch.testing.assert_close(replayed[:, 1], want[:, 1], rtol=1e-5, atol=1e-5)
    assert not torch.equal(eager, replayed)  # new logits, new tokens: the replay read them


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("rows", [1, 5])
def test_tp_slices_combined(tp, rows):
    """A TP head's greedy choice: each rank's (max, id, log-sum-exp) of its slice, combined over the ranks, gives
    torch's token over the whole row (a tie across two ranks' slices: the lower id) and its log-probability."""
    from parallel.kernels.sampling import greedy_combine, greedy_parts

    vocab = 128256
    width = vocab // tp
    logits = (torch.randn(rows, vocab, device=DEV) * 5).to(torch.bfloat16)
    top = logits.float().max() + 1
    logits[0, 2 * width - 1] = top  # rank 1's last column and rank 2's (or, at tp 2, rank 0's first) tie
    logits[0, (2 * width) % vocab] = top
    parts = torch.stack([greedy_parts(logits[:, r * width:(r + 1) * width], r * width) for r in range(tp)])
    got, want = greedy_combine(parts), _reference(logits)
    assert torch.equal(got[0], want[:, 0])
    torch.testing.assert_close(got[1], want[:, 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("rows", [1, 5])
def test_tp_slices_pushed_and_combined(tp, rows):
    """TANDEM_TP_GREEDY_GATHER=push on one GPU: tp ranks played with their own float64 slots (tests/pushed_slots.py),
    each rank's rows pushed into every rank's slots of a site and combined from there, three turns over the sites:
    the same [2, rows] as the all-gathered combine, bit for bit, and the site before emptied each turn."""
    from parallel.kernels.sampling import greedy_combine, greedy_parts
    from parallel.p2p_allreduce import EMPTY_BITS64
    from tests.pushed_slots import played_slots

    vocab = 128256
    width = vocab // tp
    slots, site = played_slots(tp, 3, 3 * 8, torch.float64, device=DEV)
    for turn in range(4):
        logits = (torch.randn(rows, vocab, device=DEV) * 5).to(torch.bfloat16)
        slices = [logits[:, r * width:(r + 1) * width] for r in range(tp)]
        want = greedy_combine(torch.stack([greedy_parts(slices[r], r * width) for r in range(tp)]))
        s = turn % 3
        for r in range(tp):
            assert greedy_parts(slices[r], r * width, push=site(r, s)) is None
        for r in range(tp):
            assert torch.equal(greedy_combine(None, site=site(r, s), rows=rows), want), (turn, r)
            assert bool((slots[r][(s - 1) % 3].view(torch.int64) == EMPTY_BITS64).all())
