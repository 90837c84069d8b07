"""A TP rank's share of the token embedding in one kernel (parallel/kernels/fused_ops.py `vocab_rows`, used under
TANDEM_TP_EMBED=kernel or push) on CPU through Triton's interpreter: each token's row where the rank's vocabulary
slice holds it and zeros where another rank's does, bit for bit what the PyTorch form of `VocabParallelEmbedding`
builds before its all-reduce (ids in every rank's slice, int32 and int64 ids, rows wider than one program). Then the
push (the batch-1 fused decoder under TANDEM_TP_EMBED=push): two ranks played in one process (their slots, each
rank's `ptrs` holding both tensors' addresses, as in tests/test_pushed_partials_interpreted.py) push their shares
into site 0, and the GEMV that takes the site gives the bits of the plain normed GEMV on the whole embedding row and
marks the last site of the cycle empty. And, without the interpreter: the mode's parsing and the site layouts."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
from parallel.kernels import gemv as G
from parallel.kernels.fused_ops import vocab_rows
from parallel.p2p_allreduce import EMPTY_BITS
from tests.pushed_slots import played_slots

g = torch.Generator().manual_seed(0)
checked = 0
for dtype, d, rows, start in ((torch.float32, 48, 10, 10), (torch.float16, 2500, 7, 0), (torch.float16, 64, 5, 35)):
    weight = torch.randn(rows, d, generator=g).to(dtype)
    for id_dtype in (torch.int64, torch.int32):
        ids = torch.tensor([0, start, start + rows - 1, start + rows, start - 1 if start else 3, 39, start + 2],
                           dtype=id_dtype)
        local = (ids >= start) & (ids < start + rows)  # the PyTorch form (parallel/embedding.py)
        want = torch.nn.functional.embedding(torch.where(local, ids - start, 0).long(), weight)
        want.masked_fill_(~local.unsqueeze(-1), 0)
        got = vocab_rows(ids, weight, start)
        assert got.dtype == dtype and got.shape == (len(ids), d)
        assert torch.equal(got, want), (dtype, d, rows, start, id_dtype)
        assert not torch.signbit(got[~local]).any()  # +0 where another rank holds the row (never the empty mark)
        checked += 1
assert vocab_rows(torch.empty(0, dtype=torch.int64), weight, 0).shape == (0, 64)

# The push: vocabulary 16 split over two ranks (8 rows each), token 11 in rank 1's slice.
dt, world, sites, K, N = torch.float16, 2, 3, 64, 32
full = torch.randn(16, K, generator=g).to(dt)
shards = [full[:8].contiguous(), full[8:].contiguous()]
slots, site = played_slots(world, sites, K, dt)

token = torch.tensor([11])
slots[0][sites - 1].fill_(1.0)  # the cycle's last site, left written by the step before: taking site 0 empties it
for r in range(world):
    assert vocab_rows(token, shards[r], 8 * r, push=site(r, 0)) is None
for r in range(world):
    assert torch.equal(slots[r][0][1], full[11]) and not slots[r][0][0].abs().any(), r
wq, nw = (torch.randn(N, K, generator=g) * 0.1).to(dt), torch.randn(K, generator=g).to(dt)
h = torch.empty(1, K, dtype=dt)
got = G.gemv(h, wq, None, norm_weight=nw, eps=1e-5, take=site(0, 0))
assert torch.equal(h, full[11:12]) and torch.equal(got, G.gemv(full[11:12].clone(), wq, None, norm_weight=nw, eps=1e-5))
assert bool((slots[0][sites - 1].view(torch.int16) == EMPTY_BITS).all())
for bad in (dict(token_ids=torch.tensor([1, 2]), weight=shards[0], push=site(0, 1)),
            dict(token_ids=token, weight=full.t(), push=None)):
    try:
        vocab_rows(bad["token_ids"], bad["weight"], 0, push=bad["push"])
        raise AssertionError(f"vocab_rows took {bad}")
    except ValueError:
        pass
print("ok", checked)
'''


@pytest.mark.interpreted(SCRIPT, timeout=600)
def test_vocab_rows_and_its_push_in_the_triton_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(SCRIPT).strip()
    assert out.startswith("ok") and int(out.split()[-1]) == 6, out[-3000:]


def test_tp_embed_mode_and_the_site_layouts(monkeypatch):
    from parallel.embedding import TP_EMBED_ENV, tp_embed_mode
    from workers.models.fused_decode import embed_site_count, pushed_sites

    monkeypatch.delenv(TP_EMBED_ENV, raising=False)
    assert tp_embed_mode() == "push" and pushed_sites(32) == 65
    monkeypatch.setenv(TP_EMBED_ENV, "torch")
    assert tp_embed_mode() == "torch" and pushed_sites(32) == 64
    monkeypatch.setenv(TP_EMBED_ENV, "Kernel")
    assert tp_embed_mode() == "kernel" and pushed_sites(32) == 64
    monkeypatch.setenv(TP_EMBED_ENV, "fused")
    with pytest.raises(ValueError, match="TANDEM_TP_EMBED='fused'"):
        tp_embed_mode()
    assert embed_site_count(64, 32) == 0 and embed_site_count(65, 32) == 1
    assert embed_site_count(66, 32) is None and embed_site_count(62, 32) is None
