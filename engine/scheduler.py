"""Iteration-level scheduling: which tokens of which sequences run in the next step.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first, most important
first (priority, then arrival): a decode takes one token, an unfinished prefill takes the next chunk
that fits. Waiting sequences are admitted with what budget is left, after reusing their cached
prefix. When blocks run out, the least important running sequence is preempted (its blocks freed,
to be recomputed later), and nothing new is admitted in that step.
"""
from __future__ import annotations

import bisect
import itertools
import time
from operator import itemgetter
from collections import deque
from typing import Callable

from workers.config import SchedulerConfig
from engine.block_manager import BlockManager
from workers.scheduler_output import PLACEHOLDER_TOKEN, ModelRunnerOutput, PlainDecodes, ScheduledSeq, SchedulerOutput
from engine.sequence import SeqStatus, Sequence

# Step numbers for `PlainDecodes`, unique in the process, so that no two schedulers' steps are ever taken
# for each other by an encoder.
_step_numbers = itertools.count()
_NOTHING_PENDING = (0, 0)  # (tokens computed, tokens gained) by a step still out, for a sequence not in it


class QueueFullError(RuntimeError):
    """Admission refused: too many requests, too many prompt blocks, or requests waiting too long (or
    predicted to), ahead of this one (`max_waiting_requests`, `max_waiting_kv_ratio`, `max_queue_delay_s`):
    the caller should back off and retry, after about `retry_after_s` (None: no estimate)."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s  # kept by pickling (in __dict__): it crosses Ray to the front end


class DrainRate:
    """How fast the waiting queue drains while it is backlogged: admissions per second of backlogged time
    over the last `window_s` seconds. Time with nothing left waiting is left out, since admissions then
    follow the arrivals, not the engine's capacity to start requests (a lightly loaded server would look
    slow). Unknown (None) until the queue has been backlogged `min_backlog_s` in the window and at least
    one request left it: a queue that is stuck is caught by `max_queue_delay_s`'s staleness check."""

    def __init__(self, window_s: float = 10.0, min_backlog_s: float = 1.0):
        self.window_s, self.min_backlog_s = window_s, min_backlog_s
        self._intervals: deque[tuple[float, float, int]] = deque()  # (end, backlogged seconds, admitted)
        self._backlog_s, self._admitted = 0.0, 0
        self._since: float | None = None  # when the last schedule() left requests waiting

    def observe(self, now: float, admitted: int, still_waiting: bool) -> None:
        """One schedule() at `now`: it admitted `admitted`; requests are `still_waiting` after it."""
        if self._since is not None:
            self._intervals.append((now, now - self._since, admitted))
            self._backlog_s += now - self._since
            self._admitted += admitted
        self._since = now if still_waiting else None
        self._expire(now)

    def rate(self, now: float) -> float | None:
        self._expire(now)
        if self._backlog_s < self.min_backlog_s or self._admitted == 0:
            return None
        return self._admitted / self._backlog_s

    def _expire(self, now: float) -> None:
        while self._intervals and self._intervals[0][0] < now - self.window_s:
            _, seconds, admitted = self._intervals.popleft()
            self._backlog_s -= seconds
            self._admitted -= admitted


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, num_groups: int = 1):
        self.config = config
        self.blocks = block_manager
        # Pipelined steps (EngineConfig.step_groups): the running sequences form `num_groups` disjoint groups and a
        # step runs one group (`schedule(group=...)`), so one step per group can be in flight at once. Each group's
        # step has the whole token budget and up to max_num_seqs sequences, as each of vLLM's virtual engines.
        self.num_groups = num_groups
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self._dropped: list[str] = []  # finished/preempted since the last step, for the ranks to forget
        self.num_preemptions = 0
        # Disaggregation: prompts whose KV waits to be sent (prefill side) and blocks reserved for KV
        # that is on its way (decode side). Both expire at a deadline so nothing leaks if the peer vanishes.
        self.held: dict[str, tuple[Sequence, float]] = {}
        self.reserved: dict[str, tuple[Sequence, float]] = {}
        # Steps handed to the executor, and of those, steps whose tokens are back. While one is out, a sequence
        # that finishes may still have its KV written by it: its blocks are parked (`_free`) until that step
        # is collected, so no KV transfer (`reserve`) gets a block a step still writes.
        self.steps_sent = 0
        self.steps_done = 0
        self._parked: list[tuple[int, list[int]]] = []  # (last step that may write them, block ids), in step order
        # When each waiting sequence (re-)entered the queue (time.monotonic()), for `max_queue_delay_s`.
        self._enqueued_at: dict[str, float] = {}
        self.drain = DrainRate()  # how fast the queue drains when backlogged: the predicted queueing delay
        # The last step with sequences that this scheduler made (its number, its size), which the next step's
        # plain decodes continue (`_output`).
        self._last_step, self._last_size = -1, 0

    # ---- requests in and out ----
    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"request id {seq.seq_id!r} is already in use")
        need = self.blocks.blocks_needed(seq.num_tokens + 1)
        if not self.blocks.can_ever_hold(seq.num_tokens + 1):
            raise ValueError(f"request {seq.seq_id}: prompt of {seq.num_tokens} tokens needs {need} KV blocks, "
                             f"the cache has {self.blocks.num_blocks}")
        self._check_admission(seq)
        self.seqs[seq.seq_id] = seq
        self._enqueue(seq)

    def _check_admission(self, seq: Sequence) -> None:
        """Admission control. Only the requests that would be admitted before `seq` count (same or more
        important priority; the queue is sorted that way), so a more important request still gets in
        while less important ones are refused, and its wait is what is bounded (`_refusal`). A refusal
        carries an estimate of when a retry could get in: the time the queue ahead takes to drain."""
        ahead = self.waiting[:bisect.bisect_right(self.waiting, (seq.priority, float("inf")), key=lambda s: s.sort_key)]
        if not ahead:
            return  # nothing waits before it: it starts as soon as the batch has room, whatever the bounds
        now = time.monotonic()
        rate = self.drain.rate(now)
        why = self._refusal(seq, ahead, rate, now)
        if why is not None:
            raise QueueFullError(f"request {seq.seq_id}: {why}", retry_after_s=self._drain_estimate(ahead, rate, now))

    def _drain_estimate(self, ahead: list[Sequence], rate: float | None, now: float) -> float | None:
        """Seconds until the requests ahead have started: at the measured rate, len/rate. Unmeasured, a
        queue whose oldest request has waited past the target delay has moved no faster than that wait;
        otherwise there is no evidence it is slow (None: the front end's minimum)."""
        if rate is not None:
            return len(ahead) / rate
        oldest_wait = now - min(self._enqueued_at.get(s.seq_id, now) for s in ahead)
        max_delay = self.config.max_queue_delay_s
        return oldest_wait if max_delay is not None and oldest_wait >= max_delay else None

    def _refusal(self, seq: Sequence, ahead: list[Sequence], rate: float | None, now: float) -> str | None:
        """Why `seq` cannot wait behind `ahead`, or None. The queue is sized by KV capacity (the prompts
        waiting, with its own, may need at most `max_waiting_kv_ratio` of the cache: more cannot start
        before the running batch has turned over that much) and by the target delay `max_queue_delay_s`:
        refused when a request ahead has already waited that long, or when the queue ahead, at the rate it
        recently drained, would take longer than that to start. `max_waiting_requests` is a hard ceiling."""
        cfg = self.config
        if cfg.max_waiting_requests is not None and len(ahead) >= cfg.max_waiting_requests:
            return f"{len(ahead)} requests already waiting ahead of it (max_waiting_requests={cfg.max_waiting_requests})"
        if cfg.max_waiting_kv_ratio is not None:
            need = sum(self.blocks.blocks_needed(s.num_tokens + 1) for s in (*ahead, seq))
            if need > cfg.max_waiting_kv_ratio * self.blocks.num_blocks:
                return (f"its prompt and the {len(ahead)} waiting ahead of it need {need} KV blocks, more than "
                        f"{cfg.max_waiting_kv_ratio:g} x the cache's {self.blocks.num_blocks} (max_waiting_kv_ratio)")
        max_delay = cfg.max_queue_delay_s
        if max_delay is None:
            return None
        waited = now - min(self._enqueued_at.get(s.seq_id, now) for s in ahead)
        if waited >= max_delay:
            return (f"requests ahead of it have waited {waited:.1f}s for admission "
                    f"(max_queue_delay_s={max_delay:g})")
        if rate is not None and len(ahead) / rate > max_delay:
            return (f"the {len(ahead)} requests ahead of it need about {len(ahead) / rate:.1f}s to start at the "
                    f"recent {rate:.1f} admissions/s (max_queue_delay_s={max_delay:g})")
        return None

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._enqueued_at[seq.seq_id] = time.monotonic()
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Release everything the sequence holds (finished, stopped, or aborted)."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
            self._enqueued_at.pop(seq.seq_id, None)
        self._free(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        del self.seqs[seq.seq_id]
        self._dropped.append(seq.seq_id)

    def abort(self, seq_id: str) -> Sequence | None:
        seq = self.seqs.get(seq_id)
        if seq is not None:
            self.finish(seq, "abort")
            return seq
        self.release(seq_id)
        self.cancel_reservation(seq_id)
        return None

    # ---- disaggregation: prefill side ----
    def hold(self, seq: Sequence, reason: str, deadline: float) -> None:
        """Finish the sequence here but keep its blocks until `release` (or the deadline)."""
        self.running.remove(seq)
        del self.seqs[seq.seq_id]
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        seq.plain_at = (-1, 0, 0)
        self.held[seq.seq_id] = (seq, deadline)
        self._dropped.append(seq.seq_id)

    def release(self, seq_id: str) -> bool:
        entry = self.held.pop(seq_id, None)
        if entry is not None:
            self._free(entry[0])
        return entry is not None

    # ---- disaggregation: decode side ----
    def reserve(self, seq: Sequence, deadline: float) -> bool:
        """Blocks for the prompt's KV (reusing cached prefix blocks) plus the first decode token.

        False when the cache or the batch is full: the caller backs off (this is the backpressure
        the decode pool puts on prefill)."""
        if seq.seq_id in self.seqs or seq.seq_id in self.reserved:
            raise ValueError(f"request id {seq.seq_id!r} is already in use")
        if len(self.running) + len(self.reserved) >= self.config.max_num_seqs * self.num_groups:
            return False
        self.blocks.match_prefix(seq)
        n = seq.num_tokens + 1 - seq.num_computed_tokens
        if not self.blocks.can_grow(seq, n):
            self.blocks.free_seq(seq)
            return False
        self.blocks.grow(seq, n)
        self.blocks.record_admission(seq)
        self.reserved[seq.seq_id] = (seq, deadline)
        return True

    def activate(self, seq_id: str, first_token: int) -> Sequence:
        """The prompt's KV has arrived: the sequence joins the running batch with its first token."""
        seq, _ = self.reserved.pop(seq_id)
        seq.num_computed_tokens = seq.num_tokens
        self.blocks.cache_full_blocks(seq)
        seq.token_ids.append(first_token)
        seq.status = SeqStatus.RUNNING
        if self.num_groups > 1:
            loads, _ = self._group_loads()
            seq.group = min(range(self.num_groups), key=loads.__getitem__)
        self.seqs[seq_id] = seq
        self.running.append(seq)
        return seq

    def cancel_reservation(self, seq_id: str) -> bool:
        entry = self.reserved.pop(seq_id, None)
        if entry is not None:
            self.blocks.free_seq(entry[0])
        return entry is not None

    def expire(self, now: float) -> list[str]:
        """Free held and reserved blocks whose deadline passed; returns their request ids."""
        gone = [sid for sid, (_, t) in self.held.items() if t <= now] + [sid for sid, (_, t) in self.reserved.items() if t <= now]
        for sid in gone:
            self.release(sid) or self.cancel_reservation(sid)
        return gone

    @property
    def has_work(self) -> bool:
        """Something to schedule, or a step still out whose tokens (and parked blocks) wait to be collected."""
        return bool(self.waiting or self.running) or self.steps_sent > self.steps_done

    # ---- steps out at the ranks ----
    def step_sent(self) -> None:
        self.steps_sent += 1

    def step_done(self) -> None:
        """The oldest step out has answered: blocks parked only for it (or earlier ones) are free again."""
        self.steps_done += 1
        done = 0
        while done < len(self._parked) and self._parked[done][0] <= self.steps_done:
            self.blocks.free_blocks(self._parked[done][1])
            done += 1
        del self._parked[:done]

    def steps_lost(self) -> None:
        """The executor failed: no step out will write anything more, so nothing stays parked."""
        self.steps_done = self.steps_sent
        for _, block_ids in self._parked:
            self.blocks.free_blocks(block_ids)
        self._parked.clear()

    def _free(self, seq: Sequence) -> None:
        """Free a sequence's blocks now, or park them while a step that ran it (and may still write them) is out.
        Only such a step counts: with pipelined steps another group's step is nearly always out, and a preemption
        that only parked its victim's blocks would free nothing for the step being planned."""
        seq.plain_at = (-1, 0, 0)  # whatever table it gets next is not the one the ranks hold
        if self.steps_done < seq.last_step <= self.steps_sent and seq.block_table:
            # Kept in step order (step_done frees from the front); a sequence's last step may be older than others'.
            bisect.insort(self._parked, (seq.last_step, seq.block_table), key=itemgetter(0))
            seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0
        else:
            self.blocks.free_seq(seq)

    def requeue_dropped(self, seq_ids: list[str]) -> None:
        """Finished ids of a step that was planned but not sent: the ranks must still hear of them."""
        self._dropped[:0] = seq_ids

    @property
    def num_parked_blocks(self) -> int:
        return sum(len(ids) for _, ids in self._parked)

    @property
    def has_leases(self) -> bool:
        return bool(self.held or self.reserved)

    # ---- one step ----
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._dropped.append(seq.seq_id)
        self._enqueue(seq)

    def schedule(self, lookahead: Callable[[Sequence], int] | None = None, ahead_of: SchedulerOutput | None = None,
                 will_finish: Callable[[Sequence], bool] | None = None, group: int | None = None) -> SchedulerOutput | None:
        """`lookahead(seq)`: speculative decoding's draft slots for a decoding sequence (engine/spec_decode.py).
        They are KV slots reserved past the sequence's last token; `update` frees the blocks that the
        verification did not fill, so a rejected draft holds no block beyond its step.

        `ahead_of`: a step still out at the ranks, whose tokens are not back (asynchronous scheduling). The
        next step is planned as if it had run: each of its sequences has computed its scheduled tokens and,
        where it samples, gained one token, which the new step carries as `PLACEHOLDER_TOKEN` (the ranks get
        it once it is known: LLMEngine.step). A sampling sequence for which `will_finish(seq)` (its token
        surely ends it: length, handoff) is left out. Returns None, having changed nothing that matters, when
        the plan would have to preempt: the caller waits for the step out and schedules again.

        `group`: with pipelined steps, the group this step runs (its running sequences, and the waiting ones that
        join it: `_admit`); a preemption takes a victim of the same group, whose sequences are in no step out."""
        budget = self.config.max_num_batched_tokens
        planned: list[tuple[Sequence, int, int]] = []
        preempted = False
        self.running.sort(key=lambda s: s.sort_key)
        # most important first; victims come off the end
        queue = list(self.running) if group is None else [s for s in self.running if s.group == group]
        pending = {} if ahead_of is None else {s.seq_id: (s.num_tokens, int(s.sample)) for s in ahead_of.seqs}
        while queue and budget > 0:
            seq = queue.pop(0)
            computed, gained = pending.get(seq.seq_id, (0, 0))
            if gained and will_finish is not None and will_finish(seq):
                continue
            n = min(seq.num_uncomputed_tokens + gained - computed, budget)
            if n <= 0:
                continue
            if computed:  # ahead of a step out: the new tokens start past what that step computes
                if not self.blocks.can_grow(seq, computed + n):
                    return None  # blocks grown for the sequences before it cover tokens they will run anyway
                self.blocks.grow(seq, computed + n)
                planned.append((seq, n, 0))
                budget -= n
                continue
            extra = 0
            if lookahead is not None and seq.num_uncomputed_tokens == 1:
                extra = max(0, min(lookahead(seq), budget - n))
                if extra and not self.blocks.can_grow(seq, n + extra):
                    extra = 0  # drafts are optional: never preempt for them
            while not self.blocks.can_grow(seq, n + extra):
                if ahead_of is not None:
                    return None
                preempted = True
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, n + extra)
                planned.append((seq, n, extra))
                budget -= n + extra
        admitted = 0 if preempted else self._admit(planned, budget, group)
        self.drain.observe(time.monotonic(), admitted, bool(self.waiting))
        dropped, self._dropped = self._dropped, []
        return self._output(planned, pending, dropped)

    def _group_loads(self) -> tuple[list[int], list[int]]:
        """Per group: the tokens (prompt and output so far) of its running sequences, and their count."""
        loads, counts = [0] * self.num_groups, [0] * self.num_groups
        for s in self.running:
            loads[s.group] += s.num_tokens
            counts[s.group] += 1
        return loads, counts

    def _admit(self, planned: list[tuple[Sequence, int, int]], budget: int, group: int | None) -> int:
        """Admit waiting sequences into the step, most important first, while its token budget, max_num_seqs and
        the KV cache allow; returns how many. With groups, each joins the group with the fewest tokens among those
        with room, in queue order (ties to the group scheduled now): one bound for another group is left waiting
        for that group's own step (at most one step later), and the queue goes on past it. So a burst spreads
        evenly, and a lone arrival joins the lighter group: balanced groups keep every stage's share of the
        pipeline even. A sequence keeps its group while it runs; preempted, it joins one again on readmission."""
        limit = self.config.max_num_seqs
        grouped = group is not None
        loads, counts = self._group_loads() if grouped else ([0], [len(self.running)])
        me = group if grouped else 0
        admitted = i = 0
        while i < len(self.waiting) and budget > 0 and counts[me] < limit:
            seq = self.waiting[i]
            if grouped:
                target = min((g for g in range(self.num_groups) if counts[g] < limit),
                             key=lambda g: (loads[g], g != group))
                if target != group:  # its own group's step admits it
                    loads[target] += seq.num_tokens
                    counts[target] += 1
                    i += 1
                    continue
            self.blocks.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.blocks.can_grow(seq, n):
                self.blocks.free_seq(seq)
                break
            self.blocks.grow(seq, n)
            self.waiting.pop(i)
            self._enqueued_at.pop(seq.seq_id, None)
            self.blocks.record_admission(seq)
            seq.status, seq.group = SeqStatus.RUNNING, me
            self.running.append(seq)
            planned.append((seq, n, 0))
            budget -= n
            admitted += 1
            loads[me] += seq.num_tokens
            counts[me] += 1
        return admitted

    def _output(self, planned: list[tuple[Sequence, int, int]], pending: dict[str, tuple[int, int]],
                dropped: list[str]) -> SchedulerOutput:
        """The step's `ScheduledSeq`s, and beside them (`PlainDecodes`) which are plain decodes one position
        on from the last step with sequences, where they were plain decodes too: the scheduler knows it here
        for a tuple per sequence, where the step encoder would read each one's fields. A sequence's note
        (`Sequence.plain_at`) is reset when its blocks go (`_free`, `hold`) or a lookahead's are trimmed
        (`update`), so one whose table changed otherwise than at its end is never taken for a continuation.

        `pending`: what a step still out adds to each of its sequences first (`schedule(ahead_of=...)`): the
        tokens it computes and whether it samples one. The ScheduledSeq is built here, positionally, and not
        in a helper: this loop runs for every sequence of every step.

        With groups (`num_groups > 1`) consecutive steps run different sequences, so no step continues the one
        before: no columns, and the encoder finds the plain decodes by their slots (workers/step_delta.py)."""
        step, after = next(_step_numbers), self._last_step
        columns = self.num_groups == 1
        number = self.steps_sent + 1  # this step's, once sent (LLMEngine._submit sends every step with sequences)
        seqs: list[ScheduledSeq] = []
        rows: list[int] = []
        others: list[int] = []
        tokens: list[int] = []
        grown: list[tuple[int, int, list[int]]] = []
        for seq, n, extra in planned:
            computed, gained = pending.get(seq.seq_id, _NOTHING_PENDING) if pending else _NOTHING_PENDING
            seq.last_step = number
            start = seq.num_computed_tokens + computed
            all_ids = seq.token_ids
            ids = all_ids[start : start + n]
            if len(ids) < n:  # the token the step out samples: the ranks fill it in
                ids.append(PLACEHOLDER_TOKEN)
            params = seq.sampling_params
            sample = start + n == len(all_ids) + gained
            table = list(seq.block_table)
            i = len(seqs)
            if params.needs_token_history:
                seqs.append(ScheduledSeq(seq.seq_id, ids, start, table, sample, params, seq.num_output_tokens + gained,
                                         seq.prompt_token_ids, seq.output_token_ids, [], None, extra))
                others.append(i)
                continue
            seqs.append(ScheduledSeq(seq.seq_id, ids, start, table, sample, params, seq.num_output_tokens + gained,
                                     [], [], [], None, extra))
            # One sampled token and no history: n == 1 with nothing past it (drafts come only with `extra`).
            if n == 1 and sample and not extra and columns:
                last, row, num_blocks = seq.plain_at
                seq.plain_at = (step, i, len(table))
                if last == after and len(table) >= num_blocks:
                    if len(table) > num_blocks:
                        grown.append((len(rows), i, table[num_blocks:]))
                    rows.append(row)
                    tokens.append(ids[0])
                    continue
            others.append(i)
        if not seqs or not columns:
            return SchedulerOutput(seqs=seqs, finished_seq_ids=dropped)
        if not others and len(rows) == self._last_size and rows == list(range(len(rows))):
            rows = None  # the last step's sequences, in its order: the common steady decode step
        self._last_step, self._last_size = step, len(seqs)
        return SchedulerOutput(seqs=seqs, finished_seq_ids=dropped,
                               plain_decodes=PlainDecodes(step, after, rows, others, tokens, grown))

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Sequence]:
        """Advance computed counts, cache full blocks, append sampled tokens. Returns seqs that got a token.

        A speculating sequence appends only its first emitted token here; the engine appends the rest
        with `accept` one by one, checking each (stop tokens, max_tokens) before the next."""
        got_token: list[Sequence] = []
        for s in out.seqs:
            seq = self.seqs.get(s.seq_id)
            if seq is None or seq.status != SeqStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += s.num_tokens - len(s.spec_token_ids)  # drafts count once accepted
            self.blocks.cache_full_blocks(seq)
            sampled = result.sampled.get(s.seq_id)
            if s.sample and sampled is not None:
                seq.token_ids.append(sampled.token_id)
                got_token.append(seq)
            if s.num_lookahead:
                # Blocks past the emitted tokens held only rejected (or unproposed) drafts' slots.
                self.blocks.trim(seq, seq.num_tokens + max(0, len(result.spec.get(s.seq_id, ())) - 1))
                seq.plain_at = (-1, 0, 0)  # a step made before this trim may hold the longer table
        return got_token

    def accept(self, seq: Sequence, token_id: int) -> None:
        """The next token of a verified run: the draft before it is now computed KV, and it is appended."""
        seq.num_computed_tokens += 1
        seq.token_ids.append(token_id)
        self.blocks.cache_full_blocks(seq)
