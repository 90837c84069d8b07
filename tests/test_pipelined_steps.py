"""Pipelined steps under pipeline parallelism (EngineConfig.step_groups, vLLM's virtual engines).

The scheduler's part without a model: sequences form disjoint groups, a step runs one group, new prompts join
the group with fewer tokens, a preemption stays inside the step's group and frees at once. Then PP=2 and PP=4
engines over Ray rank actors (gloo on CPU): the first stage starts a step while the last stage still runs the
step before (the test fails with `pipeline_step_overlap=False`), and greedy output equals Hugging Face's with
chunked prefill, preemption and aborts.
"""
from __future__ import annotations

from collections import deque

import pytest
import ray

from engine.block_manager import BlockManager
from engine.llm import LLM
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence
from tests.models import hf_greedy_argmax, prompts_of_lengths, tiny_model
from workers.config import EngineConfig, SchedulerConfig
from workers.sampling_params import SamplingParams
from workers.scheduler_output import ModelRunnerOutput, SampledToken, SchedulerOutput

BS = 4


def _scheduler(num_blocks: int = 64, groups: int = 2, max_num_seqs: int = 16, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, BlockManager(num_blocks, BS, True), groups)


def _seq(seq_id: str, prompt_len: int, max_tokens: int = 4, priority: int = 0) -> Sequence:
    return Sequence(seq_id, [7 + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens), priority=priority)


def _apply(sched: Scheduler, out: SchedulerOutput) -> list[str]:
    """The step `out` answered (one token per sampled sequence): finish those at max_tokens; their ids."""
    sched.step_done()
    result = ModelRunnerOutput({s.seq_id: SampledToken(3, 0.0) for s in out.seqs if s.sample})
    done = []
    for seq in sched.update(out, result):
        if seq.num_output_tokens >= seq.sampling_params.max_tokens:
            sched.finish(seq, "length")
            done.append(seq.seq_id)
    return done


def _send(sched: Scheduler, group: int) -> SchedulerOutput | None:
    out = sched.schedule(group=group)
    if out is None or out.is_empty:
        return None
    sched.step_sent()
    return out


def test_a_burst_is_spread_over_the_groups_by_tokens():
    sched = _scheduler(budget=1000)
    for i, n in enumerate([8, 8, 8, 8, 20, 4, 4, 4]):
        sched.add(_seq(f"s{i}", n))
    first = _send(sched, 0)
    # In queue order each prompt joins the lighter group (ties: the group scheduled now); the others wait for theirs.
    assert [s.seq_id for s in first.seqs] == ["s0", "s2", "s4"]
    second = _send(sched, 1)
    assert [s.seq_id for s in second.seqs] == ["s1", "s3", "s5", "s6", "s7"]
    assert {s.seq_id: s.group for s in sched.running} == {"s0": 0, "s2": 0, "s4": 0, "s1": 1, "s3": 1, "s5": 1, "s6": 1,
                                                          "s7": 1}
    loads = [sum(s.num_tokens for s in sched.running if s.group == g) for g in (0, 1)]
    assert loads == [36, 28]


def test_a_lone_arrival_joins_the_lighter_group_at_its_next_step():
    sched = _scheduler()
    sched.add(_seq("long", 24, max_tokens=50))
    sched.add(_seq("short", 4, max_tokens=50))
    a, b = _send(sched, 0), _send(sched, 1)
    assert [s.seq_id for s in a.seqs] == ["long"] and [s.seq_id for s in b.seqs] == ["short"]
    _apply(sched, a)
    sched.add(_seq("new", 6))
    a = _send(sched, 0)  # group 0 is the heavier one: the arrival waits for group 1's step
    assert [s.seq_id for s in a.seqs] == ["long"] and sched.seqs["new"].status == SeqStatus.WAITING
    _apply(sched, b)
    b = _send(sched, 1)
    assert [s.seq_id for s in b.seqs] == ["short", "new"] and sched.seqs["new"].group == 1


def test_steps_out_never_share_a_sequence_and_groups_keep_their_members():
    """Two steps out at all times, as the engine keeps them: each group's next step is planned only once its
    last one answered, so no sequence is ever in two steps out, and a sequence runs in one group until it ends."""
    sched = _scheduler(num_blocks=64, budget=24)
    lengths = [5, 17, 9, 30, 3, 11, 2, 14, 6, 21]
    for i, n in enumerate(lengths):
        sched.add(_seq(f"s{i}", n, max_tokens=3 + i % 4))
    out: deque[tuple[SchedulerOutput, int]] = deque()
    group_of: dict[str, int] = {}
    finished: list[str] = []
    for _ in range(300):
        for g in (0, 1):
            if g not in {group for _, group in out} and (step := _send(sched, g)) is not None:
                ids = [s.seq_id for s in step.seqs]
                assert all(sched.seqs[i].group == g for i in ids)
                for i in ids:  # stable membership (a preemption may move a sequence, and none happens here)
                    assert group_of.setdefault(i, g) == g
                for other, _ in out:
                    assert not set(ids) & {s.seq_id for s in other.seqs}
                out.append((step, g))
        if not out:
            break
        step, _ = out.popleft()
        finished += _apply(sched, step)
    assert sorted(finished) == sorted(f"s{i}" for i in range(len(lengths)))
    assert set(group_of.values()) == {0, 1} and sched.num_preemptions == 0
    assert sched.blocks.num_used_blocks == 0 and sched.num_parked_blocks == 0


def test_a_preemption_takes_a_victim_of_the_same_group_and_frees_it_at_once():
    """With another group's step out, a preempted sequence's blocks are free for the step being planned (parking
    them, as for a sequence in a step out, would free nothing and preempt the whole group)."""
    sched = _scheduler(num_blocks=8, budget=100)
    for name, n in (("a", 8), ("b", 8), ("c", 7), ("d", 7)):  # 2 blocks each: the cache is full
        sched.add(_seq(name, n, max_tokens=20, priority={"a": 0, "b": 0, "c": 1, "d": 1}[name]))
    g0, g1 = _send(sched, 0), _send(sched, 1)
    assert [s.seq_id for s in g0.seqs] == ["a", "c"] and [s.seq_id for s in g1.seqs] == ["b", "d"]
    _apply(sched, g0)  # group 1's step stays out
    g0 = _send(sched, 0)  # a needs a third block: c (its group's least important) goes, not d (group 1, in flight)
    assert [s.seq_id for s in g0.seqs] == ["a"] and sched.num_preemptions == 1
    assert sched.seqs["c"].status == SeqStatus.WAITING and sched.seqs["d"].status == SeqStatus.RUNNING
    assert sched.num_parked_blocks == 0


def test_max_num_seqs_bounds_each_groups_step():
    sched = _scheduler(max_num_seqs=2, budget=1000)
    for i in range(6):
        sched.add(_seq(f"s{i}", 4))
    assert len(_send(sched, 0).seqs) == 2 and len(_send(sched, 1).seqs) == 2
    assert len(sched.waiting) == 2


def test_step_groups_follow_the_config():
    def groups(**kwargs) -> int:
        return EngineConfig.from_kwargs(model=tiny_model("llama"), **kwargs).step_groups

    assert groups(pipeline_parallel_size=2) == 2 and groups(pipeline_parallel_size=4) == 4
    assert groups(pipeline_parallel_size=2, pipeline_step_overlap=False) == 1
    assert groups(tensor_parallel_size=2) == 1 and groups() == 1
    assert groups(pipeline_parallel_size=2, sequence_parallel_size=2) == 1
    assert groups(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}) == 1


# ---------------------------------------------------------------- engines over rank actors

BLOCK_SIZE = 8
ENGINE_ARGS = dict(max_num_batched_tokens=24, max_num_seqs=8, block_size=BLOCK_SIZE, cpu_kv_cache_bytes=256 * 1024,
                   show_progress=False)
PROMPTS = prompts_of_lengths([5, 17, 9, 30, 3, 12], vocab_size=290, seed=5)
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
DELAY_S = 0.25  # the last stage's extra time per step in the overlap test


@pytest.fixture(scope="module")
def model(shared_ray) -> dict:
    """A 4-layer Llama (one layer per stage at PP=4) and its Hugging Face greedy tokens."""
    path = tiny_model("llama", num_hidden_layers=4, vocab_size=301)
    return dict(path=path, hf=hf_greedy_argmax(path, PROMPTS, MAX_TOKENS))


def _step_recorder(delay_s: float):
    """A function for a rank (`__ray_call__`) that makes it log each step's (start, end, all decodes?, sequence ids),
    after sleeping `delay_s` first (a slow stage, so that whether the stage before starts its next step meanwhile is
    plain to see). Made here, nested, so that Ray ships it by value (the ranks cannot import this test module)."""
    def record(worker) -> None:
        import time

        runner = worker.runner
        real = runner.execute
        worker.step_log = []

        def execute(out):
            start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of this machine
            time.sleep(delay_s)
            result = real(out)
            worker.step_log.append((start, time.monotonic(), all(s.num_tokens == 1 for s in out.seqs),
                                    frozenset(s.seq_id for s in out.seqs)))
            return result

        runner.execute = execute

    return record


def _step_logs(llm: LLM) -> list[list[tuple]]:
    return ray.get([w.__ray_call__.remote(lambda worker: worker.step_log) for w in llm.llm_engine.executor.workers],
                   timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("overlap,async_scheduling", [(True, True), (True, False), (False, True)],
                         ids=["pipelined", "pipelined-sync", "one-step-at-a-time"])
def test_pp2_first_stage_starts_a_step_while_the_last_stage_runs_the_one_before(model, overlap, async_scheduling):
    llm = LLM(model["path"], pipeline_parallel_size=2, pipeline_step_overlap=overlap, async_scheduling=async_scheduling,
              **ENGINE_ARGS)
    executor = llm.llm_engine.executor
    sent_ahead, submit = [0], executor.submit

    def counting_submit(out, **kwargs):
        sent_ahead[0] += bool(kwargs.get("ahead"))
        return submit(out, **kwargs)

    executor.submit = counting_submit
    try:
        workers = executor.workers
        ray.get([workers[0].__ray_call__.remote(_step_recorder(0.0)), workers[1].__ray_call__.remote(_step_recorder(DELAY_S))],
                timeout=60)
        outputs = llm.generate(PROMPTS, GREEDY)
        first, last = _step_logs(llm)
        assert llm.llm_engine.step_groups == (2 if overlap else 1)
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outputs] == model["hf"]
    assert len(first) == len(last) and [s[3] for s in first] == [s[3] for s in last]  # the same steps, in order
    # Decode steps that stage 0 began well before stage 1 had finished the step sent before them (stage 1 sleeps
    # DELAY_S in each step: pipelined, stage 0 starts group A's step as stage 1 starts group B's).
    decodes = [k for k in range(1, len(first)) if first[k][2]]
    overlapped = [k for k in decodes if first[k][0] < last[k - 1][1] - DELAY_S / 2]
    if overlap:  # all but the steps of a group left alone at the end
        assert len(decodes) >= 12 and len(overlapped) >= len(decodes) - 2, (len(overlapped), len(decodes))
        # Steps in flight together run the two groups: no sequence in both.
        assert all(not (first[k][3] & first[k - 1][3]) for k in overlapped)
        # With async scheduling a group's next step goes out before its last one answered (placeholders, then a fill).
        assert (sent_ahead[0] >= len(decodes) // 2) if async_scheduling else sent_ahead[0] == 0
    else:  # a decode step needs the tokens of the step before: it waits for all of it
        assert len(decodes) >= 6 and all(first[k][0] > last[k - 1][1] for k in decodes)


@pytest.mark.slow
def test_pp2_pipelined_with_preemption_and_aborts_matches_hf(model):
    """A cache too small for every sequence at once forces preemptions (recomputed: greedy tokens unchanged);
    aborts land while steps of both groups are out. The surviving requests' tokens equal Hugging Face's, and
    every block comes back."""
    llm = LLM(model["path"], pipeline_parallel_size=2, **{**ENGINE_ARGS, "num_gpu_blocks_override": 9})
    engine = llm.llm_engine
    try:
        assert engine.step_groups == 2
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, GREEDY)
        outputs: dict[str, list[int]] = {}
        aborted: set[str] = set()
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.token_ids
            steps += 1
            if steps in (4, 9):  # a running sequence in a step out (either group) and one still waiting
                running = [s.seq_id for out, _, _ in engine._pipeline for s in out.seqs]
                victim = next(r for r in running if r not in aborted)
                assert engine.abort(victim).finish_reason == "abort"
                aborted.add(victim)
        engine.drain()
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_used_blocks == 0 and engine.scheduler.num_parked_blocks == 0
    finally:
        llm.shutdown()
    assert len(aborted) == 2 and not aborted & set(outputs)
    for i, want in enumerate(model["hf"]):
        if f"r{i}" not in aborted:
            assert outputs[f"r{i}"] == want, i


@pytest.mark.slow
def test_pp4_pipelined_matches_hf(model):
    """Four stages (one layer each), four groups: chunked prefill and decodes equal Hugging Face's greedy tokens."""
    llm = LLM(model["path"], pipeline_parallel_size=4, **ENGINE_ARGS)
    try:
        assert llm.llm_engine.step_groups == 4
        outputs = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outputs] == model["hf"]
