"""Issue 24, item 2: a long prompt's KV moves in pieces while it is prefilled (`DecodeReplica(kv_pieces=True)`,
`PrefillPiece`), and several transfers are in flight at once on one prefill/decode pair (`_PostOrder`), at most
the decode replica's `kv_transfers_in_flight`.

A "tp2->tp1" pair of tests/test_disagg.py (a GQA Llama prefilled on 2 ranks and decoded on 1, Ray actors, gloo),
its decode replica asking for pieces with IN_FLIGHT transfers in flight per pair (the served default is 1:
engine/disagg.py TRANSFERS_IN_FLIGHT_DEFAULT says why). Prefill engines take 16 tokens a step with 4-token blocks,
so a 40-token prompt is prefilled in three steps: pieces of blocks 0-3 and 4-7, then the rest (8-9) with the first token.
`StepGate` freezes the prefill engine after its first chunk, so a piece provably moves while the prompt is not
yet computed. After every test both engines hold no block, lease or request.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from engine.disagg import DecodeReplica, TransferStats
from engine.llm_engine import LLMEngine
from tests.models import hf_greedy, prompts_of_lengths, tiny_model
from tests.test_disagg import (BLOCK, PREFILL_CHUNK, TRANSFER_TIMEOUT_S, VOCAB, WAIT_S, Pair, StepGate,
                               assert_same_output, build_pair, expect_cancelled, generate, greedy, poll, settle)
from tests.test_disagg import ray_session, run  # noqa: F401 - the module's fixtures: shared Ray, one event loop
from tests.test_kv_transfer_claims import _both
from workers.config import EngineConfig
from workers.kv_transfer.plan import plan_transfers, replica_shards
from workers.kv_transfer.transport import KVTransferAgent, KVTransferError, PairSpec

pytestmark = pytest.mark.slow
LONG = 40  # three prefill steps of PREFILL_CHUNK tokens
IN_FLIGHT = 4  # the pair's decode replica's kv_transfers_in_flight


@pytest.fixture(scope="module")
def pair(ray_session, run) -> Pair:
    pair = build_pair(tiny_model("llama"), dict(tensor_parallel_size=2, max_num_batched_tokens=PREFILL_CHUNK),
                      dict(tensor_parallel_size=1), dict(kv_pieces=True, kv_transfers_in_flight=IN_FLIGHT))
    yield pair
    pair.shutdown()


@pytest.fixture(scope="module")
def reference():
    from engine.llm import LLM

    llm = LLM(tiny_model("llama"), block_size=BLOCK, show_progress=False)
    yield llm
    llm.shutdown()


class Transfers:
    """Records the decode replica's transfers as they run: (piece, block indices, stats), and how many ran at once."""

    def __init__(self, decode: DecodeReplica):
        self.decode = decode
        self.done: list[tuple[bool, list[int], TransferStats]] = []
        self.entered: list[bool] = []  # piece or not, of every transfer begun
        self.running = self.most_at_once = 0
        self._lock = threading.Lock()

    def __enter__(self) -> "Transfers":
        original = self.decode._transfer_blocking

        def recorded(spec, state, seq, peer, plan, res, num_blocks, piece):
            with self._lock:
                self.entered.append(piece)
                self.running += 1
                self.most_at_once = max(self.most_at_once, self.running)
            try:
                stats = original(spec, state, seq, peer, plan, res, num_blocks, piece)
            finally:
                with self._lock:
                    self.running -= 1
            blocks = sorted({i for t in plan for i in t.blocks})
            with self._lock:
                self.done.append((piece, blocks, stats))
            return stats

        self.decode._transfer_blocking = recorded
        return self

    def __exit__(self, *exc) -> None:
        del self.decode._transfer_blocking


def first_chunk_done(rid: str):
    def when(engine: LLMEngine) -> bool:
        seq = engine.scheduler.seqs.get(rid)
        return seq is not None and PREFILL_CHUNK <= seq.num_computed_tokens < seq.num_prompt_tokens
    return when


def test_the_engine_tells_each_chunks_full_blocks_then_hands_off():
    """`add_request(pieces=True)`: every prefill step that completes more blocks outputs them (only full ones: the
    next chunk writes the partial block), no token; the handoff's output holds all of them, first the same."""
    engine = LLMEngine(EngineConfig.from_kwargs(model=tiny_model("llama"), block_size=BLOCK, num_gpu_blocks_override=64,
                                                max_num_batched_tokens=PREFILL_CHUNK, async_scheduling=False),
                       show_progress=False)
    try:
        (prompt,) = prompts_of_lengths([LONG + 2], VOCAB, seed=3)
        engine.add_request("pc-1", prompt, greedy(), handoff=True, pieces=True)
        engine.add_request("plain", prompt[:10], greedy(2))  # no pieces for it
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o.snapshot() for o in engine.step()]
        told = [o.kv_blocks for o in outputs if o.kv_blocks is not None]
        assert all(o.request_id == "pc-1" and not o.new_token_ids and not o.finished for o in outputs if o.kv_blocks)
        held, epoch = engine.held_kv("pc-1")
        assert epoch == 0 and len(held) == -(-(LONG + 2) // BLOCK)
        # 16 tokens a step (the plain request, added second, waits): 16, 32 tokens computed, then all 42 and a token.
        assert [len(b) for b in told] == [4, 8] and all(b == held[:len(b)] for b in told)
        (last,) = [o for o in outputs if o.request_id == "pc-1" and o.finished]
        assert last.finish_reason == "handoff" and last.kv_blocks is None
        assert engine._piece_requests == 0
        engine.release("pc-1")
    finally:
        engine.shutdown()


def test_pieces_move_while_the_prompt_is_prefilled_and_the_output_is_single_process(pair, run, reference):
    (prompt,) = prompts_of_lengths([LONG], VOCAB, seed=41)
    params = greedy(6, logprobs=2)

    async def body():
        with Transfers(pair.decode) as transfers:
            with StepGate(pair.prefill, first_chunk_done("pc-2")) as gate:
                task = asyncio.create_task(generate(pair.decode, "pc-2", prompt, params))
                await gate.wait()
                # The prefill engine is frozen after its first chunk: the piece of blocks 0-3 lands meanwhile.
                await poll(lambda: transfers.done, "a piece moved while the prompt was half prefilled")
                assert [(piece, blocks) for piece, blocks, _ in transfers.done] == [(True, [0, 1, 2, 3])]
                assert "pc-2" in pair.P.scheduler.seqs  # still prefilling
            out = await task
        return out, transfers

    out, transfers = run(body())
    assert_same_output(out, reference.generate([prompt], params)[0])
    assert out.token_ids == hf_greedy(pair.path, prompt, 6)[0]
    # Every block once, the last with the ack. In finishing order the final transfer may come before the piece ahead
    # of it: it is posted after every piece is numbered on the pair, and `_Pieces.finish` waits for all of them to
    # land before the decode starts, but its two blocks can land before that piece's four (seen once in CI with the
    # next step sent before the text work).
    pieces = sorted(((piece, blocks) for piece, blocks, _ in transfers.done), key=lambda p: p[1][0])
    assert pieces == [(True, [0, 1, 2, 3]), (True, [4, 5, 6, 7]), (False, [8, 9])]
    handoff = pair.decode.transfers[-1]  # one handoff's stats, its transfers combined
    assert handoff.blocks == 10 and handoff.bytes == sum(s.bytes for _, _, s in transfers.done)
    assert handoff.start == min(s.start for _, _, s in transfers.done) and handoff.end == max(s.end for _, _, s in transfers.done)
    run(settle(pair))


def _handoffs_with_stalled_sends(pair, run, prompts: list[list[int]], delay_s: float, tag: str):
    """The prompts handed off at once, each prefill send stalled delay_s after gathering: (outputs, Transfers)."""
    pair.prefill.executor.kv_call("set_send_delay", delay_s)

    async def body():
        with Transfers(pair.decode) as transfers:
            outs = await asyncio.gather(*(generate(pair.decode, f"{tag}-{i}", p, greedy(5)) for i, p in enumerate(prompts)))
        return outs, transfers

    try:
        return run(body())
    finally:
        pair.prefill.executor.kv_call("set_send_delay", 0.0)


def test_two_requests_transfers_are_in_flight_together_on_one_pair(pair, run, reference):
    """With the one-transfer lock gone, two handoffs on the pair overlap: the second's transfer is posted while the
    first's is still on its way (each send stalls 0.5 s after gathering), and both outputs are right."""
    prompts = prompts_of_lengths([13, 11], VOCAB, seed=42)
    outs, transfers = _handoffs_with_stalled_sends(pair, run, prompts, 0.5, "two")
    assert transfers.most_at_once == 2
    (a, b) = [stats for _, _, stats in transfers.done]
    assert max(a.start, b.start) < min(a.end, b.end)  # in flight together
    for out, want in zip(outs, reference.generate(prompts, greedy(5))):
        assert out.token_ids == want.token_ids
    run(settle(pair))


def test_kv_transfers_in_flight_bounds_the_transfers_running_at_once_on_a_pair(pair, run, reference):
    """IN_FLIGHT + 1 handoffs at once, each send stalled 1 s before posting (the stalls take turns, `_PostOrder`,
    so the transfers end 1 s apart): IN_FLIGHT transfers run at once on the pair, never more, and every output is
    right."""
    assert pair.decode.kv_transfers_in_flight == IN_FLIGHT
    prompts = prompts_of_lengths([9 + i for i in range(IN_FLIGHT + 1)], VOCAB, seed=45)
    outs, transfers = _handoffs_with_stalled_sends(pair, run, prompts, 1.0, "bound")
    # A handoff's prompt may be chunked beside another's: then it moves in pieces too, so more transfers than requests.
    assert len(transfers.done) > IN_FLIGHT and transfers.most_at_once == IN_FLIGHT
    for out, want in zip(outs, reference.generate(prompts, greedy(5))):
        assert out.token_ids == want.token_ids
    run(settle(pair))


def test_a_decode_replica_refuses_a_bad_kv_transfers_in_flight_before_it_starts():
    from engine.disagg import TRANSFERS_IN_FLIGHT_MAX

    for bad in (0, -1, TRANSFERS_IN_FLIGHT_MAX + 1, 2.5, "4", True):
        with pytest.raises(ValueError, match=f"kv_transfers_in_flight must be an integer from 1 to {TRANSFERS_IN_FLIGHT_MAX}"):
            DecodeReplica(None, None, kv_transfers_in_flight=bad)  # refused before the engine is touched


@pytest.mark.parametrize("phase", ["piece_in_flight", "pieces_landed", "last_in_flight"])
def test_an_abort_mid_push_leaks_no_block_and_the_pair_stays_in_step(pair, run, phase):
    (prompt,) = prompts_of_lengths([LONG], VOCAB, seed=43)
    rid = f"ab-{phase}"
    delay = 0.0 if phase == "pieces_landed" else 1.0
    pair.prefill.executor.kv_call("set_send_delay", delay)

    async def body():
        with Transfers(pair.decode) as transfers:
            if phase == "last_in_flight":
                task = asyncio.create_task(generate(pair.decode, rid, prompt, greedy()))
                await poll(lambda: False in transfers.entered and transfers.running, "the last transfer in flight")
                await expect_cancelled(task)
                assert transfers.running == 0
                return
            with StepGate(pair.prefill, first_chunk_done(rid)) as gate:
                task = asyncio.create_task(generate(pair.decode, rid, prompt, greedy()))
                await gate.wait()
                await poll(lambda: transfers.entered, "a piece's transfer began")
                if phase == "pieces_landed":
                    await poll(lambda: transfers.done, "the first piece landed")
                await expect_cancelled(task)
                # The cancelled caller got control back only once no piece wrote into its reservation any more.
                assert transfers.running == 0 and transfers.entered == [True]

    try:
        run(body())
    finally:
        pair.prefill.executor.kv_call("set_send_delay", 0.0)
    run(settle(pair))
    (p2,) = prompts_of_lengths([LONG - 3], VOCAB, seed=44)
    assert run(generate(pair.decode, f"{rid}-after", p2, greedy())).token_ids == hf_greedy(pair.path, p2, 6)[0]
    run(settle(pair))


# ---------------------------------------------------------------- numbered transfers on one agent pair, no Ray

LAYERS, HEADS, HEAD_DIM, BS, BLOCKS = 2, 2, 4, 2, 8


def _agents() -> tuple[KVTransferAgent, KVTransferAgent, PairSpec]:
    src, dst = replica_shards(1, 1, LAYERS, HEADS)[0], replica_shards(1, 1, LAYERS, HEADS)[0]
    cache = torch.randn(LAYERS, 2, BLOCKS, BS, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    prefill = KVTransferAgent(cache, src, "prefill", timeout_s=10.0)
    decode = KVTransferAgent(torch.zeros_like(cache), dst, "decode", timeout_s=10.0)
    prefill.message_bytes = 1  # one layer per message: each transfer is several messages
    decode.message_bytes = 1
    spec = PairSpec("p->d", 1, 1)
    host, port = prefill.open_store(spec.pair_id)
    _both(lambda: prefill.join(spec, host, port), lambda: decode.join(spec, host, port))
    return prefill, decode, spec


def test_numbered_transfers_called_out_of_order_post_in_order_and_each_lands_in_its_blocks():
    """Transfer 1's calls reach both ranks before transfer 0's: each rank holds it until it has posted transfer 0's
    messages, so the two pair up right (NCCL pairs by order), and each transfer's blocks land where they belong."""
    prefill, decode, spec = _agents()
    src = replica_shards(1, 1, LAYERS, HEADS)[0]
    jobs = {0: ([0, 1], [4, 5]), 1: ([2, 3], [6, 7])}  # seq: (prefill blocks, decode blocks)
    results, threads = {}, []

    def transfer(seq: int, side: str) -> None:
        src_blocks, dst_blocks = jobs[seq]
        plan = plan_transfers([src], [src], range(2))
        if side == "send":
            results[(seq, side)] = prefill.send(spec, plan, {0: src}, src_blocks, f"h{seq}", seq)
        else:
            results[(seq, side)] = decode.recv(spec, plan, {0: src}, dst_blocks, None, seq)

    for seq, side in [(1, "recv"), (1, "send")]:
        threads.append(threading.Thread(target=transfer, args=(seq, side)))
        threads[-1].start()
    time.sleep(0.3)
    assert not results and prefill._orders["p->d"].next == 0 == decode._orders["p->d"].next  # 1 waits for 0
    for seq, side in [(0, "send"), (0, "recv")]:
        threads.append(threading.Thread(target=transfer, args=(seq, side)))
        threads[-1].start()
    for t in threads:
        t.join(20)
    assert len(results) == 4 and prefill._orders["p->d"].next == 2 == decode._orders["p->d"].next
    for seq, (src_blocks, dst_blocks) in jobs.items():
        assert results[(seq, "send")].bytes == results[(seq, "recv")].bytes > 0
        assert torch.equal(decode.kv_cache[:, :, dst_blocks], prefill.kv_cache[:, :, src_blocks])
    assert prefill.sent_among(["h0", "h1"], 0.0) == ["h0", "h1"]  # acked: not pieces


def test_a_dropped_pair_fails_a_transfer_waiting_for_its_turn_at_once():
    prefill, decode, spec = _agents()
    src = replica_shards(1, 1, LAYERS, HEADS)[0]
    errors = []

    def late() -> None:
        try:
            decode.recv(spec, plan_transfers([src], [src], range(1)), {0: src}, [4], None, 3)
        except KVTransferError as e:
            errors.append(e)

    thread = threading.Thread(target=late)
    start = time.monotonic()
    thread.start()
    time.sleep(0.2)
    decode.drop(spec.pair_id)
    thread.join(WAIT_S)
    assert errors and time.monotonic() - start < 5 < TRANSFER_TIMEOUT_S


def test_a_preempted_prefills_pieces_are_sent_again_once_the_stale_ones_landed(run):
    """A preemption on the prefill side frees the blocks that earlier pieces were read from (maybe while being read):
    a piece or answer of a newer epoch waits for every older piece to land, then sends every block again over them."""
    from engine.disagg import PrefillPiece, PrefillReady, Reservation, _Pieces

    moves: list[tuple[str, list[int], bool]] = []

    class Replica:
        def _peer_handles(self, piece) -> None:
            pass

        async def _transfer(self, peer, res, blocks, piece=False, numbered=None):
            await asyncio.sleep(0.01)  # the pair's lock, say: the answer's transfer must still be numbered after
            moves.append(("start", list(blocks), piece))
            if numbered is not None:
                numbered.set()
            await asyncio.sleep(0.05)
            moves.append(("end", list(blocks), piece))
            return TransferStats(len(blocks), 0.05, len(blocks), time.time() - 0.05, time.time())

    async def body() -> TransferStats:
        pieces = _Pieces(Replica(), Reservation("r", "d", list(range(10)), 1, []))  # block 0 cached here
        await pieces.add(PrefillPiece("p", list(range(100, 104)), 0))
        await pieces.add(PrefillPiece("p", list(range(100, 104)), 0))  # nothing new: no transfer
        await pieces.add(PrefillPiece("p", list(range(200, 206)), 1))  # preempted meanwhile
        ready = PrefillReady("p", None, block_ids=list(range(200, 210)), epoch=1)
        return await pieces.finish(ready)

    moved = run(body())
    assert moves == [("start", [1, 2, 3], True), ("end", [1, 2, 3], True),  # the stale piece landed first,
                     ("start", [1, 2, 3, 4, 5], True), ("start", [6, 7, 8, 9], False),  # then all again, beside the rest
                     ("end", [1, 2, 3, 4, 5], True), ("end", [6, 7, 8, 9], False)]
    assert moved.blocks == 3 + 5 + 4  # the stale piece's blocks moved too


def test_a_handoffs_ack_waits_for_the_pieces_numbered_before_it():
    """The prefill replica frees a prompt's blocks on its last send's ack. A piece numbered before it gathers on a
    stream of its own, which nothing orders before that ack: so the ack waits until every transfer numbered before
    it has ended on the rank. Here the piece's send is held 2 s after posting; the last transfer lands at once."""
    prefill, decode, spec = _agents()
    src = replica_shards(1, 1, LAYERS, HEADS)[0]
    plan = plan_transfers([src], [src], range(2))
    original = prefill._wait

    def slow_piece(pair_id, group, works):
        if threading.current_thread().name == "piece":
            time.sleep(2.0)
        return original(pair_id, group, works)

    prefill._wait = slow_piece
    calls = {"piece": lambda: prefill.send(spec, plan, {0: src}, [0, 1], "", 0, True),
             "last": lambda: prefill.send(spec, plan, {0: src}, [2, 3], "h-last", 1),
             "recv0": lambda: decode.recv(spec, plan, {0: src}, [4, 5], None, 0),
             "recv1": lambda: decode.recv(spec, plan, {0: src}, [6, 7], None, 1)}
    threads = {name: threading.Thread(target=fn, name=name) for name, fn in calls.items()}
    for t in threads.values():
        t.start()
    threads["recv1"].join(10)
    threads["recv0"].join(10)
    threads["last"].join(1.0)  # its own messages are out: without the rule it acks now
    assert not threads["recv1"].is_alive() and threads["piece"].is_alive()  # everything landed; the piece's send runs on
    assert prefill.sent_among(["h-last"], 0.0) == []  # so no ack yet: its blocks stay held
    for t in threads.values():
        t.join(20)
    assert prefill.sent_among(["h-last"], 5.0) == ["h-last"]
    assert torch.equal(decode.kv_cache[:, :, [4, 5, 6, 7]], prefill.kv_cache[:, :, [0, 1, 2, 3]])


def test_a_piece_waits_for_the_event_of_the_step_that_computed_it():
    """`ChunkEnds`: a prefill rank notes, per step that runs prefill chunks, how far each sequence is computed once the
    step's event fires; a piece's send waits for the first such event past its last token, not for the engine's
    whole stream (which also holds the chunk after it). Dropped sequences are forgotten."""
    from workers.kv_transfer.chunk_ends import KEEP, ChunkEnds
    from workers.sampling_params import SamplingParams
    from workers.scheduler_output import ScheduledSeq, SchedulerOutput

    events = iter(range(100))
    ends = ChunkEnds(new_event=lambda: f"event-{next(events)}")

    def step(*seqs, finished=()):
        return SchedulerOutput(seqs=[ScheduledSeq(sid, [1] * n, start, [], sample, SamplingParams(), 0)
                                     for sid, start, n, sample in seqs], finished_seq_ids=list(finished))

    ends.record(step(("a", 0, 16, False), ("b", 0, 6, False)))  # event-0: a to 16, b to 6
    ends.record(step(("a", 16, 16, False), ("b", 6, 1, True)))  # event-1: a to 32; b samples (its last step)
    ends.record(step(("c", 0, 1, True)))  # decodes only: no event
    assert ends.event_for("a", 16) == "event-0" and ends.event_for("a", 12) == "event-0"
    assert ends.event_for("a", 32) == "event-1" and ends.event_for("a", 33) is None  # not computed yet: the stream
    assert ends.event_for("b", 4) == "event-0" and ends.event_for("nobody", 1) is None
    ends.record(step(finished=["a"]))
    assert ends.event_for("a", 16) is None and ends.event_for("b", 4) == "event-0"
    for k in range(KEEP + 1):  # the oldest are forgotten: a later event of the sequence is as safe
        ends.record(step(("d", 8 * k, 8, False)))
    assert ends.event_for("d", 8) == ends.event_for("d", 16) == "event-3"
