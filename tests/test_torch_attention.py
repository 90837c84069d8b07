"""The torch (reference) backend's decode grouping: same result as one padded call over the batch."""
from __future__ import annotations

import torch

from workers.attention import torch_backend
from workers.attention.backend import AttentionMetadata


def test_grouped_decode_equals_one_padded_call(monkeypatch):
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, hkv, hq, d = 64, 4, 2, 4, 8
    kv_cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g)
    lens = [int(x) for x in torch.randint(1, 30, (11,), generator=g)]
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks, as block tables are
    tables, used = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(perm[used : used + nb] + [0] * (8 - nb))
        used += nb
    q = torch.randn(len(lens), hq, d, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.int64), query_start_loc=torch.arange(len(lens) + 1),
                             seq_lens=seq_lens, block_tables=block_tables, query_lens_cpu=[1] * len(lens),
                             seq_lens_cpu=lens, max_query_len=1, max_seq_len=max(lens))
    whole = torch_backend._decode_padded(q, kv_cache, block_tables, seq_lens, max(lens), 0.3)
    monkeypatch.setattr(torch_backend, "DECODE_GROUP", 3)  # 11 sequences -> 4 groups of sorted lengths
    grouped = torch_backend.TorchAttention()._decode(q, kv_cache, meta, 0.3)
    torch.testing.assert_close(grouped, whole, rtol=1e-5, atol=1e-6)
    # And against a per-sequence reference: softmax(q k^T) v over exactly each sequence's keys.
    for i, n in enumerate(lens):
        keys = torch_backend.gather_kv(kv_cache[0], block_tables[i : i + 1], n)[0].repeat_interleave(hq // hkv, 0)
        vals = torch_backend.gather_kv(kv_cache[1], block_tables[i : i + 1], n)[0].repeat_interleave(hq // hkv, 0)
        ref = torch.softmax((q[i][:, None, :] * 0.3 * keys).sum(-1), -1)[:, None, :] @ vals
        torch.testing.assert_close(grouped[i], ref[:, 0], rtol=1e-5, atol=1e-6)
