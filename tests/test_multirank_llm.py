"""`LLM(...)` over several ranks (Ray actors, gloo on CPU) against one rank and against Hugging Face.

Two tiny models cover the layouts' corner cases: a GQA Llama with an odd vocabulary (padded under
TP) and 3 layers (uneven pipeline stages), and a Qwen3 with tied embeddings (the last stage holds its
own copy of the matrix) and one KV head (replicated on both TP ranks). Small step budgets mix
chunked prefills with decodes and give the pipeline several micro-batches per step.
"""
from __future__ import annotations

import time

import pytest
import ray

from tests.models import hf_greedy_argmax, prompts_of_lengths, tiny_model
from workers.executor import ExecutorError
from workers.loader import load_hf_config
from workers.models.transformer import head_dim_of, stage_layers
from engine.llm import LLM
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MODELS = {
    "llama": dict(num_hidden_layers=3, vocab_size=301),
    "qwen3": dict(num_key_value_heads=1),
}
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
}
BLOCK_SIZE = 8
KV_BYTES = 256 * 1024  # per rank: small enough that ranks with fewer layers or KV heads could hold more blocks
ENGINE_ARGS = dict(max_num_batched_tokens=24, max_num_seqs=8, block_size=BLOCK_SIZE, cpu_kv_cache_bytes=KV_BYTES, show_progress=False)
MAX_TOKENS = 6
PROMPTS = prompts_of_lengths([5, 17, 9, 30, 3], vocab_size=290, seed=7)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
# Each needs the full logits: top-n logprobs, a penalty, a seeded draw.
FULL_LOGITS = [
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=11),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=5, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3),
]


@pytest.fixture(scope="module", autouse=True)
def ray_session(shared_ray):
    # The session's Ray (tests/conftest.py), sized for the largest layout (4 ranks); LLM(...) would size it for its own.
    return shared_ray


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    """Per model: its folder, HF greedy tokens, and the one-rank engine's outputs."""
    refs = {}
    for name, overrides in MODELS.items():
        path = tiny_model(name, **overrides)
        llm = LLM(path, **ENGINE_ARGS)
        refs[name] = dict(path=path, hf=hf_greedy_argmax(path, PROMPTS, MAX_TOKENS), greedy=llm.generate(PROMPTS, GREEDY),
                          full=llm.generate(PROMPTS, FULL_LOGITS))
        llm.shutdown()
    return refs


def _expected_num_blocks(path: str, tp: int, pp: int) -> int:
    """The smallest block count of any stage: fp32 K and V of its layers for this rank's KV heads."""
    cfg = load_hf_config(path)
    kv_heads = max(1, cfg.num_key_value_heads // tp)
    per_layer = 2 * BLOCK_SIZE * kv_heads * head_dim_of(cfg) * 4
    return min(KV_BYTES // (per_layer * len(stage_layers(cfg.num_hidden_layers, pp, r))) for r in range(pp))


def _rank_cache_blocks(llm: LLM) -> list[int]:
    return ray.get([w.__ray_call__.remote(lambda worker: worker.runner.kv_cache.shape[2]) for w in llm.llm_engine.executor.workers],
                   timeout=60)


def _placement_groups_alive() -> int:
    return sum(1 for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED")


# Every layout on the Llama; the Qwen3 on the combined layout only, where both of its corner cases meet the code
# that handles them, on the same code paths as on a layout of their own: its one KV head is replicated over each
# stage's TP pair as over a plain TP pair, and its last stage loads its own copy of the tied matrix (sharded like
# every LM head under TP, as on the Llama's TP layouts) as a plain second stage does.
CASES = [("llama", layout) for layout in LAYOUTS] + [("qwen3", "tp2pp2")]


@pytest.mark.parametrize("name,layout", CASES, ids=[f"{n}-{l}" for n, l in CASES])
def test_layout_matches_one_rank_and_hf(name: str, layout: str, references):
    ref = references[name]
    llm = LLM(ref["path"], **LAYOUTS[layout], **ENGINE_ARGS)
    try:
        # Every rank's cache is cut to the smallest stage's block count (block ids are shared).
        blocks = _expected_num_blocks(ref["path"], LAYOUTS[layout].get("tensor_parallel_size", 1),
                                      LAYOUTS[layout].get("pipeline_parallel_size", 1))
        assert llm.llm_engine.executor.num_blocks == blocks
        assert _rank_cache_blocks(llm) == [blocks] * llm.config.parallel.world_size
        greedy = llm.generate(PROMPTS, GREEDY)
        own_fills = llm.llm_engine.executor.own_fills
        full = llm.generate(PROMPTS, FULL_LOGITS)
    finally:
        llm.shutdown()
    assert _placement_groups_alive() == 0
    # TP alone: every rank fills the greedy batch's steps sent ahead itself (tests/test_tp_own_fill.py); with PP the
    # first stage never sees the tokens, so the driver's fill stays.
    assert (own_fills > 0) == (layout == "tp2"), own_fills
    # Greedy batches take the sharded (max, id, lse) path under TP: same tokens, same logprobs.
    assert [o.token_ids for o in greedy] == ref["hf"]
    assert [o.token_ids for o in greedy] == [o.token_ids for o in ref["greedy"]]
    for got, want in zip(greedy, ref["greedy"]):
        assert [lp[t] for lp, t in zip(got.logprobs, got.token_ids)] == pytest.approx(
            [lp[t] for lp, t in zip(want.logprobs, want.token_ids)], abs=1e-4)
    # Mixed batches take the full-logits path: top-n logprobs, penalties and seeded draws agree too.
    assert [o.token_ids for o in full] == [o.token_ids for o in ref["full"]]
    for got_lp, want_lp in zip(full[0].logprobs, ref["full"][0].logprobs):
        assert list(got_lp) == list(want_lp)
        assert list(got_lp.values()) == pytest.approx(list(want_lp.values()), abs=1e-4)


def _wait_dead(actor, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.cuda_graph_sizes.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise TimeoutError("the killed rank is still alive")


def test_killed_rank_fails_fast_with_its_name(references):
    llm = LLM(references["llama"]["path"], pipeline_parallel_size=2, **ENGINE_ARGS)
    executor = llm.llm_engine.executor
    workers = list(executor.workers)
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == references["llama"]["hf"][:2]

    # Rank 1 (the second stage) dies between two steps of a generate: rank 0 then blocks on a send
    # that will never be received, and the executor must not wait for it.
    steps, step = [0], llm.llm_engine.step

    def step_then_kill():
        steps[0] += 1
        if steps[0] == 3:
            ray.kill(workers[1])
            _wait_dead(workers[1])  # ray.kill is asynchronous; steps are fast enough to finish before it lands
        return step()

    llm.llm_engine.step = step_then_kill
    start = time.monotonic()
    with pytest.raises(ExecutorError, match=r"rank 1 \(pp=1, sp=0, tp=0\) died"):
        llm.generate(PROMPTS, GREEDY)
    assert time.monotonic() - start < 30
    # Unusable afterwards, saying why; every rank is gone and the placement groups are removed.
    with pytest.raises(ExecutorError, match="failed earlier"):
        llm.generate(PROMPTS[:1], GREEDY)
    for w in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(w.execute.remote(None), timeout=30)
    assert _placement_groups_alive() == 0


@pytest.mark.parametrize("victim", [0, 1], ids=["first-stage", "answering-stage"])
def test_rank_killed_while_a_step_runs_fails_fast_with_its_name(references, victim):
    """A rank's process dies (SIGKILL) the moment a step has been sent to the ranks, so the step is in
    flight: the stage-0 victim leaves rank 1 blocked on a receive that never comes (the driver waits for
    rank 1's answer, not rank 0's), the stage-1 victim never answers. Either way the engine raises
    ExecutorError naming the dead rank within seconds, never a hang."""
    import os
    import signal

    llm = LLM(references["llama"]["path"], pipeline_parallel_size=2, **ENGINE_ARGS)
    executor = llm.llm_engine.executor
    workers = list(executor.workers)
    pid = ray.get(workers[victim].__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    submits, submit = [0], executor.submit

    def submit_then_kill(out, **kwargs):
        pending = submit(out, **kwargs)  # sent: both ranks are working on it (or on the step before) now
        submits[0] += 1
        if submits[0] == 3:
            os.kill(pid, signal.SIGKILL)
        return pending

    executor.submit = submit_then_kill
    start = time.monotonic()
    with pytest.raises(ExecutorError, match=rf"rank {victim} \(pp={victim}, sp=0, tp=0\) died"):
        llm.generate(PROMPTS, GREEDY)
    # the death met the step it was sent with, or (asynchronous scheduling) the one planned while it ran
    assert submits[0] in (3, 4)
    assert time.monotonic() - start < 15
    with pytest.raises(ExecutorError, match="failed earlier"):
        llm.generate(PROMPTS[:1], GREEDY)
    assert _placement_groups_alive() == 0


def test_layout_larger_than_the_cluster_fails_at_once(references):
    start = time.monotonic()
    with pytest.raises(ExecutorError, match="8 ranks need 8 CPUs"):
        LLM(references["llama"]["path"], tensor_parallel_size=2, pipeline_parallel_size=4, **ENGINE_ARGS)
    assert time.monotonic() - start < 10
    assert _placement_groups_alive() == 0
