"""The split-context decode attention (parallel/kernels/paged_attention.py: one query token per sequence, what decode
steps and their CUDA graphs run on GPUs) on CPU, through Triton's interpreter (in a subprocess), against the torch
reference backend in fp32: contexts from 1 token to many 64-key tiles, GQA 1 and 4, shuffled block tables, split
counts 1..16 (short sequences leave splits empty: those write no partials and the merge reads only the splits in use,
so a second call over the first call's stale partials must give the same output), the step's k/v written by the
kernel itself or beforehand, and key tiles other than the default 64 (`tile`, for sweeps)."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
from parallel.kernels.paged_attention import decode_attention, write_kv
from workers.attention.torch_backend import TorchAttention
from tests.paged_steps import paged_metadata

D, PAGE = 16, 16
SCALE = D ** -0.5
g = torch.Generator().manual_seed(1)
checked = 0
for hq, hkv, ctx_lens in ((4, 1, [0, 1, 63, 200]), (8, 2, [64, 65, 700])):
    q_lens = [1] * len(ctx_lens)
    meta, nblocks = paged_metadata(q_lens, ctx_lens, PAGE, g, holes=True, spare=3, extra_width=2)
    n = len(q_lens)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (hq, hkv, hkv))
    cache = torch.randn(2, nblocks, PAGE, hkv, D, generator=g)
    ref = TorchAttention().forward(q, k, v, cache.clone(), meta, SCALE)
    for splits in (1, 3, 16):
        for fuse in (False, True):
            c = cache.clone()
            if not fuse:
                write_kv(c, k, v, meta.slot_mapping)
            kw = dict(k_new=k, v_new=v, slot_mapping=meta.slot_mapping) if fuse else {}
            for _ in range(2):  # the second call reads over the first's partials
                out = decode_attention(q, c, meta.block_tables, meta.seq_lens, SCALE, meta.max_seq_len,
                                       num_splits=splits, **kw)
                err = (out - ref).abs().max().item()
                assert err < 1e-4, (hq, hkv, ctx_lens, splits, fuse, err)
            checked += 1
    for tile in ((32, 4, 2), (128, 8, 3)):  # a sweep's other key tiles (BLOCK_N), through the split and the merge
        c = cache.clone()
        out = decode_attention(q, c, meta.block_tables, meta.seq_lens, SCALE, meta.max_seq_len, num_splits=3,
                               k_new=k, v_new=v, slot_mapping=meta.slot_mapping, tile=tile)
        err = (out - ref).abs().max().item()
        assert err < 1e-4, (hq, hkv, ctx_lens, tile, err)
        checked += 1
print("ok", checked)
'''


@pytest.mark.interpreted(SCRIPT, timeout=900)
def test_decode_attention_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT).strip()
    assert out.startswith("ok") and int(out.split()[-1]) == 16, out
