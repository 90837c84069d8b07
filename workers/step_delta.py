"""What a multi-rank step sends its ranks: only what changed since the last step.

A running sequence's block table only grows, and its sampling parameters never change, so after a
sequence's first step the driver sends its slot (a small int standing for the sequence), its new
tokens, its position and the block ids appended since (usually none). Each rank keeps the sequences it
was sent (`StepDecoder`) and rebuilds the `SchedulerOutput` that `ModelRunner.execute` takes, reusing
each sequence's `ScheduledSeq` from step to step. Sequences in `finished_seq_ids` (finished, aborted
or preempted) are forgotten on both sides before the step's sequences are read, so a preempted
sequence that comes back with a new table is sent whole again.

Most of a decode step's sequences are plain decodes: one new token at the position after the last
step's, one more generated token, the same table or one grown at its end, nothing else. Those go in the
step's compact part, as two lists of ints (and the few new block ids beside), and the rank moves its held
`ScheduledSeq`s on in a tight loop; the step's other sequences go beside them with their index in the step.
The scheduler says which sequences these are (`SchedulerOutput.plain_decodes`, engine/scheduler.py): a
plain decode of the last step that is one again goes as its row in the last step and its token, read from
the scheduler's columns, so the encoder reads no field of it, and a step of the last step's sequences in
the same order is just its tokens. A step without those columns (built by hand, or not continuing the step
sent last) is tested sequence by sequence against what the ranks hold, and its plain decodes go by slot.

The answer goes back the same way: the sampled tokens in the step's order of sequences to sample,
without their ids. The encoded step is tuples of ints and lists (fast to pickle); `StepEncoder`
pickles it once and the same bytes go to every rank.
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from operator import itemgetter

from workers.prompt_logprobs import wants_prompt_logprobs
from workers.sampler import Sampler
from workers.scheduler_output import (PLACEHOLDER_TOKEN, ModelRunnerOutput, PlainDecodes, SampledToken, ScheduledSeq,
                                      SchedulerOutput, fill_placeholders, placeholder_seqs)


@dataclass(slots=True)
class _Sent:
    slot: int
    num_blocks: int  # block ids the ranks hold for this sequence
    first_block: int  # a cheap check that the table was not rebuilt without a finish in between
    # The last block id the ranks hold: speculative decoding frees a table's tail blocks after a rejection
    # (BlockManager.trim) and may regrow it with other ids, which the ranks must not miss.
    last_block: int = -1
    # What the ranks' copy of the sequence says: its start position, that minus its tokens generated so far
    # (a decode step moves both on by one), and whether it is a plain decode (one token, sampled, no token
    # history or drafts). A plain decode whose next step is one more at the next position is sent compact.
    start_pos: int = -1
    context_minus_out: int = 0
    plain: bool = False


class StepEncoder:
    """Driver side: remembers what the ranks hold; one per executor."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}
        self._free_slots: list[int] = []
        self._num_slots = 0
        # The slots of the last step, in its order, when every one of its sequences was compact and found by
        # its slot (else None): a step of the same sequences, all compact again, sends only its tokens.
        self._last_slots: list[int] | None = None
        # The scheduler's number of the last step sent (`PlainDecodes.step`; None: it had none): the next
        # step's columns are used only if they continue that step.
        self._last_step: int | None = None
        self._sample_ids: list[str] | None = None  # the last step's `SchedulerOutput.sample_ids`

    def _slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._num_slots += 1
        return self._num_slots - 1

    def encode(self, out: SchedulerOutput) -> bytes:
        forget = []
        for seq_id in out.finished_seq_ids:
            sent = self._sent.pop(seq_id, None)
            if sent is not None:
                forget.append(sent.slot)
                self._free_slots.append(sent.slot)
        plan = out.plain_decodes
        if plan is not None and plan.after == self._last_step:
            new, known, spec, compact = self._encode_planned(out, plan, forget)
        else:
            new, known, spec, compact = self._encode_checked(out, forget)
        self._last_step = None if plan is None else plan.step
        # The ids of the sampled sequences, which the answer comes back in the order of (`unpack_output`): the
        # last step's while the sequences are the same (then all plain decodes), else made now, so that a
        # step sent before the last one is unpacked (asynchronous scheduling) still finds them here.
        if compact is not None and compact[0] is None and compact[1] is None and self._sample_ids is not None:
            out.sample_ids = self._sample_ids
        else:
            self._sample_ids = out.sample_seq_ids()
        # The grammar bitmask (structured output) is per step: sent whole when there is one.
        return pickle.dumps((out.finished_seq_ids, forget, new, known, spec, compact, out.token_bitmask),
                            protocol=pickle.HIGHEST_PROTOCOL)

    def _encode_planned(self, out: SchedulerOutput, plan: PlainDecodes, forget: list[int]) -> tuple:
        """A step whose plain decodes the scheduler named (`PlainDecodes`), continuing the step sent last:
        they go as their rows in that step and their tokens, read from its columns, not from each sequence.
        Their `_Sent` records keep only the table's length (the general path slices from it); their
        positions go stale, which can only fail `_encode_checked`'s test (a held sequence's position never
        goes back), so a later step without columns sends such a sequence whole, never wrongly compact."""
        seqs, sent_of = out.seqs, self._sent
        grow = []
        for k, i, appended in plan.grown:
            sent = sent_of[seqs[i].seq_id]
            sent.num_blocks, sent.last_block = len(seqs[i].block_table), appended[-1]
            grow.append((k, appended))
        new, known, spec = [], [], []
        for i in plan.others:
            self._general(seqs[i], i, new, known, spec, forget)
        self._last_slots = None  # the ranks find these by row, not slot
        return new, known, spec, ((None, plan.rows, plan.tokens, grow) if plan.tokens else None)

    def _encode_checked(self, out: SchedulerOutput, forget: list[int]) -> tuple:
        """A step without usable columns (hand-built, or not continuing the step sent last): each sequence
        is tested against what the ranks hold, and the plain decodes among them go as slots and tokens."""
        sent_of = self._sent
        new, known, spec = [], [], []
        # The compact part: sequences the ranks hold as a plain decode that decode one more token at the next
        # position with the same table, or one grown at its end (`grow`: (index in the compact part, new ids)).
        slots, tokens, grow = [], [], []
        add_slot, add_token, get = slots.append, tokens.append, sent_of.get
        for i, s in enumerate(out.seqs):
            sent = get(s.seq_id)
            if sent is not None and sent.plain:
                table = s.block_table
                start = s.start_pos
                toks = s.token_ids
                nb = sent.num_blocks
                # Cheapest tests first; a plain decode passes all of them.
                if (start == sent.start_pos + 1 and len(toks) == 1 and len(table) >= nb
                        and table[nb - 1] == sent.last_block and table[0] == sent.first_block
                        and start - s.num_output_tokens == sent.context_minus_out and s.sample
                        and not (s.spec_token_ids or s.prompt_token_ids or s.output_token_ids)):
                    if len(table) > nb:
                        grow.append((len(slots), table[nb:]))
                        sent.num_blocks, sent.last_block = len(table), table[-1]
                    add_slot(sent.slot)
                    add_token(toks[0])
                    sent.start_pos = start
                    continue
            self._general(s, i, new, known, spec, forget)
        if new or known or not slots:
            compact = (slots, None, tokens, grow) if slots else None
            self._last_slots = None
        else:  # every sequence compact: the slots only where they changed (None: the last step's sequences)
            compact = (None if slots == self._last_slots else slots, None, tokens, grow)
            self._last_slots = slots
        return new, known, spec, compact

    def _general(self, s: ScheduledSeq, i: int, new: list, known: list, spec: list, forget: list[int]) -> None:
        """Step index `i` goes as a new sequence (whole) or a known one (its fields, its table's new ids)."""
        sent_of = self._sent
        sent = sent_of.get(s.seq_id)
        table = s.block_table
        if sent is not None and (len(table) < sent.num_blocks or (table and table[0] != sent.first_block)
                                 or (sent.num_blocks and table[sent.num_blocks - 1] != sent.last_block)):
            forget.append(sent.slot)  # rebuilt without a finish in between: resend it whole
            self._free_slots.append(sent.slot)
            del sent_of[s.seq_id]
            sent = None
        if sent is None:
            sent = sent_of[s.seq_id] = _Sent(self._slot(), len(table), table[0] if table else -1,
                                             table[-1] if table else -1)
            new.append((i, sent.slot, s.seq_id, s.token_ids, s.start_pos, table, s.sample, s.num_output_tokens,
                        s.prompt_token_ids, s.output_token_ids, s.sampling_params))
        else:
            known.append((i, sent.slot, s.token_ids, s.start_pos, table[sent.num_blocks:] if len(table) > sent.num_blocks
                          else None, s.sample, s.num_output_tokens, s.prompt_token_ids or None,
                          s.output_token_ids or None))
            sent.num_blocks, sent.last_block = len(table), (table[-1] if table else -1)
        sent.start_pos, sent.context_minus_out = s.start_pos, s.start_pos - s.num_output_tokens
        sent.plain = (len(s.token_ids) == 1 and s.sample and bool(table) and not s.spec_token_ids
                      and not s.prompt_token_ids and not s.output_token_ids)
        if s.spec_token_ids:
            # Speculative decoding's drafts (and a draft model's q, on the host) are per step: (index, ...).
            spec.append((i, s.spec_token_ids, None if s.spec_probs is None else s.spec_probs.cpu()))


class StepDecoder:
    """Rank side: the sequences sent so far, by slot; rebuilds each step's SchedulerOutput."""

    def __init__(self) -> None:
        self._held: dict[int, ScheduledSeq] = {}
        self._last_seqs: list[ScheduledSeq] | None = None  # the last step's, in its order
        self._last_out: SchedulerOutput | None = None
        self._drafted: list[ScheduledSeq] = []  # the last step's sequences with drafts
        # The last step's sequences that may still hold a placeholder token (`decode`'s `last_tokens`).
        self.unfilled: list[ScheduledSeq] = []
        # Whether the last step decoded without `last_tokens` is the step before's plain decodes only, each waiting
        # for its token from there (`continue_rows`: their rows in that step; None: all of them, in its order).
        self.continues = False
        self.continue_rows: list[int] | None = None

    def decode(self, payload: bytes, last_tokens: list[int] | None = None) -> SchedulerOutput:
        """`last_tokens`: the tokens the last step sampled, one per sequence in its order (a replica of one
        rank has them: its own answer). A step sent ahead whose plain decodes all wait for the last step's
        tokens then takes them from here, by row, and only its other sequences are left in `unfilled`."""
        finished_ids, forget, new, known, spec, compact, token_bitmask = pickle.loads(payload)
        held = self._held
        for slot in forget:
            held.pop(slot, None)
        for seq in self._drafted:  # a held sequence's drafts were last step's
            seq.spec_token_ids, seq.spec_probs = [], None
        filled = self.continues = False
        if compact is None:
            seqs = []
        else:
            slots, rows, tokens, grow = compact
            if slots is None and tokens.count(PLACEHOLDER_TOKEN) == len(tokens):
                if last_tokens is not None:
                    tokens, filled = continued_tokens(last_tokens, rows), True
                elif not (new or known):
                    self.continues, self.continue_rows = True, rows
            seqs = self._move_on(slots, rows, tokens, grow)
        placed = self._place(seqs, new, known) if new or known else []
        self.unfilled = placed if filled else seqs
        self._last_seqs = seqs
        drafted = self._drafted = []
        for i, drafts, probs in spec:
            seq = seqs[i]
            seq.spec_token_ids, seq.spec_probs = drafts, probs
            drafted.append(seq)
        out = SchedulerOutput(seqs=seqs, finished_seq_ids=finished_ids, token_bitmask=token_bitmask)
        if compact is not None and compact[0] is None and compact[1] is None and not (new or known):
            # The last step's sequences again, all plain decodes: the same sampled ids (once `pack_output` made them).
            out.sample_ids = self._last_out.sample_ids
        self._last_out = out
        return out

    def _move_on(self, slots: list[int] | None, rows: list[int] | None, tokens: list[int],
                 grow: list[tuple[int, list[int]]]) -> list[ScheduledSeq]:
        """The step's plain decodes, in step order, each moved one position on: found by slot, or by row in
        the last step (`rows`; neither: the last step's sequences, in its order)."""
        if slots is not None:
            held = self._held
            seqs = [held[slot] for slot in slots]
        else:
            last = self._last_seqs
            if last is None:
                raise RuntimeError("a step continues the last step's sequences, but there was no last step")
            seqs = last.copy() if rows is None else [last[j] for j in rows]
        # The held ScheduledSeqs themselves, updated: the rank runs each step to the end before it decodes the
        # next one. A plain decode holds one token, in a list of its own (unpickled here, or made by a fill):
        # replaced in place, with no new list.
        for seq, token in zip(seqs, tokens):
            seq.token_ids[0] = token
            seq.start_pos += 1
            seq.num_output_tokens += 1
        for k, appended in grow:
            seqs[k].block_table.extend(appended)
        return seqs

    def _place(self, seqs: list[ScheduledSeq], new: list[tuple], known: list[tuple]) -> list[ScheduledSeq]:
        """Put the step's other sequences at their indices among the plain decodes (and return them). Inserted
        in ascending order of index, each lands where it belongs (the ones before it are all in place)."""
        held = self._held
        placed = []
        for i, slot, seq_id, tokens, start, table, sample, n_out, prompt, output, params in new:
            seq = held[slot] = ScheduledSeq(seq_id, tokens, start, list(table), sample, params, n_out, prompt, output)
            placed.append((i, seq))
        for i, slot, tokens, start, appended, sample, n_out, prompt, output in known:
            seq = held[slot]
            seq.token_ids, seq.start_pos, seq.sample, seq.num_output_tokens = tokens, start, sample, n_out
            if appended:
                seq.block_table.extend(appended)
            seq.prompt_token_ids, seq.output_token_ids = prompt or [], output or []
            placed.append((i, seq))
        placed.sort(key=itemgetter(0))
        for i, seq in placed:
            seqs.insert(i, seq)
        return [seq for _, seq in placed]

    @property
    def num_held(self) -> int:
        return len(self._held)


def tokens_by_row(result: ModelRunnerOutput, out: SchedulerOutput) -> list[int] | None:
    """The step's sampled tokens, one per sequence in step order, where the answer's columns are exactly
    that (every sequence sampled: a decode step's); else None. The comparison of ids is one pass over two
    lists of the same strings, and the step's ids are made once for `pack_output` too."""
    columns = result.columns
    if columns is None or result.spec or len(columns[0]) != len(out.seqs) or columns[0] != out.sample_seq_ids():
        return None
    return columns[1]


# TANDEM_TP_OWN_FILL=0: every rank of a TP-only replica waits for the driver's fill after a plain greedy step, as
# before own fills (the A/B switch for a GPU run; default on). Read by the driver and, forwarded, by the ranks.
OWN_FILL_ENV = "TANDEM_TP_OWN_FILL"


def tp_own_fill_enabled(environ: dict[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(OWN_FILL_ENV, "1").strip() != "0"


def sampled_on_every_tp_rank(out: SchedulerOutput) -> bool:
    """Whether each TP rank of a TP-only replica learns this step's tokens itself (`ModelRunner.sample` takes the
    all-gathered greedy path, `ParallelLMHead.greedy_tokens(everywhere=True)`): every sampled sequence plain greedy
    (`Sampler.is_plain_greedy`), no grammar, no drafts, no prompt logprobs (those stay on the output rank's
    answer and keep the fill path). The rank checks for itself too: told wrongly, it fails (`decode_own`)."""
    if out.token_bitmask is not None:
        return False
    greedy = Sampler.is_plain_greedy
    for s in out.seqs:  # on the driver's path every step (~80 us for 256 sequences here): the cheap tests first
        if s.spec_token_ids:
            return False
        if s.sample:
            if not greedy(s):  # which also refuses prompt logprobs (`SamplingParams.needs_token_history`)
                return False
        elif s.sampling_params.prompt_logprobs is not None and wants_prompt_logprobs(s):  # a prefill chunk's
            return False
    return True


def continued_tokens(last_tokens: list[int], rows: list[int] | None) -> list[int]:
    """The input tokens of a step that continues the last one's plain decodes: the last step's tokens, all of them in
    order (`rows` None) or those of the rows it keeps."""
    return last_tokens if rows is None else [last_tokens[j] for j in rows]


def decode_own(decoder: StepDecoder, payload: bytes, last: ModelRunnerOutput | None,
               last_tokens: list[int] | None, who: str = "the rank") -> SchedulerOutput:
    """A step sent ahead to a rank that holds the tokens the step before sampled (the only rank of its replica,
    or any TP rank of a TP-only replica after an all-greedy step), its placeholders filled from its own result
    of that step (`last`; `last_tokens`: `tokens_by_row` of it): the plain decodes by row in the decoder, the few
    others by id. A token it lacks is an error, never a guess: the driver's `own` and the rank's sampling disagree."""
    out = decoder.decode(payload, last_tokens)
    _fill_by_id(decoder, last, who)
    return out


def fill_own(decoder: StepDecoder, last: ModelRunnerOutput | None, last_tokens: list[int] | None,
             who: str = "the rank") -> None:
    """The placeholders of a step decoded before the step before had answered (`StepDecoder.decode` without
    tokens, on a rank that launched that step: cluster/rank_worker.py), filled from this rank's own result of it,
    as `decode_own` fills them: a continuation by row, anything else by id."""
    if decoder.continues and last_tokens is not None:
        for seq, token in zip(decoder.unfilled, continued_tokens(last_tokens, decoder.continue_rows)):
            seq.token_ids[0] = token
        decoder.unfilled = []
        return
    _fill_by_id(decoder, last, who)


def _fill_by_id(decoder: StepDecoder, last: ModelRunnerOutput | None, who: str) -> None:
    holders = placeholder_seqs(decoder.unfilled)
    if holders:
        sampled = {} if last is None else last.token_ids_by_seq()
        missing = [s.seq_id for s in holders if s.seq_id not in sampled]
        if missing:
            raise RuntimeError(f"{who} was told to fill a step sent ahead from its own tokens, but lacks the step "
                               f"before's token of {len(missing)} of its {len(holders)} placeholder sequences "
                               f"(first: {missing[0]!r}); the driver must send a fill for such a step")
        fill_placeholders(holders, [sampled[s.seq_id] for s in holders])


def pack_output(result: ModelRunnerOutput | None, out: SchedulerOutput) -> tuple | None:
    """The output rank's answer as plain lists in the step's order of sequences to sample (no ids), or
    keyed by id where a runner answered for other sequences."""
    if result is None:
        return None
    if result.prompt_logprobs:  # rare (echo / prompt_logprobs prefill chunks): wrapped around the usual answer
        return ("prompt", pack_output(result.without_prompt_logprobs(), out), result.prompt_logprobs)
    if result.spec:  # speculative decoding: several tokens per sequence
        return ("spec", [(seq_id, [(t.token_id, t.logprob, t.top_logprobs) for t in toks])
                         for seq_id, toks in result.spec.items()],
                [(seq_id, t.token_id, t.logprob, t.top_logprobs) for seq_id, t in result.sampled.items()
                 if seq_id not in result.spec])
    expected = out.sample_seq_ids()
    columns = result.columns
    if columns is not None and columns[0] == expected:  # the runner's columns are the answer already
        _, token_ids, logprobs, tops = columns
        return ("ordered", token_ids, logprobs, tops if tops and any(tops) else None)
    sampled = result.sampled
    if len(expected) == len(sampled):
        try:
            tokens = [sampled[seq_id] for seq_id in expected]
        except KeyError:  # answered for other sequences than the step's sampled ones
            tokens = None
        if tokens is not None:
            tops = [t.top_logprobs for t in tokens]
            return ("ordered", [t.token_id for t in tokens], [t.logprob for t in tokens], tops if any(tops) else None)
    return ("keyed", [(seq_id, t.token_id, t.logprob, t.top_logprobs) for seq_id, t in sampled.items()])


def unpack_output(packed: tuple, out: SchedulerOutput) -> ModelRunnerOutput:
    if packed[0] == "prompt":
        result = unpack_output(packed[1], out)
        result.prompt_logprobs = packed[2]
        return result
    if packed[0] == "spec":
        spec = {seq_id: [SampledToken(*t) for t in toks] for seq_id, toks in packed[1]}
        sampled = {seq_id: SampledToken(tok, lp, top) for seq_id, tok, lp, top in packed[2]}
        sampled.update((seq_id, toks[0]) for seq_id, toks in spec.items())
        return ModelRunnerOutput(sampled, spec)
    if packed[0] == "keyed":
        return ModelRunnerOutput({seq_id: SampledToken(tok, lp, top) for seq_id, tok, lp, top in packed[1]})
    _, token_ids, logprobs, tops = packed
    return ModelRunnerOutput.from_columns(out.sample_seq_ids(), token_ids, logprobs, tops)
