"""A request's state inside one engine: its tokens, its KV blocks, and how far it has been computed."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from workers.sampling_params import SamplingParams

_arrival = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    token_ids: list[int]  # prompt, then generated tokens
    sampling_params: SamplingParams
    priority: int = 0  # lower runs first (vLLM's convention); ties go to the earlier arrival
    num_prompt_tokens: int = 0
    arrival: int = field(default_factory=lambda: next(_arrival))
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full computed blocks
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, found in the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    # The scheduler's note for the step encoder (Scheduler._output): (step, index in it, block count) of the last
    # step that ran this sequence as a plain decode; (-1, 0, 0): none since it (re)started.
    plain_at: tuple[int, int, int] = field(default=(-1, 0, 0), compare=False, repr=False)
    # Pipelined steps (Scheduler.num_groups > 1): the group whose steps run this sequence, set each time it is
    # admitted; a group's steps are in flight one at a time, beside the other groups'.
    group: int = field(default=0, compare=False, repr=False)
    # The number the last step that ran this sequence has among the scheduler's steps sent (Scheduler.steps_sent once
    # it is sent): its blocks are parked on release only while that step is out (Scheduler._free).
    last_step: int = field(default=0, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_hashed_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)
