"""The split-context attention for a few query tokens per sequence (parallel/kernels/verify_attention.py,
what a speculative verification step's k + 1 tokens run on GPUs) on CPU, through Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess since it must be set before the kernels are defined), against the
torch reference backend in fp32: ragged query counts (1..16) and contexts (0, within one 64-key tile,
across tiles, tile-aligned), GQA 1/4/8, block tables with holes, split counts 1..4 and the default (splits
that hold no key, tiles a query sees none of), fp32 and fp16, the step's k/v written by the kernel itself
(the same cache as `write_kv` leaves) or beforehand; the Triton backend's routing (verify kernel
for short queries, also after a mixed step's decodes; prefill kernel past 16); and a CUDA-graph-style padded batch (padding tokens with slot -1
after the real ones, a padding sequence), whose real rows must equal the unpadded step's. bf16 and the FP8
cache are left to tests/gpu/test_verify_attention.py: the interpreter's tl.dot mis-reads bf16."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
from parallel.kernels.paged_attention import write_kv
from parallel.kernels import verify_attention as va
from workers.attention.backend import AttentionMetadata
from workers.attention.torch_backend import TorchAttention
from workers.attention.triton_backend import TritonAttention
from tests.paged_steps import paged_metadata

D, PAGE = 16, 16
SCALE = D ** -0.5
g = torch.Generator().manual_seed(0)


def batch(q_lens, ctx_lens, hq, hkv, dtype, pad_slots=()):
    """q/k/v of the step, a random cache, shuffled block tables with holes, and the step's metadata.
    pad_slots: token indices whose slot is -1 (CUDA-graph padding: their k/v are never written)."""
    meta, nblocks = paged_metadata(q_lens, ctx_lens, PAGE, g, holes=True, spare=3, extra_width=2, pad_slots=pad_slots)
    n = sum(q_lens)
    q = torch.randn(n, hq, D, generator=g).to(dtype)
    k = torch.randn(n, hkv, D, generator=g).to(dtype)
    v = torch.randn(n, hkv, D, generator=g).to(dtype)
    cache = torch.randn(2, nblocks, PAGE, hkv, D, generator=g).to(dtype)
    return q, k, v, cache, meta


def reference(q, k, v, cache, meta):
    c = cache.float().clone()
    return TorchAttention().forward(q.float(), k.float(), v.float(), c, meta, SCALE)


def kernel(q, k, v, cache, meta, splits, fuse):
    """fuse: the kernel writes the step's k/v itself (the backend's call); else write_kv first, then attend."""
    c = cache.clone()
    args = (q, c, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, meta.max_seq_len, SCALE)
    if fuse:
        return va.verify_attention(*args, num_splits=splits, k_new=k, v_new=v, slot_mapping=meta.slot_mapping), c
    write_kv(c, k, v, meta.slot_mapping)
    return va.verify_attention(*args, num_splits=splits), c


def written(cache, k, v, meta):
    c = cache.clone()
    write_kv(c, k, v, meta.slot_mapping)
    return c


checked = 0
cases = [  # (hq, hkv, q_lens, ctx_lens)
    (4, 1, [5], [130]),
    (8, 2, [1, 3, 6, 9], [0, 40, 64, 200]),
    (2, 2, [16, 2], [63, 129]),
    (8, 1, [8, 4, 7], [5, 190, 61]),
    (4, 1, [16, 1, 11], [128, 3, 66]),
]
# Every case with every split count, and with the kernel writing the k/v and not (both at the default count);
# fp16 (rounding, not indexing, is what it adds) at two of them: all 20 pairs on every case took ~60 s in CI.
SPLITS_FUSE = {torch.float32: ((None, False), (None, True), (1, True), (2, False), (3, True), (4, False)),
               torch.float16: ((None, True), (3, False))}
for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 3e-3)):
    for hq, hkv, q_lens, ctx_lens in cases:
        q, k, v, cache, meta = batch(q_lens, ctx_lens, hq, hkv, dtype)
        ref = reference(q, k, v, cache, meta)
        want_cache = written(cache, k, v, meta)
        for splits, fuse in SPLITS_FUSE[dtype]:
            out, c = kernel(q, k, v, cache, meta, splits, fuse)
            err = (out.float() - ref).abs().max().item()
            assert err < tol, (dtype, hq, hkv, q_lens, ctx_lens, splits, fuse, err)
            assert torch.equal(c, want_cache), (dtype, hq, hkv, q_lens, ctx_lens, splits, fuse)
            checked += 1

# The backend's routing: short queries take this kernel (same result), 17 tokens the prefill kernel.
for q_lens, expect_verify in (([6, 2], True), ([17, 3], False)):
    q, k, v, cache, meta = batch(q_lens, [100, 30], 8, 2, torch.float32)
    assert va.applies(meta.max_query_len, 8, 2) == expect_verify
    ref = reference(q, k, v, cache, meta)
    c = cache.clone()
    out = TritonAttention().forward(q, k, v, c, meta, SCALE)
    assert (out - ref).abs().max().item() < 1e-4, q_lens
    assert torch.equal(c, written(cache, k, v, meta)), q_lens
    checked += 1
# A mixed step (decodes first, as the runner orders them): the decode kernel takes the decodes, this one the rest.
q, k, v, cache, meta = batch([1, 1, 5, 3], [70, 9, 100, 30], 8, 2, torch.float32)
meta.num_decodes = 2
ref = reference(q, k, v, cache, meta)
c = cache.clone()
out = TritonAttention().forward(q, k, v, c, meta, SCALE)
assert (out - ref).abs().max().item() < 1e-4
assert torch.equal(c, written(cache, k, v, meta))
checked += 1
assert not va.applies(1, 8, 2) and not va.applies(9, 8, 1) and va.applies(8, 8, 1) and va.applies(16, 32, 8)

# A CUDA-graph-style step: every sequence padded to q = 6 tokens (slot -1 past its real ones) and a padding
# sequence (context 0, all slots -1); the real rows equal the unpadded step's, whatever the stale cache holds.
real_q, ctx = [4, 6], [70, 129]
q, k, v, cache, meta = batch([6, 6, 6], ctx + [0], 8, 2, torch.float32, pad_slots=[4, 5, 12, 13, 14, 15, 16, 17])
out, c = kernel(q, k, v, cache, meta, None, True)
assert torch.equal(c, written(cache, k, v, meta))  # padding slots (-1) untouched
keep = [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]
q2, k2, v2 = q[keep], k[keep], v[keep]
slots2 = meta.slot_mapping[keep]
meta2 = AttentionMetadata(slot_mapping=slots2, query_start_loc=torch.tensor([0, 4, 10], dtype=torch.int32),
                          seq_lens=torch.tensor([c + r for c, r in zip(ctx, real_q)], dtype=torch.int32),
                          block_tables=meta.block_tables[:2], query_lens_cpu=real_q,
                          seq_lens_cpu=[c + r for c, r in zip(ctx, real_q)], max_query_len=6, max_seq_len=135)
ref = reference(q2, k2, v2, cache, meta2)
assert (out[keep] - ref).abs().max().item() < 1e-4
assert torch.isfinite(out).all()
checked += 1
print("ok", checked)
'''


@pytest.mark.interpreted(SCRIPT, timeout=900)
def test_verify_attention_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT).strip()
    assert out.startswith("ok") and int(out.split()[-1]) == 44, out
