"""Disaggregated serving with an FP8 KV cache (`kv_cache_dtype="fp8"` on both pools, as router/config.py
requires): a GQA Llama prefilled on 2 TP ranks (one KV head each) hands its e4m3 blocks to a decode
replica on 1 rank (both heads), over gloo between Ray actors.

The handoff moves the cache's bytes as they are, one per value (half a bf16 cache's, a quarter of the
float32 cache CPU engines use by default), so a handed-off greedy request produces the same tokens as
the single-process engine with the same FP8 cache. A prompt sharing a prefix with an earlier one gets
only its missing blocks. Both pools end clean.
"""
from __future__ import annotations


import pytest
from transformers import AutoConfig

from tests.models import prompts_of_lengths, tiny_model
from tests.test_disagg import (  # noqa: F401 - `run` is a fixture
    BLOCK, PREFILL_CHUNK, VOCAB, blocks_needed, build_pair, generate, greedy, run, settle,
)
from engine.llm import LLM
from workers.kv_transfer.plan import RankShard

pytestmark = pytest.mark.slow

FP8 = dict(kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def ray_session(shared_ray):
    return shared_ray  # the session's local Ray (tests/conftest.py)


@pytest.fixture(scope="module")
def pair(ray_session, run):
    pair = build_pair(tiny_model("llama"), dict(tensor_parallel_size=2, max_num_batched_tokens=PREFILL_CHUNK, **FP8),
                      dict(tensor_parallel_size=1, **FP8))
    yield pair
    pair.shutdown()


def fp8_bytes_per_block(path: str, shards: list[RankShard]) -> int:
    """KV bytes of one block on a replica with an FP8 cache: one byte per value, summed over its ranks."""
    cfg = AutoConfig.from_pretrained(path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return sum(2 * len(s.layers) * BLOCK * len(s.heads) * head_dim * 1 for s in shards)


def test_fp8_kv_handoff_matches_single_process_fp8_engine(pair, run):
    assert [s.heads for s in pair.prefill.shards] == [range(0, 1), range(1, 2)]
    assert [s.heads for s in pair.decode.shards] == [range(0, 2)]
    long, short, tail = prompts_of_lengths([21, 6, 7], VOCAB, seed=3)
    shared = long[:3 * BLOCK + 1] + tail  # 3 full blocks already on the decode side by then
    prompts, params = [long, short, shared], greedy(8)
    n = len(pair.decode.transfers)
    outs = [run(generate(pair.decode, f"fp8-{i}", p, params)) for i, p in enumerate(prompts)]
    assert pair.prefill_calls[-3:] == [f"fp8-{i}" for i in range(3)]  # every prompt ran on the prefill side

    llm = LLM(pair.path, block_size=BLOCK, show_progress=False, **FP8)
    try:
        want = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    assert [o.text for o in outs] == [w.text for w in want]

    hits = [0, 0, 3]
    assert [o.num_cached_tokens for o in outs] == [h * BLOCK for h in hits]
    per_block = fp8_bytes_per_block(pair.path, pair.decode.shards)
    assert [(t.blocks, t.bytes) for t in pair.decode.transfers[n:]] == \
        [(blocks_needed(len(p)) - h, (blocks_needed(len(p)) - h) * per_block) for p, h in zip(prompts, hits)]
    run(settle(pair))
