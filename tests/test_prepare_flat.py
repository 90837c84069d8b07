"""ModelRunner._prepare_flat (numpy) against the per-token definition of a step's inputs: token ids,
positions, KV slots, query starts, block tables padded with 0, decodes first counted, sample rows (the
last token of a sampled sequence, and each draft of a speculating one)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from workers.model_runner import ModelRunner
from workers.sampling_params import SamplingParams
from workers.scheduler_output import ScheduledSeq


def _reference(seqs, bs):
    tokens, positions, slots, starts, rows = [], [], [], [0], []
    for s in seqs:
        tokens += s.token_ids
        for p in range(s.start_pos, s.context_len):
            positions.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
        starts.append(starts[-1] + s.num_tokens)
        if s.sample:
            rows += list(range(starts[-1] - 1 - len(s.spec_token_ids), starts[-1]))
    width = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    return tokens, positions, slots, starts, tables, rows


def test_numpy_inputs_match_the_per_token_definition():
    rng = random.Random(0)
    bs = 16
    for trial in range(20):
        seqs = []
        for i in range(rng.randint(1, 40)):
            n = 1 if i < 5 and trial % 2 else rng.randint(1, 70)
            start = rng.randint(0, 300)
            blocks = rng.sample(range(1000), -(-(start + n) // bs) + rng.randint(0, 2))
            spec = [rng.randint(0, 99) for _ in range(rng.randint(0, 3))] if n > 3 and rng.random() < 0.2 else []
            seqs.append(ScheduledSeq(f"s{i}", [rng.randint(0, 50000) for _ in range(n)], start, blocks,
                                     rng.random() < 0.7, SamplingParams(), 0, spec_token_ids=spec))
        runner = SimpleNamespace(block_size=bs, device=torch.device("cpu"))
        token_ids, positions, meta, rows = ModelRunner._prepare_flat(runner, seqs)
        tokens, pos, slots, starts, tables, want_rows = _reference(seqs, bs)
        assert token_ids.tolist() == tokens and positions.tolist() == pos and meta.slot_mapping.tolist() == slots
        assert meta.query_start_loc.tolist() == starts and meta.block_tables.tolist() == tables and rows == want_rows
        assert (token_ids.dtype, positions.dtype, meta.slot_mapping.dtype) == (torch.int64,) * 3
        assert (meta.query_start_loc.dtype, meta.seq_lens.dtype, meta.block_tables.dtype) == (torch.int32,) * 3
        assert meta.seq_lens.tolist() == [s.context_len for s in seqs] == meta.seq_lens_cpu
        ones = next((i for i, s in enumerate(seqs) if s.num_tokens != 1), len(seqs))
        assert meta.num_decodes == ones and meta.max_query_len == max(s.num_tokens for s in seqs)
