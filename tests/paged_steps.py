"""One step's attention metadata over a paged cache, for the kernel tests (also inside interpreted scripts)."""
from __future__ import annotations

import torch

from workers.attention.backend import AttentionMetadata


def paged_metadata(q_lens: list[int], ctx_lens: list[int], page: int, g: torch.Generator, holes: bool = False,
                   spare: int = 2, extra_width: int = 0, pad_slots=()) -> tuple[AttentionMetadata, int]:
    """Sequences running q_lens new tokens after ctx_lens cached ones, their blocks drawn from a shuffled pool of
    `need * (2 if holes else 1) + spare` (every other block first where `holes`, so tables skip blocks), each block
    table padded with 0 to the widest plus `extra_width`. pad_slots: token indices whose slot is -1 (CUDA-graph
    padding). Returns (metadata, the pool's block count)."""
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    need = sum(-(-s // page) for s in seq_lens)
    nblocks = need * (2 if holes else 1) + spare
    perm = torch.randperm(nblocks, generator=g).tolist()
    if holes:
        perm = perm[::2] + perm[1::2]
    tables, i = [], 0
    for s in seq_lens:
        tables.append(perm[i:i + -(-s // page)])
        i += len(tables[-1])
    width = max(len(t) for t in tables) + extra_width
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = [t[p // page] * page + p % page for t, c, q in zip(tables, ctx_lens, q_lens) for p in range(c, c + q)]
    for j in pad_slots:
        slots[j] = -1
    qsl = [0]
    for x in q_lens:
        qsl.append(qsl[-1] + x)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt,
                             query_lens_cpu=list(q_lens), seq_lens_cpu=seq_lens, max_query_len=max(q_lens),
                             max_seq_len=max(seq_lens))
    return meta, nblocks
