"""Asynchronous scheduling: step n+1 is planned and sent while the ranks compute step n.

The tokens of step n reach the ranks in a follow-up `fill`; a sequence that step n ends (EOS, a stop
string, an abort) runs once more in step n+1, its token dropped and its blocks parked until that step
answers. None of this may change an output: the rank-actor engine must equal the in-process one exactly,
under chunked prefill, preemption (which falls back to one step at a time), seeded sampling, logprobs,
penalties (which keep their own sequences' steps synchronous) and stop strings, and come to rest with
every block free.
"""
from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.llm import LLM
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from tests.models import assert_engine_clean
from workers.config import SchedulerConfig
from workers.executor import ExecutorError
from workers.launched_step import LAUNCH_AHEAD_ENV
from workers.sampling_params import SamplingParams
from workers.scheduler_output import PLACEHOLDER_TOKEN, SampledToken, ModelRunnerOutput, fill_placeholders

MODEL = "models/tandem-tiny"
PROMPTS = ["import os\n", "def add(a, b):\n", "class Stack:\n", "for i in range(10):\n", "# parse the file\n",
           "x = [", "while True:\n", "print(", "def add(a, b):\n    return"]


def _params(reference: list[str]) -> list[SamplingParams]:
    params = []
    for i, text in enumerate(reference):
        stop = [text[len(text) // 2: len(text) // 2 + 3]] if len(text) > 8 and i % 2 else []
        params.append(SamplingParams(max_tokens=10 + 3 * i, temperature=0.0, stop=stop, logprobs=2 if i == 3 else None))
    params[1] = SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=11)  # seeded: same draws either way
    params[4] = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    params[6] = SamplingParams(max_tokens=14, temperature=0.8, seed=5, repetition_penalty=1.3)  # its steps: one at a time
    return params


def _assert_same(got, expected) -> None:
    """Tokens, text and finish exactly; logprobs to 1e-4 (fp32 sums differ in the last bits with the batch's
    make-up, which the preemptions and chunks change from one engine to the other)."""
    assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in got] == \
        [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in expected]
    for g, e in zip(got, expected):
        assert (g.logprobs is None) == (e.logprobs is None)
        for a, b in zip(g.logprobs or [], e.logprobs or []):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


# 12 blocks of 16 tokens for 9 sequences of up to ~45 tokens: preemption; 24-token steps: chunked prompts.
ENGINE = dict(model=MODEL, dtype="float32", device="cpu", num_gpu_blocks_override=12, block_size=16,
              max_num_batched_tokens=24, async_scheduling=True)


@pytest.fixture(scope="module")
def in_process():
    """The in-process engine's outputs for `_params` (the reference of every layout below), one step at a time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LAUNCH_AHEAD_ENV, "0")
        uni = LLM(**ENGINE, distributed_executor_backend="uni")
    assert not uni.llm_engine.async_scheduling
    reference = [o.text for o in uni.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)]
    params = _params(reference)
    expected = uni.generate(PROMPTS, params, use_tqdm=False)
    assert uni.llm_engine.scheduler.num_preemptions > 0, "the test needs preemption"
    uni.llm_engine.shutdown()
    return params, expected


@pytest.fixture(scope="module")
def greedy_reference():
    """The in-process engine's all-greedy outputs, one step at a time: steps of prefill chunks among plain greedy
    decodes only, which TANDEM_LAUNCH_MIXED=1 launches (a step with any sampled sequence runs whole)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LAUNCH_AHEAD_ENV, "0")
        uni = LLM(**ENGINE, distributed_executor_backend="uni")
    try:
        return uni.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    finally:
        uni.llm_engine.shutdown()


def _run_ahead_twice(llm: LLM, params: list[SamplingParams], expected, preempts: bool = True) -> list[bool]:
    """Two rounds (the second starts on a cache holding the first's prefixes), each equal to the in-process
    engine's and leaving the engine clean; returns whether each step was sent ahead."""
    engine = llm.llm_engine
    assert engine.async_scheduling
    aheads: list[bool] = []
    submit = engine.executor.submit
    engine.executor.submit = lambda out, ahead=False: aheads.append(ahead) or submit(out, ahead)
    for _ in range(2):
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        _assert_same(got, expected)
        assert_engine_clean(llm)
        assert engine.scheduler.num_parked_blocks == 0
    assert sum(aheads) > 10, "steps were not sent ahead"
    assert engine.scheduler.num_preemptions > 0 or not preempts
    return aheads


@pytest.mark.slow
def test_ahead_steps_equal_the_in_process_engine(shared_ray, in_process):
    params, expected = in_process
    llm = LLM(**ENGINE, distributed_executor_backend="ray")
    try:
        # One rank fills a step sent ahead itself, from its own answer: the engine builds no token list for it.
        llm.llm_engine.executor.fill = lambda tokens: pytest.fail("fill() at world size 1")
        _run_ahead_twice(llm, params, expected)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("mixed", ["0", "1"], ids=["decode-steps", "mixed-steps-too"])
@pytest.mark.parametrize("layout", [{"distributed_executor_backend": "ray"}, {"tensor_parallel_size": 2}],
                         ids=["ray-tp1", "tp2"])
def test_ranks_that_launch_ahead_equal_the_in_process_engine(shared_ray, in_process, greedy_reference, layout, mixed,
                                                             monkeypatch):
    """Launch-ahead (cluster/rank_worker.py) forced on CPU ranks, under what the GPU tests do not reach: preemption
    and recompute, chunked prompts, stop strings and EOS ending sequences while the step after is launched,
    sampled and penalised sequences among greedy ones, logprobs; with TANDEM_LAUNCH_MIXED=1 plain greedy steps with
    prefill chunks launched too. Tokens, text and finish equal the in-process engine's."""
    import ray

    from workers.launched_step import LAUNCH_AHEAD_ENV, LAUNCH_MIXED_ENV

    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1")  # forwarded to the rank actors (cluster/ray_runtime.py)
    monkeypatch.setenv(LAUNCH_MIXED_ENV, mixed)
    params, expected = in_process
    llm = LLM(**ENGINE, **layout)
    try:
        _assert_same(llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False),
                     greedy_reference)
        _run_ahead_twice(llm, params, expected)
        counts = ray.get([w.launch_counts.remote() for w in llm.llm_engine.executor.workers])
        assert all(c.get("continued", 0) > 0 for c in counts), counts
        assert all((c["mixed"] > 0) == (mixed == "1") for c in counts), counts
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("mixed", ["0", "1"], ids=["decode-steps", "mixed-steps-too"])
def test_in_process_launch_ahead_equals_the_in_process_engine(in_process, mixed, monkeypatch):
    """The in-process executor schedules ahead where it launches steps (on a GPU; forced here on CPU): plain greedy
    decode steps are launched, and the step planned meanwhile is launched behind one with its tokens from the device;
    any other step sent ahead (sampled, penalised, a prefill) waits for its fill, and then, with TANDEM_LAUNCH_MIXED=1,
    a plain greedy one with prefill chunks is launched too. Under preemption, chunked prompts, stop strings and EOS
    ending sequences while the next step is out, the outputs equal the one-step-at-a-time engine's, and the engine
    comes to rest clean."""
    from workers.launched_step import LAUNCH_MIXED_ENV

    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1")
    monkeypatch.setenv(LAUNCH_MIXED_ENV, mixed)
    params, expected = in_process
    llm = LLM(**ENGINE, distributed_executor_backend="uni")
    try:
        executor = llm.llm_engine.executor
        fills = []
        fill = executor.fill
        executor.fill = lambda tokens: fills.append(len(tokens)) or fill(tokens)
        # All greedy, 24 tokens each: this round preempts (and recomputes) under steps launched ahead
        greedy = SamplingParams(max_tokens=24, temperature=0.0)
        with monkeypatch.context() as mp:
            mp.setenv(LAUNCH_AHEAD_ENV, "0")
            one_at_a_time = LLM(**ENGINE, distributed_executor_backend="uni")
        try:
            reference = one_at_a_time.generate(PROMPTS, greedy, use_tqdm=False)
        finally:
            one_at_a_time.llm_engine.shutdown()
        _assert_same(llm.generate(PROMPTS, greedy, use_tqdm=False), reference)
        assert llm.llm_engine.scheduler.num_preemptions > 0 and executor.launches["continued"] > 10
        assert (executor.launches["mixed"] > 5) == (mixed == "1"), executor.launches
        assert_engine_clean(llm)
        _run_ahead_twice(llm, params, expected, preempts=False)  # sampled, penalised, stop strings, logprobs
        assert executor.launches["continued"] > 10, executor.launches  # steps launched behind the one before
        assert executor.launches["launched"] > executor.launches["continued"]
        assert fills, "no step sent ahead waited for its fill"
    finally:
        llm.llm_engine.shutdown()


def test_in_process_executor_refuses_what_it_cannot_run(monkeypatch):
    """Off (TANDEM_RANK_LAUNCH_AHEAD=0, and on CPU by default) the in-process engine sends no step ahead; the executor
    names a misuse instead of hanging or running a step with placeholder tokens."""
    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "0")
    llm = LLM(model=MODEL, dtype="float32", device="cpu")
    try:
        engine = llm.llm_engine
        assert not engine.async_scheduling
        out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
        assert all(len(o.token_ids) == 5 or o.finish_reason == "stop" for o in out)
        with pytest.raises(ExecutorError, match="no step ahead"):
            engine.executor.submit(None, ahead=True)
        with pytest.raises(ExecutorError, match="one step at a time"):
            engine.executor.submit(None, overlap=True)
        with pytest.raises(ExecutorError, match="no step sent ahead"):
            engine.executor.fill([1])
    finally:
        llm.llm_engine.shutdown()
    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1")
    llm = LLM(model=MODEL, dtype="float32", device="cpu")
    try:
        engine = llm.llm_engine
        assert engine.async_scheduling
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.8, seed=1))
        sched_out = engine.scheduler.schedule()
        pending = engine.executor.submit(sched_out, ahead=True)  # as if a step were out: it waits for its fill
        with pytest.raises(ExecutorError, match="never filled"):
            engine.executor.submit(sched_out)
        with pytest.raises(ExecutorError, match="before its placeholders were filled"):
            pending.result()
    finally:
        llm.llm_engine.shutdown()


def test_a_manual_step_loop_ends_with_the_engine_at_rest(monkeypatch):
    """A caller that steps until `has_unfinished_requests()` is False (vLLM's engine loop) while steps are launched
    ahead, the requests ended by stop strings (which no plan foresees, so a step for them is out when they end): the
    step that finishes the last request also collects the steps still out, so no step stays out and no block stays
    parked; the outputs equal a one-step-at-a-time engine's."""
    got = {}
    for ahead in ("0", "1"):
        monkeypatch.setenv(LAUNCH_AHEAD_ENV, ahead)
        llm = LLM(model=MODEL, dtype="float32", device="cpu")
        engine = llm.llm_engine
        try:
            if ahead == "0":  # stop strings from the middle of each greedy continuation
                texts = [o.text for o in llm.generate(PROMPTS[:3], SamplingParams(max_tokens=16, temperature=0.0,
                                                                                   ignore_eos=True), use_tqdm=False)]
                params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[t[len(t) // 2:][:3]])
                          for t in texts]
            for i, prompt in enumerate(PROMPTS[:3]):
                engine.add_request(f"r{i}", prompt, params[i])
            outs = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    outs[out.request_id] = (out.token_ids, out.text, out.finish_reason)
            assert engine._inflight is None and engine._next is None
            assert_engine_clean(llm)
            assert engine.scheduler.num_parked_blocks == 0
            got[ahead] = outs
            if ahead == "1":
                assert engine.executor.launches["continued"] > 0
        finally:
            engine.shutdown()
    assert all(reason == "stop" for _, _, reason in got["0"].values())
    assert got["1"] == got["0"]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["launched", "filled"])
def test_in_process_drain_after_an_abort_with_two_steps_out(monkeypatch, temperature):
    """In-process, two steps can be out at once (the one sent ahead and `LLMEngine._next`): greedy ones launched
    behind each other, sampled ones waiting for their fill. An abort of the last request leaves both to `drain`,
    which must collect them (filling the second where it waits) and free every block; the engine then serves again."""
    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1")
    llm = LLM(model=MODEL, dtype="float32", device="cpu")
    # greedy: launched with the device's tokens; sampled: waiting for its fill
    _abort_and_drain_with_two_steps_out(llm, temperature, needs_fill=temperature > 0)


def _abort_and_drain_with_two_steps_out(llm: LLM, temperature: float, needs_fill: bool) -> None:
    """Step one request until a second step is out behind the one sent ahead (`LLMEngine._next`), check whether that
    one waits for its fill, abort the request, drain: nothing out, every block free, and the engine serves again."""
    engine = llm.llm_engine
    try:
        engine.add_request("last", PROMPTS[2], SamplingParams(max_tokens=40, temperature=temperature, seed=3,
                                                              ignore_eos=True))
        for _ in range(8):
            engine.step()
            if engine._next is not None:
                break
        assert engine._next is not None, "no second step out"
        assert engine.executor.needs_fill == needs_fill
        engine.abort("last")
        engine.drain()
        assert engine._inflight is None and engine._next is None
        assert_engine_clean(llm)
        assert engine.scheduler.num_parked_blocks == 0
        outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
        assert all(len(o.token_ids) == 6 or o.finish_reason == "stop" for o in outs)
        assert_engine_clean(llm)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_async_scheduling_off_sends_no_step_ahead(shared_ray):
    llm = LLM(model=MODEL, dtype="float32", device="cpu", distributed_executor_backend="ray", async_scheduling=False)
    try:
        sent = []
        submit = llm.llm_engine.executor.submit
        llm.llm_engine.executor.submit = lambda out, ahead=False: sent.append(ahead) or submit(out, ahead=ahead)
        llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        assert sent and not any(sent)
    finally:
        llm.llm_engine.shutdown()


def _scheduler(num_blocks: int, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), BlockManager(num_blocks, 4, True))


def _running(sched: Scheduler, seq_id: str, prompt: list[int]) -> Sequence:
    seq = Sequence(seq_id, list(prompt), SamplingParams(max_tokens=50))
    sched.add(seq)
    return seq


def _collect(sched: Scheduler, out, tokens: dict[str, int]) -> None:
    sched.step_done()
    sched.update(out, ModelRunnerOutput({k: SampledToken(v, 0.0) for k, v in tokens.items()}))


def test_a_step_planned_ahead_carries_placeholders_past_the_step_out():
    sched = _scheduler(num_blocks=16)
    a = _running(sched, "a", [1, 2, 3, 4, 5, 6])  # 6 tokens: its block of 4 fills, a second starts
    first = sched.schedule()
    sched.step_sent()
    ahead = sched.schedule(ahead_of=first)  # a's prefill is out: plan its first decode
    (s,) = ahead.seqs
    assert s.token_ids == [PLACEHOLDER_TOKEN] and s.start_pos == 6 and s.sample and s.num_output_tokens == 1
    assert len(s.block_table) == 2 and a.num_computed_tokens == 0  # nothing moves before the step answers
    sched.step_sent()
    _collect(sched, first, {"a": 42})
    assert a.token_ids[-1] == 42 and a.num_computed_tokens == 6
    fill_placeholders(ahead.seqs, [42])
    assert s.token_ids == [42]
    ahead2 = sched.schedule(ahead_of=ahead)
    assert ahead2.seqs[0].start_pos == 7 and ahead2.seqs[0].token_ids == [PLACEHOLDER_TOKEN]


def test_a_finished_sequences_blocks_are_parked_until_the_step_out_answers():
    sched = _scheduler(num_blocks=16)
    a = _running(sched, "a", [1, 2, 3, 4, 5])
    out = sched.schedule()
    sched.step_sent()
    table = list(a.block_table)
    free = sched.blocks.num_free_blocks
    sched.finish(a, "abort")
    assert sched.blocks.num_free_blocks == free and sched.num_parked_blocks == len(table)
    assert sched.has_work  # the step out must still be collected
    sched.step_done()
    assert sched.num_parked_blocks == 0 and sched.blocks.num_free_blocks == free + len(table)
    assert not sched.has_work
    sched.update(out, ModelRunnerOutput({"a": SampledToken(7, 0.0)}))  # a finished: its token is dropped
    assert a.token_ids == [1, 2, 3, 4, 5]


def test_planning_ahead_never_preempts_and_skips_sequences_that_surely_end():
    sched = _scheduler(num_blocks=4)
    a = _running(sched, "a", [1, 2, 3, 4, 5, 6, 7])  # 2 blocks
    b = _running(sched, "b", [9, 8, 7, 6, 5, 4, 3, 2])  # 2 blocks, the last one full after its prefill
    out = sched.schedule()
    assert len(out.seqs) == 2 and sched.blocks.num_free_blocks == 0
    sched.step_sent()
    # b's first decode needs a third block, and none is free: the plan gives up rather than preempt a
    assert sched.schedule(ahead_of=out) is None
    assert a in sched.running and b in sched.running and sched.num_preemptions == 0
    # a sequence whose sampled token surely ends it is left out of the plan
    ahead = sched.schedule(ahead_of=out, will_finish=lambda seq: seq is b)
    assert [s.seq_id for s in ahead.seqs] == ["a"]


@pytest.mark.slow
def test_drain_fills_and_collects_the_step_sent_after_the_one_ahead(shared_ray):
    """Two steps can be out at once: the one sent ahead, and the one the engine sent after it before its text work
    (`LLMEngine._next`). A pipeline's later stage never holds the tokens, so the second waits for a fill. An abort of
    the last request leaves both to `drain`, which must fill the second from the first's answer, collect both and
    free every block; the engine then serves again."""
    llm = LLM(model=MODEL, dtype="float32", device="cpu", pipeline_parallel_size=2, pipeline_step_overlap=False)
    assert llm.llm_engine.step_groups == 1 and llm.llm_engine.async_scheduling
    _abort_and_drain_with_two_steps_out(llm, 0.8, needs_fill=True)
