"""What a multi-rank step sends its ranks: only what changed since the last step.

A running sequence's block table only grows, and its sampling parameters never change, so after a
sequence's first step the driver sends its new tokens, its position and the block ids appended since
(usually none). Each rank keeps the tables and parameters it was sent (`StepDecoder`) and rebuilds
the full `SchedulerOutput` that `ModelRunner.execute` takes. Sequences in `finished_seq_ids`
(finished, aborted or preempted) are forgotten on both sides before the step's sequences are read, so
a preempted sequence that comes back with a new table is sent whole again.

The encoded step is tuples of ints and lists (fast to pickle); `StepEncoder` pickles it once and the
same bytes go to every rank.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

from workers.sampling_params import SamplingParams
from workers.scheduler_output import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput

# A sequence the ranks know: (seq_id, token_ids, start_pos, new_block_ids, sample, num_output_tokens,
# prompt_token_ids, output_token_ids). The last two are empty unless the parameters need the history.
Known = tuple
# A sequence sent whole: (seq_id, ..., same fields with the full block table, sampling_params).
New = tuple


@dataclass
class _Sent:
    num_blocks: int  # block ids the ranks hold for this sequence
    first_block: int  # a cheap check that the table was not rebuilt without a finish in between


class StepEncoder:
    """Driver side: remembers what the ranks hold; one per executor."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, out: SchedulerOutput) -> bytes:
        for seq_id in out.finished_seq_ids:
            self._sent.pop(seq_id, None)
        new: list[New] = []
        known: list[Known] = []
        order: list[int] = []  # 0 = next of `new`, 1 = next of `known`: the step keeps its sequence order
        for s in out.seqs:
            sent = self._sent.get(s.seq_id)
            table = s.block_table
            if sent is None or len(table) < sent.num_blocks or (table and table[0] != sent.first_block):
                new.append((s.seq_id, s.token_ids, s.start_pos, table, s.sample, s.num_output_tokens,
                            s.prompt_token_ids, s.output_token_ids, s.sampling_params))
                order.append(0)
            else:
                known.append((s.seq_id, s.token_ids, s.start_pos, table[sent.num_blocks:], s.sample,
                              s.num_output_tokens, s.prompt_token_ids, s.output_token_ids))
                order.append(1)
            self._sent[s.seq_id] = _Sent(len(table), table[0] if table else -1)
        forget = [seq_id for seq_id in out.finished_seq_ids]
        return pickle.dumps((forget, new, known, order), protocol=pickle.HIGHEST_PROTOCOL)

    def reset(self) -> None:
        """After the ranks lost their state (never while they live): send everything whole."""
        self._sent.clear()


@dataclass
class _Held:
    block_table: list[int]
    sampling_params: SamplingParams


class StepDecoder:
    """Rank side: the tables and parameters sent so far; rebuilds each step's SchedulerOutput."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def decode(self, payload: bytes) -> SchedulerOutput:
        forget, new, known, order = pickle.loads(payload)
        for seq_id in forget:
            self._held.pop(seq_id, None)
        new_it, known_it = iter(new), iter(known)
        seqs: list[ScheduledSeq] = []
        for kind in order:
            if kind == 0:
                seq_id, tokens, start, table, sample, n_out, prompt, output, params = next(new_it)
                held = self._held[seq_id] = _Held(list(table), params)
            else:
                seq_id, tokens, start, appended, sample, n_out, prompt, output = next(known_it)
                held = self._held[seq_id]
                held.block_table.extend(appended)
            # The held table itself, not a copy: the rank runs this step to the end before it decodes
            # (and extends the table for) the next one.
            seqs.append(ScheduledSeq(seq_id, tokens, start, held.block_table, sample, held.sampling_params,
                                     n_out, prompt, output))
        return SchedulerOutput(seqs=seqs, finished_seq_ids=forget)

    @property
    def num_held(self) -> int:
        return len(self._held)


def pack_output(out: ModelRunnerOutput | None) -> tuple | None:
    """The output rank's answer as plain tuples (pickles several times faster than the dataclasses)."""
    if out is None:
        return None
    return tuple((seq_id, t.token_id, t.logprob, t.top_logprobs) for seq_id, t in out.sampled.items())


def unpack_output(packed: tuple) -> ModelRunnerOutput:
    return ModelRunnerOutput({seq_id: SampledToken(token, logprob, top) for seq_id, token, logprob, top in packed})
