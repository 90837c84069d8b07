"""The scheduler's plain-decode columns (`SchedulerOutput.plain_decodes`) and the step encoding that reads
them: driven by the real scheduler through admissions, prefix-cache hits, preemptions (which may come back
with a cached prefix one token short of their length, so they look like a decode), aborts, finishes,
speculative lookahead with trims, token history and steps planned ahead with placeholders, every step the
ranks rebuild is the driver's, field for field. Steps whose columns are dropped or do not continue the step
sent last take the tested path and still rebuild exactly."""
from __future__ import annotations

import pickle
import random

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from workers.config import SchedulerConfig
from workers.sampling_params import SamplingParams
from workers.scheduler_output import (PLACEHOLDER_TOKEN, ModelRunnerOutput, SampledToken, ScheduledSeq,
                                      SchedulerOutput, fill_placeholders, num_placeholders, placeholder_seqs)
from workers.step_delta import StepDecoder, StepEncoder, decode_own, tokens_by_row


def _fields(s: ScheduledSeq) -> tuple:
    """What the ranks must rebuild (`num_lookahead` is the driver's own)."""
    return (s.seq_id, s.token_ids, s.start_pos, s.block_table, s.sample, s.sampling_params, s.num_output_tokens,
            s.prompt_token_ids, s.output_token_ids, s.spec_token_ids)


class _Sim:
    """One engine's scheduler, driven like LLMEngine.step, with fake tokens; the ranks' side beside it."""

    def __init__(self, seed: int, num_blocks: int = 40):
        self.rng = random.Random(seed)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=48),
                               BlockManager(num_blocks, 4, enable_prefix_caching=True))
        self.encoder, self.decoder = StepEncoder(), StepDecoder()
        # A replica of one rank, which fills a step sent ahead from its own answer (cluster/rank_worker.py):
        # it decodes each step when it runs it.
        self.own, self.own_tokens, self.payloads, self.last_result = StepDecoder(), None, {}, None
        self.n = 0
        self.prefixes = [[self.rng.randrange(50) for _ in range(9)] for _ in range(3)]
        self.kinds: dict[str, int] = {"rows": 0, "same": 0, "checked": 0, "placeholders": 0, "grown": 0, "by_row": 0}

    def admit(self) -> None:
        rng = self.rng
        self.n += 1
        prompt = rng.choice(self.prefixes)[:rng.randrange(3, 10)] + [rng.randrange(50) for _ in range(rng.randrange(0, 4))]
        params = SamplingParams(max_tokens=rng.randrange(2, 30), temperature=rng.choice([0.0, 0.7]), seed=self.n,
                                repetition_penalty=rng.choice([1.0, 1.0, 1.0, 1.0, 1.3]))
        self.sched.add(Sequence(f"s{self.n}", prompt, params))

    def send(self, out: SchedulerOutput) -> SchedulerOutput:
        """Encode (sometimes with the columns dropped or made stale), decode on the 'rank', compare."""
        plan = out.plain_decodes
        if plan is not None and self.rng.random() < 0.05:
            out.plain_decodes = None if self.rng.random() < 0.5 else type(plan)(plan.step, plan.after - 1, plan.rows,
                                                                                plan.others, plan.tokens, plan.grown)
        payload = self.encoder.encode(out)
        out.plain_decodes = plan
        self.payloads[id(out)] = payload
        got = self.decoder.decode(payload)
        assert [_fields(s) for s in got.seqs] == [_fields(s) for s in out.seqs]
        assert got.finished_seq_ids == out.finished_seq_ids
        assert num_placeholders(out) == len(placeholder_seqs(out.seqs))
        # The answer's order, handed on from step to step on both sides while the sequences stay the same.
        sampled = [s.seq_id for s in out.seqs if s.sample]
        assert out.sample_seq_ids() == sampled and got.sample_seq_ids() == sampled
        compact = pickle.loads(payload)[5]
        if compact is not None:
            kind = "checked" if compact[0] is not None else "same" if compact[1] is None else "rows"
            self.kinds[kind] += 1
            self.kinds["grown"] += bool(compact[3])
        return got

    def own_run(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """The one rank runs `out`: its placeholders come from its last answer (cluster/rank_worker.py), by row
        where the decoder can. Its answer is the same tokens as the driver's, as a runner's columns: in step
        order, or now and then in another (an eager runner puts decodes first), which cannot go by row."""
        last = self.last_result
        holders = placeholder_seqs(out.seqs)
        payload = self.payloads.pop(id(out))
        got = decode_own(self.own, payload, last, self.own_tokens) if holders else self.own.decode(payload)
        waiting = {id(s) for s in holders}
        expected = [_fields(s) if id(s) not in waiting else
                    (s.seq_id, [*s.token_ids[:-1], last.token_ids_by_seq()[s.seq_id]], *_fields(s)[2:]) for s in out.seqs]
        assert [_fields(s) for s in got.seqs] == expected
        self.kinds["by_row"] += bool(holders) and not placeholder_seqs(self.own.unfilled) and len(self.own.unfilled) < len(got.seqs)
        if result.spec:
            self.last_result, self.own_tokens = result, None
            return
        ids = [s.seq_id for s in got.seqs if s.sample]
        if self.rng.random() < 0.1:
            ids.reverse()
        answer = ModelRunnerOutput.from_columns(ids, [result.sampled[i].token_id for i in ids], [-0.1] * len(ids))
        self.last_result, self.own_tokens = answer, tokens_by_row(answer, got)

    def result(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Tokens for the step's sampled sequences; a speculating one keeps some of its drafts."""
        rng = self.rng
        sampled, spec = {}, {}
        for s in out.seqs:
            if not s.sample:
                continue
            if s.spec_token_ids:
                kept = s.spec_token_ids[:rng.randrange(len(s.spec_token_ids) + 1)]
                spec[s.seq_id] = [SampledToken(t, -0.1) for t in [*kept, rng.randrange(50)]]
                sampled[s.seq_id] = spec[s.seq_id][0]
            else:
                sampled[s.seq_id] = SampledToken(rng.randrange(50), -0.1)
        return ModelRunnerOutput(sampled, spec)

    def collect(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """The engine's update and checks: finished sequences (length, a random stop) are freed or parked."""
        sched = self.sched
        sched.step_done()
        for seq in sched.update(out, result):
            for j, t in enumerate(result.spec.get(seq.seq_id) or [result.sampled[seq.seq_id]]):
                if j:
                    sched.accept(seq, t.token_id)
                if seq.num_output_tokens >= seq.sampling_params.max_tokens or self.rng.random() < 0.03:
                    sched.finish(seq, "stop")
                    break
        sched.blocks.check_invariants()

    def submit(self, ahead_of: SchedulerOutput | None = None) -> tuple[SchedulerOutput, SchedulerOutput] | None:
        sched, rng = self.sched, self.rng
        if ahead_of is not None:
            out = sched.schedule(ahead_of=ahead_of, will_finish=lambda q: q.num_output_tokens + 1 >= q.sampling_params.max_tokens)
        else:
            speculate = rng.random() < 0.2
            out = sched.schedule(lambda q: rng.choice([0, 2, 3]) if speculate else 0)
            for s in out.seqs:  # what a proposer does with the reserved slots (engine/spec_decode.py)
                if s.num_lookahead:
                    s.spec_token_ids = [rng.randrange(50) for _ in range(rng.randrange(s.num_lookahead + 1))]
                    s.token_ids = s.token_ids + s.spec_token_ids
        if out is None or out.is_empty:
            if out is not None and out.finished_seq_ids:
                sched.requeue_dropped(out.finished_seq_ids)
            return None
        got = self.send(out)
        sched.step_sent()
        return out, got

    def run(self, steps: int) -> None:
        sched, rng = self.sched, self.rng
        inflight = None
        for _ in range(steps):
            while rng.random() < 0.35:
                self.admit()
            if rng.random() < 0.02 and sched.running:
                sched.abort(rng.choice(sched.running).seq_id)
            if inflight is None:
                inflight = self.submit()
                if inflight is None:
                    continue
            out, got = inflight
            inflight = None
            can_ahead = (rng.random() < 0.7 and not any(s.spec_token_ids for s in out.seqs)
                         and not any(s.sample and s.sampling_params.needs_token_history for s in out.seqs))
            ahead = self.submit(ahead_of=out) if can_ahead else None
            result = self.result(out)
            self.own_run(out, result)
            if ahead is not None:  # the rank fills the step sent ahead with the tokens just sampled
                holders = placeholder_seqs(ahead[1].seqs)
                self.kinds["placeholders"] += bool(holders)
                assert all(s.token_ids[-1] == PLACEHOLDER_TOKEN for s in holders)
                fill_placeholders(ahead[1].seqs, [result.sampled[s.seq_id].token_id for s in placeholder_seqs(ahead[0].seqs)])
            self.collect(out, result)
            inflight = ahead


def test_the_scheduler_columns_rebuild_every_step_exactly():
    for seed in range(6):
        sim = _Sim(seed)
        sim.run(700)
        assert sim.sched.num_preemptions > 0
        assert min(sim.kinds.values()) > 0, sim.kinds


def test_a_steady_decode_step_from_the_scheduler_is_its_tokens_and_reads_no_sequence():
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096), BlockManager(4000, 16))
    for i in range(64):
        sched.add(Sequence(f"r{i}", list(range(i, i + 30 + i)), SamplingParams(max_tokens=500)))
    encoder, decoder = StepEncoder(), StepDecoder()
    for step in range(40):
        out = sched.schedule()
        plan = out.plain_decodes
        if step >= 2:  # the first step prefills, the second is every sequence's first decode after it
            assert plan.rows is None and plan.others == [] and len(plan.tokens) == 64

            class Unread(ScheduledSeq):  # the encoder must not read a plain decode's fields
                def __getattribute__(self, name):
                    raise AssertionError(f"the encoder read {name}")
            real = out.seqs
            out.seqs = [Unread.__new__(Unread) for _ in real]
            for _, i, _ in plan.grown:
                out.seqs[i] = real[i]  # a grown table's length is read
            payload = encoder.encode(out)
            out.seqs = real
            _, forget, new, known, spec, compact, _ = pickle.loads(payload)
            assert not (forget or new or known or spec) and compact[:2] == (None, None)
        else:
            payload = encoder.encode(out)
        assert decoder.decode(payload) == out
        ids = [s.seq_id for s in out.seqs if s.sample]
        sched.update(out, ModelRunnerOutput.from_columns(ids, [step % 50] * len(ids), [-0.5] * len(ids)))


def test_a_sequence_preempted_in_an_empty_step_is_never_taken_for_a_continuation():
    """X decodes, is preempted in a step that ends up empty (so the last step with sequences is still the
    one where X was a plain decode), and comes back from the prefix cache one token short of its length:
    it looks like a plain decode one position on, but the ranks forgot it, so it must go whole."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(4, 4))
    encoder, decoder = StepEncoder(), StepDecoder()

    def run(out: SchedulerOutput) -> None:
        assert decoder.decode(encoder.encode(out)) == out
        ids = [s.seq_id for s in out.seqs if s.sample]
        sched.update(out, ModelRunnerOutput.from_columns(ids, [3] * len(ids), [-0.5] * len(ids)))

    x = Sequence("x", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=50))
    sched.add(x)
    run(sched.schedule())  # the prompt: two blocks, then 8 tokens
    run(sched.schedule())  # its first decode (position 7): a plain decode from now on
    assert sched.reserve(Sequence("z", [9] * 7, SamplingParams(max_tokens=2)), deadline=1e18)  # the other two blocks
    empty = sched.schedule()  # x needs a third block: preempted, and nothing is left to run
    assert empty.is_empty and empty.finished_seq_ids == ["x"]
    sched.requeue_dropped(empty.finished_seq_ids)
    sched.cancel_reservation("z")
    back = sched.schedule()
    assert [(s.seq_id, s.start_pos, s.num_tokens) for s in back.seqs] == [("x", 8, 1)]  # two blocks from the cache
    assert back.plain_decodes.others == [0] and back.finished_seq_ids == ["x"]
    run(back)
    for _ in range(10):  # and on: its table grows, it goes compact again
        run(sched.schedule())


def test_a_table_trimmed_after_a_later_step_was_made_is_sent_again():
    """A lookahead step's table is trimmed when its tokens come back (Scheduler.update), which may be after the
    next step was planned ahead of it with the longer table: the block given back is taken by someone else, the
    table regrows with another id at the same length, and the sequence must not be taken for a continuation.
    (The engine never plans ahead of a lookahead step; the scheduler's note does not rely on that.)"""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(16, 4))
    encoder, decoder = StepEncoder(), StepDecoder()

    def send(out: SchedulerOutput) -> None:
        assert [_fields(s) for s in decoder.decode(encoder.encode(out)).seqs] == [_fields(s) for s in out.seqs]

    def answer(out: SchedulerOutput) -> ModelRunnerOutput:
        ids = [s.seq_id for s in out.seqs if s.sample]
        return ModelRunnerOutput.from_columns(ids, [3] * len(ids), [-0.5] * len(ids))

    sched.add(Sequence("x", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=50)))
    prefill = sched.schedule()
    send(prefill)
    sched.update(prefill, answer(prefill))
    lookahead = sched.schedule(lambda seq: 2)  # position 6 and two draft slots: a third block (none proposed)
    send(lookahead)
    ahead = sched.schedule(ahead_of=lookahead)  # position 7, with the three blocks
    send(ahead)
    table = list(ahead.seqs[0].block_table)
    sched.update(lookahead, answer(lookahead))  # the third block goes back
    assert sched.reserve(Sequence("z", [9, 9, 9], SamplingParams(max_tokens=2)), deadline=1e18)  # and is taken
    after = sched.schedule(ahead_of=ahead)  # position 8: a third block again, another one
    assert len(after.seqs[0].block_table) == len(table) and after.seqs[0].block_table[-1] != table[-1]
    assert after.plain_decodes.others == [0]
    send(after)
