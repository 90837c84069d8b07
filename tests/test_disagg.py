"""Disaggregated serving end to end: a prefill replica and a decode replica, each with its ranks as Ray
actors, hand a prompt's KV over through their pair group (gloo on CPU), resharding between layouts.

Two pairs, one alive at a time (a pair takes 3 of the module's 4 Ray CPUs):
- "tp2->tp1": a GQA Llama (2 KV heads) prefilled on 2 ranks (one head each) and decoded on 1 rank
  (both heads): correctness, bytes moved, prefix hits, concurrency, aborts in every state, a stalled
  transfer, a killed prefill rank.
- "tp1->tp2": a Qwen3 with one KV head, prefilled on 1 rank and decoded on 2 ranks that both hold that
  head (KV heads < TP): correctness and bytes, the prefill side's lease, a killed decode rank.
Prefill engines take 16 tokens a step, so a 40-token prompt is prefilled over 3 steps; `StepGate`
freezes an engine between two of them to act on a request mid-prefill, deterministically.

After every test both engines hold no block, no lease and no request, and their block manager's
invariants hold (frees that land asynchronously get a short poll).
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable, Coroutine, TypeVar

import pytest
import ray
from transformers import AutoConfig

from tests.models import assert_engine_clean, hf_greedy, prompts_of_lengths, tiny_model
from engine.async_engine import AsyncEngine, EngineDeadError
from workers.config import EngineConfig
from engine.disagg import (RESERVED, DecodeReplica, LocalPrefillPolicy, PrefillAbandoned, PrefillReady, PrefillReplica,
                           PrefillUnavailable, Reservation, abandon_prefill, streamable)
from engine.scheduler import QueueFullError
from engine.llm_engine import LLMEngine, RequestOutput
from workers.executor import ExecutorError
from workers.kv_transfer.plan import RankShard
from workers.kv_transfer.transport import KVTransferError
from engine.llm import LLM
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
T = TypeVar("T")

BLOCK = 4
VOCAB = 290  # prompt ids stay below both tiny vocabularies
PREFILL_CHUNK = 16  # max_num_batched_tokens of the prefill engines
TRANSFER_TIMEOUT_S = 15.0  # kv_transfer_timeout_seconds of every engine here (default 60); loose enough for a loaded CI box
LEASE_S = 4.0  # kv_lease_seconds of the "tp1->tp2" prefill engine (default 60)
TEST_TIMEOUT_S = 180.0
WAIT_S = 60.0  # the longest any single condition is waited for
COMMON = dict(block_size=BLOCK, num_gpu_blocks_override=128, distributed_executor_backend="ray",
              kv_transfer_timeout_seconds=TRANSFER_TIMEOUT_S)
PAIRS = {
    "tp2->tp1": dict(model=("llama", {}),
                     prefill=dict(tensor_parallel_size=2, max_num_batched_tokens=PREFILL_CHUNK),
                     decode=dict(tensor_parallel_size=1)),
    "pp2->tp1": dict(model=("llama", {}),
                     prefill=dict(pipeline_parallel_size=2, max_num_batched_tokens=PREFILL_CHUNK),
                     decode=dict(tensor_parallel_size=1)),
    "tp1->tp2": dict(model=("qwen3", dict(num_key_value_heads=1)),
                     prefill=dict(tensor_parallel_size=1, max_num_batched_tokens=PREFILL_CHUNK, kv_lease_seconds=LEASE_S),
                     decode=dict(tensor_parallel_size=2)),
}


def greedy(max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---------------------------------------------------------------- replicas


@dataclass
class Pair:
    path: str
    prefill: PrefillReplica
    decode: DecodeReplica
    prefill_calls: list[str]  # request ids the decode side asked the prefill side for, in order

    @property
    def P(self) -> LLMEngine:
        return self.prefill.llm_engine

    @property
    def D(self) -> LLMEngine:
        return self.decode.llm_engine

    def shutdown(self) -> None:
        for engine in (self.P, self.D):
            engine.shutdown()


def build_pair(path: str, prefill_kw: dict, decode_kw: dict, replica_kw: dict | None = None) -> Pair:
    """A prefill and a decode replica of `path` (COMMON engine arguments plus each side's own), the decode
    side's prefill client calling the prefill replica directly and recording the request ids it asks for.
    `replica_kw`: the `DecodeReplica`'s own arguments (`kv_pieces`, `kv_transfers_in_flight`)."""

    def engine(kw: dict) -> LLMEngine:
        return LLMEngine(EngineConfig.from_kwargs(model=path, **COMMON, **kw), show_progress=False)

    prefill = PrefillReplica(engine(prefill_kw))
    calls: list[str] = []

    async def client(rid: str, prompt: list[int], params: SamplingParams, prio: int, res: Reservation) -> AsyncIterator[PrefillReady]:
        calls.append(rid)
        async for ready in prefill.prefill(rid, prompt, params, prio, res):
            yield ready

    try:
        decode = DecodeReplica(engine(decode_kw), client, **(replica_kw or {}))
    except BaseException:
        prefill.llm_engine.shutdown()
        raise
    return Pair(path, prefill, decode, calls)


def _build_pair(name: str) -> Pair:
    spec = PAIRS[name]
    arch, overrides = spec["model"]
    return build_pair(tiny_model(arch, **overrides), spec["prefill"], spec["decode"])


class Pools:
    """The pair a test asks for; building one shuts the other down (the module's Ray has 4 CPUs)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.pair: Pair | None = None

    def get(self, name: str) -> Pair:
        if self.name != name:
            self.close()
            self.pair, self.name = _build_pair(name), name
        return self.pair

    def close(self) -> None:
        if self.pair is not None:
            self.pair.shutdown()
        self.pair = self.name = None


@pytest.fixture(scope="module")
def ray_session(shared_ray):
    return shared_ray  # the session's local Ray (tests/conftest.py)


@pytest.fixture(scope="module")
def run():
    """Runs a test's coroutine on the module's one event loop (the replicas' step loops live on it)."""
    loop = asyncio.new_event_loop()

    def run(coro: Coroutine[Any, Any, T], timeout: float = TEST_TIMEOUT_S) -> T:
        return loop.run_until_complete(asyncio.wait_for(coro, timeout))

    yield run
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:  # gather() of nothing would make its future on another loop
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.close()


@pytest.fixture(scope="module")
def pools(ray_session, run):
    pools = Pools()
    yield pools
    pools.close()


@pytest.fixture(scope="module")
def reference():
    """Outputs of the single-process `LLM` on the same model (one engine per model, kept for the module)."""
    llms: dict[str, LLM] = {}

    def reference(path: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        if path not in llms:
            llms[path] = LLM(path, block_size=BLOCK, show_progress=False)
        return llms[path].generate(prompts, params)

    yield reference
    for llm in llms.values():
        llm.shutdown()


# ---------------------------------------------------------------- helpers


async def generate(decode: DecodeReplica, rid: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
    last = None
    async for out in decode.generate(rid, prompt, params):
        last = out
    assert last is not None and last.finished
    return last


async def poll(ok: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        await asyncio.sleep(0.02)


async def on_engine(replica: PrefillReplica | DecodeReplica, fn: Callable[[LLMEngine], T]) -> T:
    """fn(engine), in turn with the engine's own calls; directly once the engine has died."""
    aengine: AsyncEngine = replica.async_engine
    if aengine.alive:
        return await aengine.call(fn, aengine.llm_engine)
    return fn(aengine.llm_engine)


async def settle(pair: Pair, timeout: float = 10.0) -> None:
    """Both engines reach the clean state: no block used, nothing held or reserved, no request left."""
    for replica in (pair.prefill, pair.decode):
        await settle_replica(replica, timeout)


async def settle_replica(replica: PrefillReplica | DecodeReplica, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            await on_engine(replica, assert_engine_clean)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def expect_cancelled(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def prefilling(rid: str) -> Callable[[LLMEngine], bool]:
    """The request is part-way through its prompt on this engine."""
    def when(engine: LLMEngine) -> bool:
        seq = engine.scheduler.seqs.get(rid)
        return seq is not None and 0 < seq.num_computed_tokens < seq.num_prompt_tokens
    return when


class StepGate:
    """Freezes a replica's engine after the first step at which `when(engine)` holds, until the `with`
    block ends: its later steps run nothing, while engine calls (new requests, aborts) still go through."""

    def __init__(self, replica: PrefillReplica | DecodeReplica, when: Callable[[LLMEngine], bool]):
        self.engine: LLMEngine = replica.llm_engine
        self.when = when
        self.reached = threading.Event()
        self._resume = threading.Event()

    def __enter__(self) -> "StepGate":
        step = self.engine.step

        def gated_step() -> list[RequestOutput]:
            if self.reached.is_set() and not self._resume.is_set():
                self._resume.wait(0.01)  # frozen: an empty step, so that other engine calls get their turn
                return []
            outputs = step()
            if self.when(self.engine):
                self.reached.set()
            return outputs

        self.engine.step = gated_step
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.step
        self._resume.set()

    async def wait(self) -> None:
        assert await asyncio.to_thread(self.reached.wait, WAIT_S), "the engine never reached the awaited state"


class Hook:
    """Wraps obj.name (a method run in a worker thread): records when calls enter and leave it and, with
    block=True, holds them at the entrance until the `with` block ends."""

    def __init__(self, obj: object, name: str, block: bool = False):
        self.obj, self.name, self.block = obj, name, block
        self.entered, self.exited = threading.Event(), threading.Event()
        self._go = threading.Event()

    def __enter__(self) -> "Hook":
        fn = getattr(self.obj, self.name)

        def hooked(*args, **kwargs):
            self.entered.set()
            if self.block:
                self._go.wait(WAIT_S)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exited.set()

        setattr(self.obj, self.name, hooked)
        return self

    def __exit__(self, *exc) -> None:
        delattr(self.obj, self.name)
        self._go.set()

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, WAIT_S), f"{self.name} was never called"


def kv_bytes_per_block(path: str, shards: list[RankShard]) -> int:
    """KV bytes one block takes on a replica, summed over its ranks (float32 on CPU)."""
    cfg = AutoConfig.from_pretrained(path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return sum(2 * len(s.layers) * BLOCK * len(s.heads) * head_dim * 4 for s in shards)


def blocks_needed(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK)


def assert_same_output(got: RequestOutput, want: RequestOutput) -> None:
    assert got.token_ids == want.token_ids
    assert got.text == want.text and got.finish_reason == want.finish_reason
    if want.logprobs is not None:
        for got_lp, want_lp in zip(got.logprobs, want.logprobs, strict=True):
            assert list(got_lp) == list(want_lp)
            assert list(got_lp.values()) == pytest.approx(list(want_lp.values()), abs=1e-4)


# ---------------------------------------------------------------- prefill TP=2 -> decode TP=1


def test_tp2_to_tp1_matches_hf_and_single_process(pools, run, reference):
    pair = pools.get("tp2->tp1")
    assert [s.heads for s in pair.prefill.shards] == [range(0, 1), range(1, 2)]
    assert [s.heads for s in pair.decode.shards] == [range(0, 2)]
    prompts = prompts_of_lengths([1, 6, 13, 21], VOCAB, seed=1)
    params = greedy(8, logprobs=2)  # the first token's logprobs travel with it from the prefill side
    outs = [run(generate(pair.decode, f"a-{i}", p, params)) for i, p in enumerate(prompts)]
    for out, want, prompt in zip(outs, reference(pair.path, prompts, params), prompts, strict=True):
        assert out.token_ids == hf_greedy(pair.path, prompt, 8)[0]
        assert_same_output(out, want)
    run(settle(pair))


def test_bytes_moved_are_the_prompt_kv_minus_decode_prefix_hits(pools, run, monkeypatch):
    pair = pools.get("tp2->tp1")
    handoffs: list[str] = []  # the prefills' handoff ids, which the prefill ranks ack by
    original = pair.prefill.prefill

    async def recording(*args):
        async for ready in original(*args):
            if isinstance(ready, PrefillReady):  # not a piece (kv_pieces): only the answer has a handoff id
                handoffs.append(ready.handoff_id)
            yield ready

    monkeypatch.setattr(pair.prefill, "prefill", recording)
    per_block = kv_bytes_per_block(pair.path, pair.decode.shards)
    assert per_block == 2 * 2 * BLOCK * 2 * 16 * 4  # 2 layers x K,V x 4 tokens x 2 KV heads x head_dim 16 x fp32
    first, tail = prompts_of_lengths([18, 7], VOCAB, seed=2)
    second = first[:10] + tail  # shares two full blocks (and two more tokens) with `first`
    n = len(pair.decode.transfers)

    out1 = run(generate(pair.decode, "bytes-1", first, greedy()))
    moved = pair.decode.transfers[n]
    assert (moved.blocks, moved.bytes) == (blocks_needed(18), blocks_needed(18) * per_block)
    assert out1.num_cached_tokens == 0

    # The decode side caches the blocks it received: the second prompt only needs the ones after them.
    out2 = run(generate(pair.decode, "bytes-2", second, greedy()))
    hits = 2
    moved = pair.decode.transfers[n + 1]
    assert out2.num_cached_tokens == hits * BLOCK
    assert (moved.blocks, moved.bytes) == (blocks_needed(17) - hits, (blocks_needed(17) - hits) * per_block)
    assert len(pair.decode.transfers) == n + 2
    assert out1.token_ids == hf_greedy(pair.path, first, 6)[0]
    assert out2.token_ids == hf_greedy(pair.path, second, 6)[0]
    run(settle(pair))
    # Step 4 ran: the prefill replica collected every rank's "sent" ack before freeing (none is left over).
    assert len(handoffs) == 2 and pair.prefill.executor.kv_call("sent_among", handoffs, 0.0) == [[], []]


def test_concurrent_mixed_requests(pools, run, reference):
    pair = pools.get("tp2->tp1")
    prompts = prompts_of_lengths([1, 3, 4, 5, 9, 16, 23, 30], VOCAB, seed=3)
    params = [
        greedy(6),
        SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=11),
        greedy(1),  # finished by its first token, on the prefill side: nothing to transfer
        SamplingParams(temperature=0.7, top_k=5, max_tokens=7, ignore_eos=True, seed=3),
        greedy(5, logprobs=3),
        greedy(6, repetition_penalty=1.3),  # the decode side rebuilds the token history
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, seed=5),
        greedy(4, stop_token_ids=[7]),
    ]
    n = len(pair.decode.transfers)

    async def all_at_once() -> list[RequestOutput]:
        return await asyncio.gather(*(generate(pair.decode, f"mix-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))))

    outs = run(all_at_once())
    # Seeded draws depend on (seed, token index) only, so they match one process running them all.
    for out, want in zip(outs, reference(pair.path, prompts, params), strict=True):
        assert_same_output(out, want)
    for out, prompt, sp in zip(outs, prompts, params):
        if sp.greedy and sp.repetition_penalty == 1.0 and not sp.stop_token_ids:
            assert out.token_ids == hf_greedy(pair.path, prompt, sp.max_tokens)[0]
    assert len(pair.decode.transfers) - n == len(prompts) - 1
    run(settle(pair))


# ---------------------------------------------------------------- conditional disaggregation


def test_local_prefill_policy_choice():
    short_only = LocalPrefillPolicy(max_tokens=8)
    assert short_only.prefill_here(8, busy=True, step_tokens=256)
    assert not short_only.prefill_here(9, busy=False, step_tokens=256)
    idle = LocalPrefillPolicy(max_tokens=8, when_idle=True)
    assert idle.prefill_here(200, busy=False, step_tokens=256)  # nothing here for the prefill to delay
    assert not idle.prefill_here(200, busy=True, step_tokens=256)
    assert not idle.prefill_here(300, busy=False, step_tokens=256)  # more than one step: the prefill pool
    assert not LocalPrefillPolicy().prefill_here(1, busy=False, step_tokens=256)  # default: always hand off


def test_short_or_cached_prompts_prefill_on_the_decode_replica(pools, run, reference):
    """Prompts with few uncached tokens run whole on the decode replica (no prefill call, no transfer),
    longer ones are handed off; every output equals the single-process engine's."""
    pair = pools.get("tp2->tp1")
    short, long = prompts_of_lengths([6, 30], VOCAB, seed=11)
    extended = long + [7, 8, 9]  # 30 of its 33 tokens were cached by `long`'s handoff: 28 in 4-token blocks
    pair.decode.local_prefill = LocalPrefillPolicy(max_tokens=8)
    try:
        calls, transfers = len(pair.prefill_calls), len(pair.decode.transfers)
        outs = [run(generate(pair.decode, f"cd-{i}", p, greedy(6))) for i, p in enumerate((short, long, extended))]
        assert pair.prefill_calls[calls:] == ["cd-1"]  # only the long, uncached prompt went to the prefill pool
        assert len(pair.decode.transfers) == transfers + 1
        for out, want in zip(outs, reference(pair.path, [short, long, extended], greedy(6)), strict=True):
            assert_same_output(out, want)
        assert outs[2].num_cached_tokens == 28
        # An idle decode replica prefills a prompt that one step holds, whatever its length.
        pair.decode.local_prefill = LocalPrefillPolicy(max_tokens=0, when_idle=True)
        (other,) = prompts_of_lengths([30], VOCAB, seed=12)
        out = run(generate(pair.decode, "cd-idle", other, greedy(6)))
        assert pair.prefill_calls[-1] == "cd-1" and out.token_ids == hf_greedy(pair.path, other, 6)[0]
    finally:
        pair.decode.local_prefill = LocalPrefillPolicy()
    run(settle(pair))


# ---------------------------------------------------------------- aborts, in each state of a request


def test_abort_while_queued(pools, run):
    """A request with a decode reservation waits in the prefill queue behind a long prompt; it is cancelled."""
    pair = pools.get("tp2->tp1")
    long, short = prompts_of_lengths([40, 6], VOCAB, seed=4)

    async def body() -> RequestOutput:
        with StepGate(pair.prefill, prefilling("q-long")) as gate:
            long_task = asyncio.create_task(generate(pair.decode, "q-long", long, greedy(4)))
            await gate.wait()
            short_task = asyncio.create_task(generate(pair.decode, "q-short", short, greedy(4)))
            await poll(lambda: "q-short" in pair.D.scheduler.reserved
                       and any(s.seq_id == "q-short" for s in pair.P.scheduler.waiting), "q-short reserved and queued")
            await expect_cancelled(short_task)
            # Both sides let go of it at once, while the prefill engine is still stopped mid-prompt.
            await poll(lambda: "q-short" not in pair.D.scheduler.reserved and "q-short" not in pair.P.scheduler.seqs,
                       "q-short freed on both sides")
        return await long_task

    assert run(body()).token_ids == hf_greedy(pair.path, long, 4)[0]
    run(settle(pair))


def test_abort_while_an_engine_call_is_in_flight(pools, run):
    """Cancelled while its reservation (decode side) or its admission (prefill side) runs in the engine's
    thread: what lands after the caller left must be undone, not left to the 60 s lease."""
    pair = pools.get("tp2->tp1")
    (prompt,) = prompts_of_lengths([9], VOCAB, seed=5)

    async def body() -> None:
        for engine, method, rid in ((pair.D, "reserve", "c-reserve"), (pair.P, "add_request", "c-add")):
            with Hook(engine, method, block=True) as hook:
                task = asyncio.create_task(generate(pair.decode, rid, prompt, greedy()))
                await hook.wait_entered()
                task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await settle(pair)

    run(body())


def test_abort_while_prefilling(pools, run):
    pair = pools.get("tp2->tp1")
    (long,) = prompts_of_lengths([40], VOCAB, seed=6)

    async def body() -> None:
        with StepGate(pair.prefill, prefilling("p-long")) as gate:
            task = asyncio.create_task(generate(pair.decode, "p-long", long, greedy()))
            await gate.wait()
            assert "p-long" in pair.D.scheduler.reserved
            await expect_cancelled(task)
            # The decode side lets go at once. The prefill side has dropped the request without another
            # step; its blocks stay parked only while a step sent before the abort is out (asynchronous
            # scheduling planned the prompt's next chunk), and no allocation can take them meanwhile.
            await settle_replica(pair.decode)

            def dropped_and_parked(engine: LLMEngine) -> None:
                assert "p-long" not in engine.requests and "p-long" not in engine.scheduler.seqs
                assert engine.block_manager.num_used_blocks == engine.scheduler.num_parked_blocks

            deadline = time.monotonic() + 10
            while True:
                try:
                    await on_engine(pair.prefill, dropped_and_parked)
                    break
                except AssertionError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)
        await settle(pair)  # the gate opens: the step out answers and the parked blocks come back

    run(body())


def test_abort_while_transferring(pools, run):
    pair = pools.get("tp2->tp1")
    p1, p2 = prompts_of_lengths([14, 11], VOCAB, seed=7)
    pair.prefill.executor.kv_call("set_send_delay", 1.0)  # well inside the transfer timeout

    async def body() -> None:
        with Hook(pair.decode, "_transfer_blocking") as transfer:
            task = asyncio.create_task(generate(pair.decode, "t-1", p1, greedy()))
            await transfer.wait_entered()
            await expect_cancelled(task)
            # The cancelled caller got control back only once the transfer stopped writing into its
            # decode blocks and released the pair: neither may be reused before that.
            assert transfer.exited.is_set()

    try:
        run(body())
    finally:
        pair.prefill.executor.kv_call("set_send_delay", 0.0)
    run(settle(pair))
    # The pair is still in step: the next request over it is correct.
    assert run(generate(pair.decode, "t-2", p2, greedy())).token_ids == hf_greedy(pair.path, p2, 6)[0]
    run(settle(pair))


def test_first_token_streams_before_the_kv_moves(pools, run, reference):
    """The client's first item is the prefill side's token, sent while the transfer is still stalled; the
    stream then goes on from it without repeating it, and equals the single-process output."""
    pair = pools.get("tp2->tp1")
    (prompt,) = prompts_of_lengths([13], VOCAB, seed=13)
    pair.prefill.executor.kv_call("set_send_delay", 1.0)  # well inside the transfer timeout
    items: list[RequestOutput] = []
    moved_at_first: list[int] = []

    async def body() -> None:
        before = len(pair.decode.transfers)
        async for out in pair.decode.generate("ft-1", prompt, greedy(5, logprobs=1)):
            if not items:
                moved_at_first.append(len(pair.decode.transfers) - before)
            items.append(replace(out, token_ids=list(out.token_ids), new_token_ids=list(out.new_token_ids)))

    try:
        run(body())
    finally:
        pair.prefill.executor.kv_call("set_send_delay", 0.0)
    assert moved_at_first == [0] and items[0].finish_reason is None and len(items[0].new_token_ids) == 1
    streamed = [t for it in items for t in it.new_token_ids]
    (want,) = reference(pair.path, [prompt], greedy(5, logprobs=1))
    assert streamed == want.token_ids and "".join(it.new_text for it in items) == want.text
    assert_same_output(items[-1], want)
    run(settle(pair))


def test_prefill_rank_handles_travel_once_per_replica(pools, run, monkeypatch):
    """The decode replica keeps a prefill replica's rank handles: later answers omit them."""
    pair = pools.get("tp2->tp1")
    sent: list[int] = []
    original = pair.prefill.prefill

    async def recording(*args):
        async for ready in original(*args):
            sent.append(len(ready.rank_handles))
            yield ready

    monkeypatch.setattr(pair.prefill, "prefill", recording)
    pair.decode._peer_ranks.clear()
    prompts = prompts_of_lengths([11, 12], VOCAB, seed=14)
    outs = [run(generate(pair.decode, f"rh-{i}", p, greedy(4))) for i, p in enumerate(prompts)]
    assert sent == [2, 0]  # two prefill ranks' handles, once
    assert [o.token_ids for o in outs] == [hf_greedy(pair.path, p, 4)[0] for p in prompts]
    run(settle(pair))


def test_abort_while_decoding(pools, run):
    pair = pools.get("tp2->tp1")
    (prompt,) = prompts_of_lengths([7], VOCAB, seed=8)
    outs: list[RequestOutput] = []
    decoding = asyncio.Event()

    async def consume() -> None:
        async for out in pair.decode.generate("d-1", prompt, greedy(150)):
            outs.append(out)
            if len(outs) >= 2:  # the first token comes from the prefill side, before the KV moved
                decoding.set()

    async def body() -> None:
        task = asyncio.create_task(consume())
        await asyncio.wait_for(decoding.wait(), WAIT_S)
        assert "d-1" in pair.D.scheduler.seqs
        await expect_cancelled(task)

    run(body())
    assert 1 <= len(outs[-1].token_ids) < 150
    run(settle(pair))


# ---------------------------------------------------------------- failures


def test_stalled_transfer_times_out_and_leaks_nothing(pools, run):
    pair = pools.get("tp2->tp1")
    p1, p2 = prompts_of_lengths([10, 12], VOCAB, seed=9)
    pair.prefill.executor.kv_call("set_send_delay", TRANSFER_TIMEOUT_S + 2)
    start = time.monotonic()
    try:
        with pytest.raises(KVTransferError, match="s-1"):
            run(generate(pair.decode, "s-1", p1, greedy()))
    finally:
        pair.prefill.executor.kv_call("set_send_delay", 0.0)
    elapsed = time.monotonic() - start
    # Retried once with a fresh prefill, each attempt given up after the configured transfer timeout.
    assert pair.prefill_calls.count("s-1") == 2
    assert 2 * TRANSFER_TIMEOUT_S <= elapsed < 2 * TRANSFER_TIMEOUT_S + 20
    run(settle(pair))
    # The pair group was rebuilt: a new transfer works while the stalled sends are still winding down.
    assert run(generate(pair.decode, "s-2", p2, greedy())).token_ids == hf_greedy(pair.path, p2, 6)[0]
    run(settle(pair))


def test_killed_prefill_rank_fails_the_request_and_frees_the_reservation(pools, run):
    pair = pools.get("tp2->tp1")
    (long,) = prompts_of_lengths([40], VOCAB, seed=10)

    async def body() -> None:
        with StepGate(pair.prefill, prefilling("k-1")) as gate:
            task = asyncio.create_task(generate(pair.decode, "k-1", long, greedy()))
            await gate.wait()
            ray.kill(pair.prefill.executor.workers[0])
            start = time.monotonic()
        # The prefill engine's next step finds its rank gone; the one retry finds the engine dead.
        with pytest.raises(EngineDeadError, match=r"rank 0 \(pp=0, sp=0, tp=0\) died"):
            await task
        assert time.monotonic() - start < 30
        assert pair.prefill_calls.count("k-1") == 2
        await settle(pair)

    try:
        run(body())
    finally:
        pools.close()


# ---------------------------------------------------------------- prefill PP=2 (pipelined steps) -> decode TP=1


def test_pp2_prefill_with_pipelined_steps_hands_off_to_tp1(pools, run):
    """A PP=2 prefill pool runs pipelined steps (two step groups, one in flight per stage); prompts arriving together
    spread over both groups, each stage sends its own layers' KV, and every output equals HF's."""
    pair = pools.get("pp2->tp1")
    assert pair.prefill.llm_engine.step_groups == 2
    assert [s.layers for s in pair.prefill.shards] == [range(0, 1), range(1, 2)]
    prompts = prompts_of_lengths([3, 9, 17, 26], VOCAB, seed=5)
    params = greedy(6)

    async def together():
        return await asyncio.gather(*(generate(pair.decode, f"pp-{i}", p, params) for i, p in enumerate(prompts)))

    for out, prompt in zip(run(together()), prompts, strict=True):
        assert out.token_ids == hf_greedy(pair.path, prompt, 6)[0]
    run(settle(pair))


# ---------------------------------------------------------------- prefill TP=1 -> decode TP=2, one KV head


def test_tp1_to_tp2_replicated_kv_head(pools, run, reference):
    pair = pools.get("tp1->tp2")
    # One KV head, two decode ranks: each holds (and is sent) its own copy of it.
    assert [s.heads for s in pair.decode.shards] == [range(0, 1), range(0, 1)]
    per_block = kv_bytes_per_block(pair.path, pair.decode.shards)
    assert per_block == 2 * (2 * 2 * BLOCK * 1 * 32 * 4)  # 2 ranks x (2 layers x K,V x 4 tokens x 1 head x 32 x fp32)
    prompts = prompts_of_lengths([2, 11, 19], VOCAB, seed=11)
    params = greedy(8)
    n = len(pair.decode.transfers)
    outs = [run(generate(pair.decode, f"b-{i}", p, params)) for i, p in enumerate(prompts)]
    for out, want, prompt in zip(outs, reference(pair.path, prompts, params), prompts, strict=True):
        assert out.token_ids == hf_greedy(pair.path, prompt, 8)[0]
        assert_same_output(out, want)
    moved = pair.decode.transfers[n:]
    assert [(t.blocks, t.bytes) for t in moved] == [(blocks_needed(len(p)), blocks_needed(len(p)) * per_block) for p in prompts]
    run(settle(pair))


def test_prefill_lease_frees_kv_a_vanished_decode_never_collected(pools, run):
    pair = pools.get("tp1->tp2")
    (prompt,) = prompts_of_lengths([13], VOCAB, seed=12)
    gone = Reservation("lease-1", "decode-gone", [], 0, pair.decode.shards)

    async def body() -> None:
        # A decode replica that gets its answer and then vanishes: it neither collects the KV nor closes the stream.
        stream = pair.prefill.prefill("lease-1", prompt, greedy(), 0, gone)
        ready = await anext(stream)
        answered = time.monotonic()
        assert not ready.finished and len(ready.block_ids) == blocks_needed(13)
        assert "lease-1" in pair.P.scheduler.held
        await poll(lambda: not pair.P.scheduler.held and pair.P.block_manager.num_used_blocks == 0,
                   "the held KV freed", timeout=LEASE_S + 10)
        assert time.monotonic() - answered > LEASE_S / 2  # by the lease, not by anything else
        await stream.aclose()  # a late close frees nothing twice
        await settle(pair)

    run(body())


def test_killed_decode_rank_fails_fast_and_prefill_frees_its_kv(pools, run):
    pair = pools.get("tp1->tp2")
    short, long, other = prompts_of_lengths([6, 40, 5], VOCAB, seed=13)
    decoding = asyncio.Event()

    async def consume() -> None:
        async for out in pair.decode.generate("kd-1", short, greedy(150)):
            if len(out.token_ids) >= 2:  # decoding here (the first token came from the prefill side)
                decoding.set()

    async def body() -> None:
        running = asyncio.create_task(consume())
        await asyncio.wait_for(decoding.wait(), WAIT_S)
        with StepGate(pair.prefill, prefilling("kd-2")) as gate:
            waiting = asyncio.create_task(generate(pair.decode, "kd-2", long, greedy()))
            await gate.wait()
            ray.kill(pair.decode.executor.workers[1])
            start = time.monotonic()
            # The decoding request learns it at the decode engine's next step.
            with pytest.raises(EngineDeadError):
                await running
            assert time.monotonic() - start < 30
        # The prefill side finishes kd-2 and answers a decode replica that can no longer receive it:
        # an error at once, with no second prefill (the decode side itself is what failed).
        with pytest.raises((EngineDeadError, ExecutorError), match="died|failed"):
            await waiting
        assert time.monotonic() - start < 30
        assert pair.prefill_calls.count("kd-2") == 1
        await poll(lambda: not pair.P.scheduler.held and pair.P.block_manager.num_used_blocks == 0,
                   "the prefill side freed kd-2's KV", timeout=LEASE_S + 10)
        # A new request fails at once, before any prefill.
        with pytest.raises((EngineDeadError, ExecutorError)):
            await generate(pair.decode, "kd-3", other, greedy())
        assert "kd-3" not in pair.prefill_calls
        await settle(pair)

    try:
        run(body())
    finally:
        pools.close()


def test_a_decode_rank_dead_while_its_engine_idles_fails_the_pools_health_check(pools, run):
    """A decode rank killed between steps: the next handoff's receive finds it dead, so the request fails and the
    replica refuses the next ones, while its engine, which has run no step since, still looks alive. The pool's
    health check must fail all the same, so that Serve replaces the replica (the fault script found one that
    answered 500 for 35 s, until the script killed it)."""
    from router.pools import _PoolMethods

    pair = pools.get("tp1->tp2")
    (prompt,) = prompts_of_lengths([40], VOCAB, seed=17)
    pool = _PoolMethods()
    pool.replica = pair.decode

    async def body() -> None:
        await pool.check_health()
        ray.kill(pair.decode.executor.workers[1])
        with pytest.raises((EngineDeadError, ExecutorError, KVTransferError)):
            await generate(pair.decode, "hd-1", prompt, greedy())
        assert pair.decode.async_engine.alive and not pair.decode.alive  # the case: no step has failed
        with pytest.raises(RuntimeError, match="one of its ranks has stopped"):
            await pool.check_health()

    try:
        run(body())
    finally:
        pools.close()


def test_prompt_logprobs_travel_from_the_prefill_side(pools, run, reference):
    """vLLM's prompt_logprobs of a handed-off request are the prefill engine's, on token 1 and on the last
    output (which a non-streaming client reads), equal to the single-process engine's."""
    pair = pools.get("tp2->tp1")
    (prompt,) = prompts_of_lengths([11], VOCAB, seed=5)
    params = greedy(5, prompt_logprobs=2)

    async def outputs() -> list[RequestOutput]:
        return [out async for out in pair.decode.generate("plp", prompt, params)]

    outs = run(outputs())
    (want,) = reference(pair.path, [prompt], params)
    assert pair.decode.prefill_sites["remote"] >= 1 and outs[-1].finished
    for out in (outs[0], outs[-1]):
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for got, exp in zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert got.keys() == exp.keys() and all(abs(got[t] - exp[t]) < 1e-4 for t in got)
    run(settle(pair))


# ---------------------------------------------------------------- router-driven prefill


async def routed(pair: Pair, rid: str, prompt: list[int], params: SamplingParams,
                 answer: Any = None) -> tuple[list[Any], PrefillReady | None]:
    """A request as the router drives it (router/disaggregated.py `_generate_routed`): the prefill replica's
    `prefill_first` and the decode replica's `generate(prefilled=...)` started together. Returns the decode
    side's items (RESERVED first) and the answer the router would stream token 1 from."""
    if answer is None:
        answer = asyncio.ensure_future(pair.prefill.prefill_first(rid, prompt, params, 0))
    items = []
    async for out in pair.decode.generate(rid, prompt, params, prefilled=answer):
        items.append(out if out is RESERVED else replace(out, token_ids=list(out.token_ids),
                                                          new_token_ids=list(out.new_token_ids)))
    ready = answer.result() if isinstance(answer, asyncio.Future) and answer.exception() is None else None
    return items, ready


def test_router_prefill_streams_token_1_from_the_prefill_answer(pools, run, reference):
    """The decode replica says RESERVED, takes the router's prefill answer without calling the prefill pool,
    moves the KV and never repeats token 1 (the router streamed it from the same answer); together the two
    streams are the single-process output, logprobs and prompt logprobs included; both sides end clean."""
    pair = pools.get("tp2->tp1")
    (prompt,) = prompts_of_lengths([15], VOCAB, seed=21)
    params = greedy(5, logprobs=1, prompt_logprobs=1)
    calls, transfers = len(pair.prefill_calls), len(pair.decode.transfers)
    items, ready = run(routed(pair, "rp-1", prompt, params))
    assert items[0] is RESERVED and ready is not None and not ready.finished
    assert len(pair.prefill_calls) == calls and len(pair.decode.transfers) == transfers + 1
    first = streamable(ready.output)
    outs = items[1:]
    assert first.finish_reason is None and len(first.new_token_ids) == 1
    assert outs[0].token_ids[0] == first.token_ids[0] and outs[0].new_token_ids != first.new_token_ids
    streamed = first.new_token_ids + [t for o in outs for t in o.new_token_ids]
    (want,) = reference(pair.path, [prompt], params)
    assert streamed == want.token_ids and first.new_text + "".join(o.new_text for o in outs) == want.text
    assert_same_output(outs[-1], want)
    assert first.prompt_logprobs is not None and outs[-1].prompt_logprobs == first.prompt_logprobs
    assert {"reserved", "first_token", "prefill_answered", "kv_push_end"} <= set(outs[-1].timeline)
    run(settle(pair))


def test_router_prefill_given_up_frees_the_prefill_blocks_before_the_lease(pools, run):
    """The client leaves after the reservation (RESERVED) and before any KV moved: the decode replica has the
    prefill ranks abandon the answer, and the prefill replica frees the blocks at once, not at its 60 s lease."""
    pair = pools.get("tp2->tp1")
    (prompt,) = prompts_of_lengths([14], VOCAB, seed=22)

    async def body() -> None:
        answer = asyncio.ensure_future(pair.prefill.prefill_first("rp-gone", prompt, greedy(), 0))
        stream = pair.decode.generate("rp-gone", prompt, greedy(), prefilled=answer)
        assert await anext(stream) is RESERVED
        await answer  # the prefill replica holds the blocks for the transfer now
        assert pair.P.held_block_ids("rp-gone")
        await stream.aclose()
        await settle(pair, timeout=10.0)  # the lease is 60 s

    run(body())


def test_router_prefill_abandoned_before_its_send_is_discarded_and_the_pair_stays_in_step(pools, run):
    """Issue 24's race: the router abandons the prefill (its client gone, not knowing whether the decode call reached
    a replica) while the decode replica is about to move the KV. The prefill replica frees the blocks at once; the
    sends that come after still pair their messages with the decode ranks' receives, but say the KV was abandoned,
    so the decode replica throws it away with its reservation (PrefillAbandoned, not retried) instead of decoding
    from blocks that may hold another request's KV. The next handoff over the pair is correct."""
    pair = pools.get("tp2->tp1")
    first, second = prompts_of_lengths([14, 13], VOCAB, seed=33)
    calls, transfers = len(pair.prefill_calls), len(pair.decode.transfers)

    async def body() -> None:
        answer = asyncio.ensure_future(pair.prefill.prefill_first("ab-1", first, greedy(), 0))
        with Hook(pair.decode, "_transfer_blocking", block=True) as transfer:
            task = asyncio.create_task(routed(pair, "ab-1", first, greedy(), answer))
            await transfer.wait_entered()  # the decode replica is about to call the prefill ranks' send
            abandon_prefill(await answer)
            await poll(lambda: "ab-1" not in pair.P.scheduler.held, "the abandoned blocks freed", timeout=10)
        with pytest.raises(PrefillAbandoned, match="ab-1"):
            await task
        assert len(pair.prefill_calls) == calls and len(pair.decode.transfers) == transfers  # no retry, no stats
        await settle(pair)
        items, _ = await routed(pair, "ab-2", second, greedy())
        assert items[0] is RESERVED and items[-1].token_ids == hf_greedy(pair.path, second, 6)[0]

    run(body())
    run(settle(pair))


def test_held_prefills_nobody_collects_do_not_hold_up_the_others(pools, run):
    """20 router-driven prefills whose decode side never comes (held until their 60 s lease), then requests
    handed off as usual: theirs must still be sent and freed at once. Each held request used to block a thread
    of the replica and one of each prefill rank actor's 16 in a blocking wait for its send until its lease, so the sends and
    the frees of the later requests waited for those leases; one watcher now asks the ranks about all of them."""
    pair = pools.get("tp2->tp1")
    stuck_prompts = prompts_of_lengths([12] * 20, VOCAB, seed=31)
    prompts = prompts_of_lengths([13, 14, 15], VOCAB, seed=32)

    def held(rid: str) -> bool:
        return rid in pair.P.scheduler.held

    async def body() -> None:
        stuck = await asyncio.gather(*(pair.prefill.prefill_first(f"stuck-{i}", p, greedy(), 0)
                                       for i, p in enumerate(stuck_prompts)))
        assert all(not r.finished and held(f"stuck-{i}") for i, r in enumerate(stuck))
        t0 = time.monotonic()
        for i, prompt in enumerate(prompts):
            items, ready = await asyncio.wait_for(routed(pair, f"after-{i}", prompt, greedy()), 20)
            assert items[0] is RESERVED and ready is not None and items[-1].finished
        deadline = time.monotonic() + 5
        while any(held(f"after-{i}") for i in range(len(prompts))) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not any(held(f"after-{i}") for i in range(len(prompts))), "freed only at the lease"
        assert time.monotonic() - t0 < 20
        assert all(held(f"stuck-{i}") for i in range(len(stuck)))  # still waiting for a decode side
        for i, ready in enumerate(stuck):
            abandon_prefill(ready)
        await settle(pair, timeout=10.0)

    run(body())


def test_a_retry_that_finds_no_prefill_replica_runs_here_even_on_the_last_attempt(pools, run, monkeypatch):
    """The router's prefill failed (its replica's rank died mid-prefill), and the re-prefill finds no live prefill
    replica (Serve has not started a replacement yet): the decode replica prefills the prompt itself rather than
    fail the request (on CPU the fault script saw five 500s so, when a prefill rank was killed)."""
    pair = pools.get("tp2->tp1")
    (prompt,) = prompts_of_lengths([13], VOCAB, seed=25)
    fallbacks = pair.decode.prefill_fallbacks

    async def failed() -> PrefillReady:
        raise RuntimeError("the prefill replica's engine failed: a rank died")

    async def no_replica(*args) -> AsyncIterator[PrefillReady]:
        raise PrefillUnavailable("the pool has had no live replica for 1s in the prefill pool")
        yield  # an async generator, as the pool client is

    monkeypatch.setattr(pair.decode, "prefill", no_replica)
    items, _ = run(routed(pair, "rp-none", prompt, greedy(5), failed()))
    assert items[0] is RESERVED and pair.decode.prefill_fallbacks == fallbacks + 1
    assert [t for o in items[1:] for t in o.new_token_ids] == hf_greedy(pair.path, prompt, 5)[0]
    run(settle(pair))


def test_router_prefill_on_a_full_decode_replica_refuses_and_frees_both_sides(pools, run, monkeypatch):
    """A decode replica without room refuses (QueueFullError) before RESERVED, so the router streams nothing;
    the prefill answer that lands afterwards is abandoned, its blocks freed at once."""
    pair = pools.get("tp2->tp1")
    (prompt,) = prompts_of_lengths([14], VOCAB, seed=23)
    monkeypatch.setattr(pair.D, "reserve", lambda *args: None)

    async def body() -> None:
        answer = asyncio.ensure_future(pair.prefill.prefill_first("rp-full", prompt, greedy(), 0))
        with pytest.raises(QueueFullError):
            await routed(pair, "rp-full", prompt, greedy(), answer)
        assert not (await answer).finished
        await settle(pair, timeout=10.0)

    run(body())


def test_router_prefill_that_failed_runs_here_and_streams_token_1_itself(pools, run):
    """The router's prefill replica died (PrefillUnavailable): the router has no token to stream, and the
    decode replica prefills the prompt itself and streams every token, the first included."""
    pair = pools.get("tp2->tp1")
    (prompt,) = prompts_of_lengths([13], VOCAB, seed=24)
    fallbacks = pair.decode.prefill_fallbacks

    async def dead() -> PrefillReady:
        raise PrefillUnavailable("the prefill replica died")

    items, _ = run(routed(pair, "rp-dead", prompt, greedy(5), dead()))
    assert items[0] is RESERVED and pair.decode.prefill_fallbacks == fallbacks + 1
    streamed = [t for o in items[1:] for t in o.new_token_ids]
    assert len(items[1].new_token_ids) == 1 and streamed == hf_greedy(pair.path, prompt, 5)[0]
    run(settle(pair))


def test_a_warmed_pair_is_built_before_its_first_handoff_which_then_uses_it(pools, run, reference):
    """router/kv_peers.py: a decode replica builds its group with a prefill replica it learns of before any request
    (the first handoff on a cold pair paid ~1 s for NCCL's communicator on GPUs). Warming twice is a no-op; the
    handoff after it moves the KV on the warmed group (no second join), and the output is the single-process one."""
    pools.close()  # a fresh pair: no group built yet on either side
    pair = pools.get("tp2->tp1")
    prefill, decode = pair.prefill, pair.decode
    pair_id = f"{prefill.replica_id}->{decode.replica_id}"
    assert not decode.executor.kv_call("has_group", pair_id)[0]
    handles = list(prefill.executor.workers)
    assert run(decode.warm_pair(prefill.replica_id, handles, prefill.shards)) is True
    assert pair_id in decode._joined and decode._peer_ranks[prefill.replica_id] == handles
    assert all(decode.executor.kv_call("has_group", pair_id)) and all(prefill.executor.kv_call("has_group", pair_id))
    assert run(decode.warm_pair(prefill.replica_id, handles, prefill.shards)) is False
    joins = []
    original = decode._connect
    decode._connect = lambda *a: (joins.append(a), original(*a))
    try:
        (prompt,) = prompts_of_lengths([13], VOCAB, seed=31)
        out = run(generate(decode, "warm-1", prompt, greedy(4)))
    finally:
        decode._connect = original
    (want,) = reference(pair.path, [prompt], greedy(4))
    assert out.token_ids == want.token_ids and not joins and len(decode.transfers) == 1
    run(settle(pair))
