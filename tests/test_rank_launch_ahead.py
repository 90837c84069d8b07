"""Launch-ahead on the ranks (cluster/rank_worker.py, workers/launched_step.py): a plain greedy decode step is
answered once its tokens are in, and the step sent ahead of it is taken in meanwhile and, where it continues the
same decodes, launched behind it with its tokens from the device. The step channel's `Later` carries that; the
rank loop's answers must keep their order whatever comes in between. On CPU ranks it is off unless forced
(TANDEM_RANK_LAUNCH_AHEAD=1), which these tests do: the tokens must be the in-process engine's."""
from __future__ import annotations

import threading

import pytest
import torch

from cluster.step_channel import NO_REPLY, Later, RankFailure, StepChannel, run_rank_loop
from workers.launched_step import LAUNCH_AHEAD_ENV, launch_ahead_enabled


def _channel(handler):
    channel = StepChannel("127.0.0.1", 1)
    run_rank_loop(channel.address, 0, handler)
    channel.accept(timeout_s=10)
    return channel


def test_a_later_answers_in_order_and_hands_on_what_came_meanwhile():
    """Step 1 is launched: its answer waits on an event. Step 2 comes meanwhile and is taken in by the peek; the
    answer of step 1 goes first, then step 2's own (run by `then`). A step after `done` is not waited for."""
    finished = threading.Event()
    seen: list = []

    def handle(message):
        seen.append(message)
        if message[1] == 1:
            def run(peek):
                got = peek(finished.is_set)
                assert got == ("step", 2)
                return "answer-1", lambda: ("answer", got[1])
            return Later(run)
        if message[1] == 3:
            return Later(lambda peek: (("nothing came", peek(lambda: True)), None))
        return ("answer", message[1])

    channel = _channel(handle)
    try:
        channel.broadcast(("step", 1))
        channel.broadcast(("step", 2))
        assert channel.gather(5) == {0: "answer-1"}
        assert channel.gather(5) == {0: ("answer", 2)}
        finished.set()
        channel.broadcast(("step", 3))
        assert channel.gather(5) == {0: ("nothing came", None)}
        assert [m[1] for m in seen] == [1, 3]  # step 2 went to the Later, not to the handler
    finally:
        channel.close()


def test_a_later_that_raises_is_reported_and_the_loop_goes_on():
    def handle(message):
        if message[1] == "bad":
            def run(peek):
                raise ValueError("launch failed")
            return Later(run)
        if message[1] == "quiet":
            return NO_REPLY
        return message[1]

    channel = _channel(handle)
    try:
        channel.broadcast(("step", "bad"))
        with pytest.raises(RankFailure, match="launch failed"):
            channel.gather(5)
        channel.broadcast(("step", "quiet"))
        channel.broadcast(("step", "fine"))
        assert channel.gather(5) == {0: "fine"}
    finally:
        channel.close()


def test_the_switch_reads_auto_0_1_and_refuses_the_rest():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not launch_ahead_enabled(cpu, {}) and launch_ahead_enabled(cuda, {})
    assert launch_ahead_enabled(cpu, {LAUNCH_AHEAD_ENV: "1"}) and not launch_ahead_enabled(cuda, {LAUNCH_AHEAD_ENV: "0"})
    with pytest.raises(ValueError, match=LAUNCH_AHEAD_ENV):
        launch_ahead_enabled(cpu, {LAUNCH_AHEAD_ENV: "yes"})


def test_the_mixed_steps_switch_is_on_by_default_and_refuses_the_rest():
    from workers.launched_step import LAUNCH_MIXED_ENV, launch_mixed_enabled

    assert launch_mixed_enabled({}) and not launch_mixed_enabled({LAUNCH_MIXED_ENV: "0"})
    assert launch_mixed_enabled({LAUNCH_MIXED_ENV: " 1"})
    with pytest.raises(ValueError, match=LAUNCH_MIXED_ENV):
        launch_mixed_enabled({LAUNCH_MIXED_ENV: "on"})


PROMPTS = [[5 + i, 17, 33 + 2 * i, 9, 11] * (i + 1) for i in range(6)]


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of the in-process engine, with lengths that end the sequences at different steps (so a step
    continues only some of the one before: by row)."""
    from tandem import LLM, SamplingParams

    llm = LLM(model="models/tandem-tiny")
    params = [SamplingParams(max_tokens=12 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    tokens = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    llm.llm_engine.shutdown()
    return params, tokens


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"distributed_executor_backend": "ray"}],
                         ids=["tp2", "ray-tp1"])
def test_launched_ranks_give_the_in_process_tokens(reference, layout, monkeypatch):
    import ray

    from tandem import LLM, SamplingParams

    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1")  # forwarded to the rank actors (cluster/ray_runtime.py)
    params, tokens = reference
    llm = LLM(model="models/tandem-tiny", **layout)
    try:
        got = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        assert got == tokens
        counts = ray.get([w.launch_counts.remote() for w in llm.llm_engine.executor.workers])
        assert all(c["continued"] > 0 and c["launched"] > c["continued"] for c in counts), counts
        # A sampled request among greedy ones: steps with it are run whole, and the tokens stay the engine's.
        mixed = [SamplingParams(max_tokens=10, temperature=0.8, seed=7)] + list(params[1:3])
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], mixed)
        assert [o.token_ids for o in out[1:]] == [t[:len(o.token_ids)] for t, o in zip(tokens[1:3], out[1:])]
        assert len(out[0].token_ids) == 10
        # Profiled: each launched step is a row of its rank's profile (`RankProfile.record`), beside its collector pauses.
        executor = llm.llm_engine.executor
        before = ray.get([w.launch_counts.remote() for w in executor.workers])
        executor.profile("start", 0)
        assert [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params[:3])] == tokens[:3]
        ranks = executor.profile("report")
        after = ray.get([w.launch_counts.remote() for w in executor.workers])
        for report, b, a in zip(ranks, before, after):
            assert a["launched"] > b["launched"] and report["decode"]["steps"] >= a["launched"] - b["launched"]
            assert report["gc"]["collections"] >= 0
    finally:
        llm.llm_engine.shutdown()
