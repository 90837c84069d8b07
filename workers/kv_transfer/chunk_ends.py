"""Where each prompt's recent prefill chunks end on a prefill rank's engine stream (issue 24: KV in pieces).

A piece of a prompt (`PrefillPiece`) may be sent while the prompt's later chunks compute, and on a GPU a step that
samples nothing returns before its kernels end: the piece's gathers must wait for the chunk that wrote its blocks.
Waiting for the whole engine stream (`torch.cuda.default_stream`) also waits for the chunk queued after it, so a
piece moved one chunk late (a two-chunk prompt's piece not before its last chunk ended). Instead the model runner of
a prefill rank records an event after every step that runs prefill chunks (`record`), noting for each such sequence
how far that step computes it; a piece's send waits for the first event whose step reached the piece's last token
(`event_for`). Any later event of the sequence is as safe (the engine's stream runs its steps in order), so losing
the exact one costs only time; with none (the sequence finished, or its steps predate the record) the send waits
for the whole stream, as before.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from workers.scheduler_output import SchedulerOutput

KEEP = 4  # chunks remembered per sequence: a piece is sent within a chunk or two of the step that completed it


class ChunkEnds:
    def __init__(self, new_event: Callable[[], object] | None = None):
        # new_event: makes an event recorded on the current (engine) stream; tests pass a stand-in.
        self._new_event = new_event or _recorded_cuda_event
        self._ends: dict[str, deque] = {}  # seq id -> (tokens computed once the step ends, the step's event)

    def record(self, out: SchedulerOutput) -> None:
        """On the step's thread, once the step's kernels are queued: one event for the step if it runs a prefill
        chunk (a sequence that samples nothing); sequences the engine has dropped are forgotten."""
        for seq_id in out.finished_seq_ids:
            self._ends.pop(seq_id, None)
        chunks = [s for s in out.seqs if not s.sample]
        if not chunks:
            return
        event = self._new_event()
        for s in chunks:
            self.note(s.seq_id, s.start_pos + s.num_tokens, event)

    def note(self, seq_id: str, end: int, event: object) -> None:
        self._ends.setdefault(seq_id, deque(maxlen=KEEP)).append((end, event))

    def event_for(self, seq_id: str, tokens: int) -> object | None:
        """The event of the first recorded step after which the sequence's first `tokens` tokens are computed, or
        None. Read on a transfer thread while the step thread appends: `list` copies the deque at once."""
        for end, event in list(self._ends.get(seq_id, ())):
            if end >= tokens:
                return event
        return None


def _recorded_cuda_event() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event
