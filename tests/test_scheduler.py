"""Scheduler + BlockManager unit tests (no model): priorities, preemption victims, token budget."""
import pytest

from workers.config import SchedulerConfig
from engine.block_manager import BlockManager
from workers.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from workers.scheduler_output import ModelRunnerOutput, SampledToken
from engine.sequence import SeqStatus, Sequence

BS = 4


def make(num_blocks=64, max_num_seqs=16, max_num_batched_tokens=64, prefix_caching=True) -> Scheduler:
    bm = BlockManager(num_blocks, BS, prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens), bm)


def seq(seq_id: str, prompt_len: int, priority: int = 0, max_tokens: int = 4, first_token: int = 0) -> Sequence:
    tokens = [first_token + i for i in range(prompt_len)]
    return Sequence(seq_id, tokens, SamplingParams(max_tokens=max_tokens), priority=priority)


def step(sched: Scheduler, token: int = 1):
    """Schedule, pretend the model ran, append `token` to sampled sequences, finish those at max_tokens.

    Returns (scheduled (id, num_tokens) pairs, finished ids)."""
    out = sched.schedule()
    result = ModelRunnerOutput({s.seq_id: SampledToken(token, 0.0) for s in out.seqs if s.sample})
    finished = []
    for sq in sched.update(out, result):
        if sq.num_output_tokens >= sq.sampling_params.max_tokens:
            sched.finish(sq, "length")
            finished.append(sq.seq_id)
    sched.blocks.check_invariants()
    return [(s.seq_id, s.num_tokens) for s in out.seqs], finished


def run_to_completion(sched: Scheduler, max_steps: int = 500) -> list[str]:
    order = []
    for _ in range(max_steps):
        if not sched.has_work:
            break
        _, finished = step(sched)
        order += finished
    assert not sched.has_work, "scheduler did not drain"
    assert sched.blocks.num_used_blocks == 0
    return order


# ---- priority ----


def test_lower_priority_value_is_served_first_with_one_slot():
    sched = make(max_num_seqs=1)
    sched.add(seq("early-low", 5, priority=2))
    sched.add(seq("early-mid", 5, priority=1))
    sched.add(seq("late-high", 5, priority=0))  # submitted last, most important
    scheduled, _ = step(sched)
    assert scheduled == [("late-high", 5)]
    sched.add(seq("later-mid", 5, priority=1))
    # Ties (priority 1) go to the earlier arrival.
    assert run_to_completion(sched) == ["late-high", "early-mid", "later-mid", "early-low"]


def test_completion_order_follows_priority_then_arrival():
    sched = make(max_num_seqs=1)
    for name, prio in [("a", 3), ("b", 1), ("c", 3), ("d", 0), ("e", 1)]:
        sched.add(seq(name, 3, priority=prio))
    assert run_to_completion(sched) == ["d", "b", "e", "a", "c"]


def test_waiting_queue_is_sorted_by_priority_then_arrival():
    sched = make()
    for name, prio in [("x", 5), ("y", -1), ("z", 5), ("w", 0)]:
        sched.add(seq(name, 2, priority=prio))
    assert [s.seq_id for s in sched.waiting] == ["y", "w", "x", "z"]


# ---- preemption ----


def _fill_running(sched: Scheduler, specs, max_tokens: int = 10) -> None:
    """Admit sequences (id, prompt_len, priority) and prefill them in one step."""
    for name, n, prio in specs:
        sched.add(seq(name, n, priority=prio, max_tokens=max_tokens, first_token=1000 * len(sched.seqs)))
    scheduled, _ = step(sched)
    assert {name for name, _ in scheduled} == {name for name, _, _ in specs}


def test_preemption_victim_is_lowest_priority():
    # 3 prompts of 8 tokens fill 6 of 6 blocks; their first decode needs a new block each.
    sched = make(num_blocks=6)
    _fill_running(sched, [("important", 8, 0), ("unimportant", 8, 5), ("middle", 8, 1)])
    assert sched.blocks.num_free_blocks == 0
    scheduled, _ = step(sched)
    assert sched.num_preemptions >= 1
    assert [s.seq_id for s in sched.waiting][-1] == "unimportant"
    assert sched.seqs["unimportant"].status == SeqStatus.WAITING
    assert sched.seqs["unimportant"].num_preemptions == 1
    assert sched.seqs["unimportant"].block_table == [] and sched.seqs["unimportant"].num_computed_tokens == 0
    assert "important" in dict(scheduled)
    assert sched.seqs["important"].num_preemptions == 0


def test_preemption_victim_among_equal_priorities_is_latest_arrival():
    sched = make(num_blocks=6)
    _fill_running(sched, [("first", 8, 1), ("second", 8, 1), ("third", 8, 1)])
    step(sched)
    assert sched.seqs["third"].num_preemptions == 1
    assert sched.seqs["first"].num_preemptions == 0
    assert sched.seqs["second"].num_preemptions == 0


def test_priority_beats_arrival_for_preemption():
    sched = make(num_blocks=6)
    _fill_running(sched, [("old-low", 8, 3), ("new-high", 8, 0), ("newest-high", 8, 0)])
    step(sched)
    assert sched.seqs["old-low"].num_preemptions == 1
    assert sched.seqs["newest-high"].num_preemptions == 0


def test_no_admission_in_a_step_that_preempts_and_preempted_seq_resumes():
    sched = make(num_blocks=6)
    _fill_running(sched, [("a", 8, 0), ("b", 8, 0), ("c", 8, 0)])
    sched.add(seq("new", 1, priority=-1))  # most important, but waits: this step preempts
    scheduled, _ = step(sched)
    assert sched.num_preemptions >= 1
    assert "new" not in dict(scheduled)
    assert sched.seqs["new"].status == SeqStatus.WAITING
    # Everything finishes; the preempted sequence recomputes its prompt and its output so far.
    order = run_to_completion(sched)
    assert sorted(order) == ["a", "b", "c", "new"]


def test_preempted_sequence_recomputes_prompt_and_output():
    sched = make(num_blocks=5, prefix_caching=False)
    _fill_running(sched, [("a", 7, 0), ("b", 7, 1)])  # 2 + 2 blocks of 5
    scheduled, _ = step(sched)  # decode 1: positions 7, fits in block 1 of each
    assert dict(scheduled) == {"a": 1, "b": 1}
    scheduled, _ = step(sched)  # decode 2: position 8 needs a third block each; one is free: b is preempted
    b = sched.seqs["b"]
    assert b.status == SeqStatus.WAITING and b.num_output_tokens == 2
    assert dict(scheduled) == {"a": 1}
    # Once a finishes, b's recompute covers its prompt plus the 2 tokens it had generated.
    while sched.seqs.get("a") is not None:
        step(sched)
    scheduled, _ = step(sched)
    assert dict(scheduled) == {"b": 9}


def test_sequence_alone_that_cannot_grow_preempts_itself():
    sched = make(num_blocks=2)
    sched.add(seq("a", 7, max_tokens=100))
    step(sched)
    step(sched)  # position 7: still 2 blocks
    step(sched)  # position 8 needs a third block: nothing else to preempt
    assert sched.seqs["a"].status == SeqStatus.WAITING
    assert sched.num_preemptions == 1
    assert sched.blocks.num_used_blocks == 0


# ---- token budget / chunked prefill ----


def test_token_budget_chunks_prefill_and_decodes_go_first():
    sched = make(max_num_batched_tokens=6)
    sched.add(seq("a", 10))
    assert step(sched)[0] == [("a", 6)]
    sched.add(seq("b", 9, first_token=100))  # no prefix shared with a
    assert step(sched)[0] == [("a", 4), ("b", 2)]  # a finishes its prompt (and samples), b starts
    assert step(sched)[0] == [("a", 1), ("b", 5)]  # a's decode first, b gets the rest
    assert step(sched)[0] == [("a", 1), ("b", 2)]
    assert step(sched)[0] == [("a", 1), ("b", 1)]


def test_only_the_chunk_that_completes_the_prompt_samples():
    sched = make(max_num_batched_tokens=5)
    sched.add(seq("a", 12))
    samples = []
    for _ in range(4):
        out = sched.schedule()
        samples.append([(s.start_pos, s.num_tokens, s.sample) for s in out.seqs])
        sched.update(out, ModelRunnerOutput({s.seq_id: SampledToken(1, 0.0) for s in out.seqs if s.sample}))
    assert samples == [[(0, 5, False)], [(5, 5, False)], [(10, 2, True)], [(12, 1, True)]]
    sched.finish(sched.seqs["a"], "abort")
    assert sched.blocks.num_used_blocks == 0


def test_max_num_seqs_limits_running():
    sched = make(max_num_seqs=2)
    for i in range(4):
        sched.add(seq(f"s{i}", 3))
    scheduled, _ = step(sched)
    assert [name for name, _ in scheduled] == ["s0", "s1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    assert sorted(run_to_completion(sched)) == ["s0", "s1", "s2", "s3"]


def test_prefix_hit_at_admission_skips_cached_tokens():
    sched = make()
    sched.add(seq("a", 10))
    step(sched)
    sched.add(seq("b", 12))  # same first 10 tokens (0..9): blocks 0 and 1 are cached
    scheduled, _ = step(sched)
    assert ("b", 4) in scheduled
    assert sched.seqs["b"].num_cached_tokens == 8
    assert sched.blocks.hit_tokens == 8


def test_abort_waiting_and_running_frees_blocks():
    sched = make(max_num_seqs=1)
    sched.add(seq("run", 9))
    sched.add(seq("wait", 5))
    step(sched)
    assert sched.blocks.num_used_blocks > 0
    assert sched.abort("wait").seq_id == "wait"
    assert sched.abort("run").finish_reason == "abort"
    assert sched.abort("unknown") is None
    assert not sched.has_work and sched.blocks.num_used_blocks == 0
    sched.blocks.check_invariants()
    out = sched.schedule()
    assert out.is_empty and sorted(out.finished_seq_ids) == ["run", "wait"]


def test_duplicate_and_oversized_requests_rejected():
    sched = make(num_blocks=2)
    sched.add(seq("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(seq("a", 3))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(seq("big", 8))
