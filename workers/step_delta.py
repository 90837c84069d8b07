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
step's compact part, their slots and tokens as two lists of ints (and the few new block ids beside), and
the rank moves its held `ScheduledSeq`s on in a tight loop. When a step is all compact and has the last
step's sequences in the same order, even the slots stay home: the step is its tokens.

The answer goes back the same way: the sampled tokens in the step's order of sequences to sample,
without their ids. The encoded step is tuples of ints and lists (fast to pickle); `StepEncoder`
pickles it once and the same bytes go to every rank.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

from workers.scheduler_output import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput


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
        # The slots of the last step, in its order, when every one of its sequences was compact (else None):
        # a step of the same sequences, all compact again, sends only its tokens.
        self._last_slots: list[int] | None = None

    def _slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._num_slots += 1
        return self._num_slots - 1

    def encode(self, out: SchedulerOutput) -> bytes:
        forget = []
        sent_of = self._sent
        for seq_id in out.finished_seq_ids:
            sent = sent_of.pop(seq_id, None)
            if sent is not None:
                forget.append(sent.slot)
                self._free_slots.append(sent.slot)
        new, known, spec = [], [], []
        general = []  # (index in the step, 0 = next of `new` or 1 = next of `known`); the others are compact
        # The compact part: sequences the ranks hold as a plain decode that decode one more token at the next
        # position with the same table, or one grown at its end (`grow`: (index in the compact part, new ids)).
        slots, tokens, grow = [], [], []
        add_slot, add_token, get = slots.append, tokens.append, sent_of.get
        for s in out.seqs:
            sent = get(s.seq_id)
            table = s.block_table
            if sent is not None and sent.plain:
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
            i = len(slots) + len(general)  # the sequence's index in the step
            if sent is not None and (len(table) < sent.num_blocks or (table and table[0] != sent.first_block)
                                     or (sent.num_blocks and table[sent.num_blocks - 1] != sent.last_block)):
                forget.append(sent.slot)  # rebuilt without a finish in between: resend it whole
                self._free_slots.append(sent.slot)
                del sent_of[s.seq_id]
                sent = None
            if sent is None:
                sent = sent_of[s.seq_id] = _Sent(self._slot(), len(table), table[0] if table else -1,
                                                 table[-1] if table else -1)
                new.append((sent.slot, s.seq_id, s.token_ids, s.start_pos, table, s.sample, s.num_output_tokens,
                            s.prompt_token_ids, s.output_token_ids, s.sampling_params))
                general.append((i, 0))
            else:
                known.append((sent.slot, s.token_ids, s.start_pos, table[sent.num_blocks:] if len(table) > sent.num_blocks
                              else None, s.sample, s.num_output_tokens, s.prompt_token_ids or None,
                              s.output_token_ids or None))
                general.append((i, 1))
                sent.num_blocks, sent.last_block = len(table), (table[-1] if table else -1)
            sent.start_pos, sent.context_minus_out = s.start_pos, s.start_pos - s.num_output_tokens
            sent.plain = (len(s.token_ids) == 1 and s.sample and bool(table) and not s.spec_token_ids
                          and not s.prompt_token_ids and not s.output_token_ids)
            if s.spec_token_ids:
                # Speculative decoding's drafts (and a draft model's q, on the host) are per step: (index, ...).
                spec.append((i, s.spec_token_ids, None if s.spec_probs is None else s.spec_probs.cpu()))
        if general:
            # 0 = next of `new`, 1 = next of `known`, 2 = next compact: the step keeps its order of sequences
            order = bytearray(b"\x02") * (len(slots) + len(general))
            for i, kind in general:
                order[i] = kind
            compact = (slots, tokens, grow) if slots else None
            self._last_slots = None
        else:  # every sequence compact (or an empty step): no order; the slots only where they changed
            compact = (None if slots == self._last_slots else slots, tokens, grow)
            self._last_slots = slots
            order = b""
        # The grammar bitmask (structured output) is per step: sent whole when there is one.
        return pickle.dumps((out.finished_seq_ids, forget, new, known, bytes(order), out.token_bitmask, spec, compact),
                            protocol=pickle.HIGHEST_PROTOCOL)


class StepDecoder:
    """Rank side: the sequences sent so far, by slot; rebuilds each step's SchedulerOutput."""

    def __init__(self) -> None:
        self._held: dict[int, ScheduledSeq] = {}
        self._last_seqs: list[ScheduledSeq] | None = None  # the last step's, when all of it was compact
        self._drafted: list[ScheduledSeq] = []  # the last step's sequences with drafts

    def decode(self, payload: bytes) -> SchedulerOutput:
        finished_ids, forget, new, known, order, token_bitmask, spec, compact = pickle.loads(payload)
        held = self._held
        for slot in forget:
            held.pop(slot, None)
        for seq in self._drafted:  # a held sequence's drafts were last step's
            seq.spec_token_ids, seq.spec_probs = [], None
        if not order:  # every sequence compact: a plain decode one position on, the same table or grown
            slots, tokens, grow = compact
            if slots is None:
                if self._last_seqs is None:
                    raise RuntimeError("a step reuses the last step's sequences, but the last step was not all compact")
                seqs = self._last_seqs.copy()
            else:
                seqs = [held[slot] for slot in slots]
            for seq, token in zip(seqs, tokens):
                seq.token_ids = [token]
                seq.start_pos += 1
                seq.num_output_tokens += 1
            for i, appended in grow:
                seqs[i].block_table.extend(appended)
            self._last_seqs = seqs
        else:
            self._last_seqs = None
            new_it, known_it = iter(new), iter(known)
            if compact is not None:
                compact_slots, compact_tokens, grow = compact
                compact_it = iter(zip(compact_slots, compact_tokens))
                grown = dict(grow)
            n_compact = 0
            seqs = []
            for kind in order:
                if kind == 2:
                    slot, token = next(compact_it)
                    seq = held[slot]
                    seq.token_ids = [token]
                    seq.start_pos += 1
                    seq.num_output_tokens += 1
                    appended = grown.get(n_compact)
                    if appended:
                        seq.block_table.extend(appended)
                    n_compact += 1
                elif kind == 0:
                    slot, seq_id, tokens, start, table, sample, n_out, prompt, output, params = next(new_it)
                    seq = held[slot] = ScheduledSeq(seq_id, tokens, start, list(table), sample, params, n_out, prompt,
                                                    output)
                else:
                    # The held ScheduledSeq itself, updated: the rank runs this step to the end before it decodes
                    # the next one.
                    slot, tokens, start, appended, sample, n_out, prompt, output = next(known_it)
                    seq = held[slot]
                    seq.token_ids, seq.start_pos, seq.sample, seq.num_output_tokens = tokens, start, sample, n_out
                    if appended:
                        seq.block_table.extend(appended)
                    seq.prompt_token_ids, seq.output_token_ids = prompt or [], output or []
                seqs.append(seq)
        drafted = self._drafted = []
        for i, drafts, probs in spec:
            seq = seqs[i]
            seq.spec_token_ids, seq.spec_probs = drafts, probs
            drafted.append(seq)
        return SchedulerOutput(seqs=seqs, finished_seq_ids=finished_ids, token_bitmask=token_bitmask)

    @property
    def num_held(self) -> int:
        return len(self._held)


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
    expected = [s.seq_id for s in out.seqs if s.sample]
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
    return ModelRunnerOutput.from_columns([s.seq_id for s in out.seqs if s.sample], token_ids, logprobs, tops)
