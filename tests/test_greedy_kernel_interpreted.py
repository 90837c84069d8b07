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
