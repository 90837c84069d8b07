"""SP start-up allocates no sequence² buffer (issue 25): the KV-budget profiling step of every SP rank
(`ModelRunner._run_profile_step`, what `_gpu_kv_budget` runs on a GPU) is a full
max_num_batched_tokens ring prefill, and on two H200s a 64K-token one asked for 128 GiB: one
[Hq, T/2, T/2] fp32 score matrix. Here the same step runs on CPU ranks (gloo) with every score tensor
recorded; the largest must be one tile, whatever the prompt length.
"""
from __future__ import annotations

import pytest
import torch

import parallel.ring_attention as ring_mod
from tests.models import tiny_model
from tests.multiprocess import run_ranks
from workers.config import EngineConfig
from workers.loader import load_hf_config

pytestmark = pytest.mark.slow

PROMPT = 2048  # tokens of the profiling step: 1024 queries per rank at SP=2, 512 at SP=4
TILES = ring_mod.CPU_TILES


def _profile_scores(rank: int, path: str, sp: int) -> None:
    from workers.model_runner import ModelRunner  # in the rank: the forkserver preloads only torch

    shapes: list[tuple[int, ...]] = []
    real = ring_mod._tile_scores

    def spy(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        out = real(q, k, scale)
        shapes.append(tuple(out.shape))
        return out

    ring_mod._tile_scores = spy
    hf = load_hf_config(path)
    config = EngineConfig.from_kwargs(model=path, sequence_parallel_size=sp, max_num_batched_tokens=PROMPT,
                                      max_model_len=PROMPT, block_size=16, num_gpu_blocks_override=PROMPT // 16)
    runner = ModelRunner(config, hf, PROMPT, eos_token_ids=[], show_progress=False)
    probe_bytes = runner._run_profile_step()
    assert probe_bytes > 0 and shapes, "the profiling step ran no ring attention"
    g = hf.num_attention_heads // hf.num_key_value_heads
    rows, cols = max(s[1] for s in shapes), max(s[2] for s in shapes)
    # One tile at most ([Hkv, g * tile_q, tile_k]); the dense path made [Hkv, g * T/sp, ~T/sp] per pair.
    assert rows <= g * TILES[0] and cols <= TILES[1], (rows, cols)
    assert max(s[0] * s[1] * s[2] for s in shapes) <= hf.num_attention_heads * TILES[0] * TILES[1]
    queries = PROMPT // sp
    assert rows < g * queries  # the bound is the tile's, well below this rank's share of the prompt


@pytest.mark.parametrize("sp", [2, 4])
def test_sp_profiling_step_scores_are_bounded_by_the_tile(sp: int):
    path = tiny_model("llama", max_position_embeddings=PROMPT)
    run_ranks(_profile_scores, sp, path, sp)


def _profile_and_prompt_plans(rank: int, path: str, sp: int) -> None:
    import workers.model_runner as runner_mod
    from workers.kv_layout import block_owner
    from workers.model_runner import ModelRunner
    from workers.sampling_params import SamplingParams
    from workers.scheduler_output import ScheduledSeq, SchedulerOutput

    plans: list[tuple] = []
    real = runner_mod.plan_sp_step

    def spy(*args, **kwargs):
        planned = real(*args, **kwargs)
        ring = planned[2].sp.ring
        plans.append((planned[0].shape[0], ring.q_shard.num_tokens, tuple(s.num_tokens for s in ring.kv_shards),
                      ring.kv_slots.shape[0], len(planned[3])))
        return planned

    runner_mod.plan_sp_step = spy
    per_rank = PROMPT // 16
    config = EngineConfig.from_kwargs(model=path, sequence_parallel_size=sp, max_num_batched_tokens=PROMPT,
                                      max_model_len=PROMPT, block_size=16, num_gpu_blocks_override=per_rank)
    runner = ModelRunner(config, load_hf_config(path), PROMPT, eos_token_ids=[], show_progress=False)
    runner._run_profile_step()
    runner.kv_cache = runner._allocate_kv_cache(runner.num_blocks)  # the profile detached its scratch KV
    taken = [0] * sp  # block ids as the engine's block manager hands them out: block i from pool block_owner(i)
    table = []
    for i in range(per_rank):
        pool = block_owner(i, sp)
        table.append(pool * per_rank + taken[pool])
        taken[pool] += 1
    prompt = ScheduledSeq("prompt", [7] * PROMPT, 0, table, True, SamplingParams(temperature=0.0, max_tokens=1), 0)
    runner.execute(SchedulerOutput([prompt]))
    profile, full = plans
    # Same tokens on this rank, same ring (its queries, every rank's keys), same rows sampled here.
    assert profile == full, (profile, full)


def test_sp_profiling_step_is_a_full_length_prefill_on_every_rank():
    """What each rank computes in the KV-budget profiling step is what a real max_num_batched_tokens
    prompt gives it: the 128K OOM on 2 H100s (tests/test_step_memory.py) was not a smaller profile."""
    path = tiny_model("llama", max_position_embeddings=PROMPT)
    run_ranks(_profile_and_prompt_plans, 2, path, 2)
