"""The Ray executor's overlap: the engine sends the next step before it detokenizes the last one.

A stop string is only found during that text work, so a sequence it ends is already in the step the
ranks are running. The outputs must still equal the in-process engine's exactly (tokens, text, finish
and stop reasons), and the finished sequence's blocks must all come back."""
from __future__ import annotations

import pytest

from engine.llm import LLM
from tests.models import assert_engine_clean
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "models/tandem-tiny"
PROMPTS = ["import os\n", "def add(a, b):\n", "class Stack:\n", "for i in range(10):\n", "# parse the file\n",
           "x = [", "while True:\n", "print("]


@pytest.fixture(scope="module")
def ray_session(shared_ray):
    return shared_ray  # the session's local Ray (tests/conftest.py)


@pytest.fixture(scope="module", params=["auto", "1"], ids=["ranks-wait", "ranks-launch-ahead"])
def ray_llm(ray_session, request):
    """The Ray-executor LLM both tests drive (its rank actor starts once per parameter), with the rank's
    launch-ahead off (auto: off on CPU) and forced on (cluster/rank_worker.py: a decode step launched behind the
    one before, its placeholders filled on the rank). Each test starts from a clean engine, asserts it, and
    leaves it clean."""
    from workers.launched_step import LAUNCH_AHEAD_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LAUNCH_AHEAD_ENV, request.param)  # read by the rank actor at its start (cluster/ray_runtime.py)
        llm = LLM(model=MODEL, dtype="float32", device="cpu", distributed_executor_backend="ray")
    yield llm
    llm.llm_engine.shutdown()


def _params(reference: list[str]) -> list[SamplingParams]:
    """Greedy requests whose stop strings are cut from the middle of their own reference text (so they
    hit mid-stream), one with the stop string kept, one sampled with penalties, one ended by length."""
    params = []
    for i, text in enumerate(reference):
        stop = text[len(text) // 2: len(text) // 2 + 3] if len(text) > 8 else None
        params.append(SamplingParams(max_tokens=24, temperature=0.0, stop=[stop] if stop else [],
                                     include_stop_str_in_output=(i % 3 == 1)))
    params[-1] = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.2, stop=["\n\n"])
    params[-2] = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    return params


def _view(outs) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs]


def test_ray_overlap_matches_in_process(ray_llm, monkeypatch, request):
    uni = LLM(model=MODEL, dtype="float32", device="cpu", distributed_executor_backend="uni")
    reference = [o.text for o in uni.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)]
    params = _params(reference)
    expected = uni.generate(PROMPTS, params, use_tqdm=False)
    assert sum(isinstance(o.stop_reason, str) for o in expected) >= 3, "the test needs requests ended by stop strings"
    uni.llm_engine.shutdown()

    llm = ray_llm
    engine = llm.llm_engine
    assert_engine_clean(llm)
    assert engine.executor.overlaps_host_work
    dropped = []  # sequences a step ran after a stop string had ended them
    update = engine.scheduler.update

    def counting_update(out, result):
        dropped.extend(s.seq_id for s in out.seqs if s.seq_id not in engine.scheduler.seqs)
        return update(out, result)

    monkeypatch.setattr(engine.scheduler, "update", counting_update)
    for _ in range(2):  # the second round starts with the first's last step still uncollected
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert _view(got) == _view(expected)
        assert_engine_clean(llm)  # generate collected the step left in flight for stop-string finishes
    assert dropped, "no stop string ended a sequence while its next step was in flight"
    import ray

    (counts,) = ray.get([w.launch_counts.remote() for w in engine.executor.workers])
    launching = request.node.callspec.params["ray_llm"] == "1"
    assert (counts.get("continued", 0) > 0) == launching, counts


def test_an_abort_mid_flight_frees_once_that_step_has_answered(ray_llm):
    """An abort while steps run on the ranks must not free blocks that those steps still write: the
    scheduler parks them (nothing can allocate them) until the steps out have answered, without waiting."""
    llm = ray_llm
    engine = llm.llm_engine
    assert_engine_clean(llm)
    assert engine._inflight is None  # no step of an earlier test still out
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"mid-{i}", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill collected; the first decode step is in flight
    engine.step()
    assert engine._inflight is not None
    victim = engine.scheduler.seqs["mid-1"]
    held = list(victim.block_table)
    used = engine.block_manager.num_used_blocks
    assert engine.abort("mid-1").finish_reason == "abort"
    assert engine.block_manager.num_used_blocks == used, "the abort freed blocks a step out may still write"
    assert engine.scheduler.num_parked_blocks == len(held)
    # Two steps are out with asynchronous scheduling: the one sent ahead, and the one after it (`_next`), both
    # planned before the abort. The blocks stay parked until the last of them has answered, and no longer.
    sched = engine.scheduler
    last_out = sched.steps_sent
    assert last_out - sched.steps_done == 2 and engine._next is not None
    outs = engine.step()  # collects the first; mid-1 gets no more tokens
    assert "mid-1" not in sched.seqs and all(o.request_id != "mid-1" for o in outs)
    assert sched.steps_done < last_out and sched.num_parked_blocks == len(held)
    outs = engine.step()  # collects the second
    assert all(o.request_id != "mid-1" for o in outs)
    assert sched.steps_done >= last_out and sched.num_parked_blocks == 0
    assert all(engine.block_manager.blocks[b].ref_count == 0 for b in held)
    while engine.has_unfinished_requests():
        engine.step()
    engine.drain()
    assert_engine_clean(llm)
