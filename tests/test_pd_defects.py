"""Issue 24, defect 4b: after an abort, the pools' KV and queue gauges must be true at rest.

A prefill replica (TP=1) and a decode replica (TP=1), each with its rank as a Ray actor, fed by the
gauges the Serve pools attach (`router.metrics.PoolGauges` as `AsyncEngine.on_step`). A request is
cancelled in each phase of the handoff (queued for prefill, prefilling, in KV transfer, decoding);
once nothing runs any more, both engines must hold no block, and the last value each pool's gauges
were set to must say so: releases, reservation cancels and aborts happen outside engine steps, and no
further step may come to correct a stale gauge.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Coroutine, TypeVar

import pytest

from engine.disagg import DecodeReplica, PrefillReady, PrefillReplica, Reservation
from engine.llm_engine import LLMEngine
from router import metrics
from tests.models import prompts_of_lengths, tiny_model
from tests.test_disagg import (BLOCK, PREFILL_CHUNK, TRANSFER_TIMEOUT_S, VOCAB, WAIT_S, Hook, Pair, StepGate,
                               expect_cancelled, greedy, poll, prefilling, settle)
from workers.config import EngineConfig
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
T = TypeVar("T")
GAUGE_WAIT_S = 3.0  # a gauge must follow a free at once; this only absorbs the event loop's scheduling


class GaugeRecorder:
    """Stands in for a `ray.util.metrics.Gauge`: keeps the last value set per pool (Ray's export of a
    gauge is its last value, so this is what Prometheus would show)."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.last[tags["pool"]] = value


@pytest.fixture(scope="module")
def ray_session(shared_ray):
    return shared_ray  # the session's local Ray (tests/conftest.py)


@pytest.fixture(scope="module")
def run():
    loop = asyncio.new_event_loop()

    def run(coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return loop.run_until_complete(asyncio.wait_for(coro, timeout))

    yield run
    loop.close()


@pytest.fixture(scope="module")
def pair(ray_session, run) -> Pair:
    path = tiny_model("llama")
    common = dict(model=path, block_size=BLOCK, num_gpu_blocks_override=64, distributed_executor_backend="ray",
                  kv_transfer_timeout_seconds=TRANSFER_TIMEOUT_S)
    prefill = PrefillReplica(LLMEngine(EngineConfig.from_kwargs(**common, max_num_batched_tokens=PREFILL_CHUNK),
                                       show_progress=False))
    calls: list[str] = []

    async def client(rid: str, prompt: list[int], params: SamplingParams, prio: int,
                     res: Reservation) -> AsyncIterator[PrefillReady]:
        calls.append(rid)
        async for ready in prefill.prefill(rid, prompt, params, prio, res):
            yield ready

    decode = DecodeReplica(LLMEngine(EngineConfig.from_kwargs(**common), show_progress=False), client)
    built = Pair(path, prefill, decode, calls)
    yield built
    built.shutdown()


@pytest.fixture
def gauges(pair, monkeypatch) -> dict[str, GaugeRecorder]:
    """Both pools' gauges, attached as router/pools.py attaches them."""
    recorders = {"kv": GaugeRecorder(), "queue": GaugeRecorder()}
    monkeypatch.setattr(metrics, "KV_BLOCKS_USED", recorders["kv"])
    monkeypatch.setattr(metrics, "WAITING", recorders["queue"])
    pair.prefill.async_engine.on_step = metrics.PoolGauges("prefill")
    pair.decode.async_engine.on_step = metrics.PoolGauges("decode")
    yield recorders
    pair.prefill.async_engine.on_step = pair.decode.async_engine.on_step = None


async def assert_gauges_at_rest(pair: Pair, gauges: dict[str, GaugeRecorder]) -> None:
    """No block leaked on either side, and both pools' last-set gauges show it with no traffic."""
    await settle(pair)
    want = {"prefill": 0, "decode": 0}
    await poll(lambda: gauges["kv"].last == want and gauges["queue"].last == want,
               f"gauges at rest (kv {gauges['kv'].last}, queue {gauges['queue'].last})", timeout=GAUGE_WAIT_S)


async def _abort_queued(pair: Pair) -> None:
    """Reserved on the decode side, waiting in the prefill queue behind a long prompt: cancelled."""
    long, short = prompts_of_lengths([40, 6], VOCAB, seed=21)
    with StepGate(pair.prefill, prefilling("g-q-long")) as gate:
        long_task = asyncio.create_task(_generate(pair.decode, "g-q-long", long, greedy(4)))
        await gate.wait()
        short_task = asyncio.create_task(_generate(pair.decode, "g-q-short", short, greedy(4)))
        await poll(lambda: any(s.seq_id == "g-q-short" for s in pair.P.scheduler.waiting), "g-q-short queued")
        await expect_cancelled(short_task)
    await long_task


async def _abort_prefilling(pair: Pair) -> None:
    (long,) = prompts_of_lengths([40], VOCAB, seed=22)
    with StepGate(pair.prefill, prefilling("g-p")) as gate:
        task = asyncio.create_task(_generate(pair.decode, "g-p", long, greedy()))
        await gate.wait()
        await expect_cancelled(task)


async def _abort_transferring(pair: Pair) -> None:
    (prompt,) = prompts_of_lengths([14], VOCAB, seed=23)
    pair.prefill.executor.kv_call("set_send_delay", 1.0)  # well inside the transfer timeout
    try:
        with Hook(pair.decode, "_transfer_blocking") as transfer:
            task = asyncio.create_task(_generate(pair.decode, "g-t", prompt, greedy()))
            await transfer.wait_entered()
            await expect_cancelled(task)
    finally:
        pair.prefill.executor.kv_call("set_send_delay", 0.0)


async def _abort_decoding(pair: Pair) -> None:
    (prompt,) = prompts_of_lengths([7], VOCAB, seed=24)
    decoding = asyncio.Event()

    async def consume() -> None:
        async for out in pair.decode.generate("g-d", prompt, greedy(150)):
            if len(out.token_ids) >= 2:  # decoding (the first token comes from the prefill side)
                decoding.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(decoding.wait(), WAIT_S)
    await expect_cancelled(task)


async def _generate(decode: DecodeReplica, rid: str, prompt: list[int], params: SamplingParams) -> None:
    async for _ in decode.generate(rid, prompt, params):
        pass


PHASES = {"queued": _abort_queued, "prefilling": _abort_prefilling, "transferring": _abort_transferring,
          "decoding": _abort_decoding}


@pytest.mark.parametrize("phase", list(PHASES))
def test_gauges_true_at_rest_after_abort(pair, gauges, run, phase):
    async def body() -> None:
        await PHASES[phase](pair)
        await assert_gauges_at_rest(pair, gauges)

    run(body())


def test_gauges_true_at_rest_after_a_finished_request(pair, gauges, run):
    """The prefill side frees a handed-off prompt's blocks after the decode side collected them, outside
    any step: its gauge must drop back too (this was stale after every request, not only aborts)."""
    (prompt,) = prompts_of_lengths([10], VOCAB, seed=25)
    run(_generate(pair.decode, "g-ok", prompt, greedy(3)))
    run(assert_gauges_at_rest(pair, gauges))
