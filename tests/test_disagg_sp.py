"""Disaggregated serving with a sequence-parallel prefill replica (Ray actors, gloo on CPU): each SP rank
holds only the blocks it owns, so each block of the prompt's KV is sent by its owner's ranks, into a
decode replica that holds every block.

- "sp2->tp1": a GQA Llama prefilled on 2 SP ranks and decoded on 1 rank.
- "tp2xsp2->tp2": the same model prefilled on 2 SP x 2 TP ranks (one KV head each) and decoded on 2 TP ranks.
Prompts span several blocks per SP rank and are prefilled in chunks; a second prompt sharing a prefix
with the first starts its transfer after the decode side's prefix hits, at a block index that is not
a multiple of the SP period, so the owners come from absolute block indices. Both pools end clean.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.models import hf_greedy, prompts_of_lengths, tiny_model
from tests.test_disagg import (  # noqa: F401 - `run` and `reference` are fixtures
    BLOCK, PREFILL_CHUNK, VOCAB, assert_same_output, blocks_needed, build_pair, generate, greedy,
    kv_bytes_per_block, reference, run, settle,
)
from workers.config import EngineConfig
from engine.disagg import DecodeReplica

pytestmark = pytest.mark.slow

LAYOUTS = {  # prefill, decode
    "sp2->tp1": (dict(sequence_parallel_size=2), dict(tensor_parallel_size=1)),
    "tp2xsp2->tp2": (dict(sequence_parallel_size=2, tensor_parallel_size=2), dict(tensor_parallel_size=2)),
}


@pytest.fixture(scope="module")
def ray_session(shared_ray):
    # 6 ranks at most (4 prefill + 2 decode): the session's Ray (tests/conftest.py) has 6 logical CPUs.
    return shared_ray


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pair(request, ray_session, run):
    pair = build_pair(tiny_model("llama"), dict(LAYOUTS[request.param][0], max_num_batched_tokens=PREFILL_CHUNK),
                      LAYOUTS[request.param][1])
    yield pair
    pair.shutdown()


def test_sp_prefill_to_decode_matches_hf_and_single_process(pair, run, reference):
    tp = len(pair.prefill.shards) // 2
    assert [(s.sp_rank, s.sp_size) for s in pair.prefill.shards] == [(r // tp, 2) for r in range(2 * tp)]  # rank = sp * tp + t
    assert all(s.sp_size == 1 for s in pair.decode.shards)
    per_block = kv_bytes_per_block(pair.path, pair.decode.shards)
    # 37 tokens: 10 blocks, 5 on each SP rank, prefilled in 3 chunks. The next prompt shares 3 full
    # blocks with it (held by the decode side by then): its transfer starts at block 3, SP rank 0's.
    long, short, tail = prompts_of_lengths([37, 6, 15], VOCAB, seed=21)
    shared = long[:3 * BLOCK + 2] + tail
    prompts = [long, short, shared]
    params = greedy(8, logprobs=2)  # the first token's logprobs are sampled on the prefill side's first SP rank
    n = len(pair.decode.transfers)
    outs = [run(generate(pair.decode, f"sp-{i}", p, params)) for i, p in enumerate(prompts)]
    for out, want, prompt in zip(outs, reference(pair.path, prompts, params), prompts, strict=True):
        assert out.token_ids == hf_greedy(pair.path, prompt, 8)[0]
        assert_same_output(out, want)
    hits = [0, 0, 3]
    assert [o.num_cached_tokens for o in outs] == [h * BLOCK for h in hits]
    assert [(t.blocks, t.bytes) for t in pair.decode.transfers[n:]] == \
        [(blocks_needed(len(p)) - h, (blocks_needed(len(p)) - h) * per_block) for p, h in zip(prompts, hits)]
    run(settle(pair))  # both pools: no block in use, nothing held or reserved


def test_decode_replica_refuses_sp():
    # The check comes before the replica touches its engine: a config is all it needs.
    engine = SimpleNamespace(config=EngineConfig.from_kwargs(model=tiny_model("llama"), sequence_parallel_size=2))
    with pytest.raises(ValueError, match="decode replicas do not support sequence_parallel_size > 1"):
        DecodeReplica(engine, None)
