"""Splitting one step's batch into pipeline micro-batches.

With pipeline parallelism a step's batch is cut into micro-batches of whole sequences, so stage s
can work on micro-batch m while stage s+1 works on m-1. Every rank cuts the same way from the same
`SchedulerOutput`, so no rank has to tell another where the cuts are.
"""
from __future__ import annotations

from workers.scheduler_output import ScheduledSeq


def split_by_sequence(seqs: list[ScheduledSeq], max_parts: int) -> list[list[ScheduledSeq]]:
    """At most `max_parts` contiguous, non-empty groups of sequences with token counts about even.

    Groups are contiguous so the sampled rows come out in the order of `seqs`. A sequence is never
    split: its tokens attend to each other within the step.
    """
    n = min(max_parts, len(seqs))
    if n <= 1:
        return [list(seqs)]
    total = sum(s.num_tokens for s in seqs)
    parts: list[list[ScheduledSeq]] = []
    current: list[ScheduledSeq] = []
    done_tokens = 0
    for i, s in enumerate(seqs):
        current.append(s)
        done_tokens += s.num_tokens
        parts_to_open = n - len(parts) - 1  # groups still to start after the current one
        seqs_left = len(seqs) - i - 1
        reached_share = done_tokens * n >= total * (len(parts) + 1)
        # Cut when this group has its share of the tokens, or when every later group needs one of the
        # remaining sequences to be non-empty.
        if parts_to_open > 0 and (reached_share or seqs_left == parts_to_open):
            parts.append(current)
            current = []
    parts.append(current)
    return parts
