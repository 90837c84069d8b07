"""The contract between the scheduler and the model runner(s).

`SchedulerOutput` is plain data, cheap to pickle: with several ranks it is broadcast to each of them
every step. It says which tokens of which sequences to run, where their KV goes (block tables), and
how to sample the sequences whose last scheduled token completes their known tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from workers.sampling_params import SamplingParams


# A token the scheduler does not know yet: the one the step still out at the ranks samples for this sequence
# (asynchronous scheduling, engine/scheduler.py). The ranks replace it before the step runs (`fill_placeholders`).
PLACEHOLDER_TOKEN = -1


@dataclass
class ScheduledSeq:
    seq_id: str
    token_ids: list[int]  # the tokens to run this step (a prefill chunk, or the one decode token)
    start_pos: int  # position of token_ids[0]; tokens before it are already in the KV cache
    block_table: list[int]  # physical block ids covering positions [0, start_pos + len(token_ids))
    sample: bool  # True when this step reaches the end of the known tokens: sample the next one
    sampling_params: SamplingParams
    num_output_tokens: int  # tokens generated so far: index of the token sampled now (seeding, min_tokens)
    # Filled only when sampling_params.needs_token_history (penalties), else empty.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Speculative decoding: the proposed tokens, which are also the last len(spec_token_ids) of token_ids
    # (token_ids = [last known token, *drafts]); the runner verifies them (workers/spec_decode/verify.py).
    spec_token_ids: list[int] = field(default_factory=list)
    # [len(spec_token_ids), V] float32 draft probabilities of a sampled request's drafts (the proposal
    # distribution q); None: the drafts were proposed deterministically (n-gram, greedy draft), q is one-hot.
    spec_probs: Any = None
    # Driver only: KV slots the scheduler reserved for drafts (the proposer fills up to this many).
    num_lookahead: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """KV length after this step: cached tokens plus the new ones."""
        return self.start_pos + len(self.token_ids)


def placeholder_seqs(seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """The step's sequences whose last token is a placeholder, in step order (the order of a fill)."""
    return [s for s in seqs if s.token_ids and s.token_ids[-1] == PLACEHOLDER_TOKEN]


def num_placeholders(out: SchedulerOutput) -> int:
    """len(placeholder_seqs(out.seqs)), read from the scheduler's columns where it gave them: a plain decode's
    one token is in `PlainDecodes.tokens`, so only the step's other sequences are looked at."""
    plan = out.plain_decodes
    if plan is None:
        return len(placeholder_seqs(out.seqs))
    seqs = out.seqs
    return plan.tokens.count(PLACEHOLDER_TOKEN) + len(placeholder_seqs([seqs[i] for i in plan.others]))


def fill_placeholders(seqs: list[ScheduledSeq], tokens: list[int]) -> None:
    """Put the tokens the previous step sampled in place of the placeholders, in step order."""
    holders = placeholder_seqs(seqs)
    if len(holders) != len(tokens):
        raise RuntimeError(f"a step has {len(holders)} placeholder tokens but {len(tokens)} came to fill them")
    for s, token in zip(holders, tokens):
        s.token_ids = [*s.token_ids[:-1], token]


@dataclass
class TokenBitmask:
    """The tokens each grammar-constrained sequence may sample this step (engine/grammar.py): row k
    of `bitmask` [len(seq_ids), ceil(vocab / 32)] int32 belongs to seq_ids[k]; bit j of word w allows
    token 32 * w + j. Only the bits travel to the ranks, never the grammar state."""

    seq_ids: list[str]
    bitmask: torch.Tensor


@dataclass(slots=True)
class PlainDecodes:
    """What the scheduler knows of a step's plain decodes, as columns, so that the step encoder
    (workers/step_delta.py) need not read them one by one.

    A plain decode here is a sequence that decodes one token at the position after the one it had in step
    `after` (the scheduler's last step with sequences), where it was a plain decode too: one token,
    sampled, no drafts or token history, its table the same or grown at its end. Such a sequence is
    exactly its step-`after` self one position on, with one more generated token, so the ranks, which hold
    step `after`'s sequences in its order, need only its row there, its token and any new block ids. This
    holds only for the ranks that ran step `after` just before this one: the encoder checks that it sent
    step `after` last, and otherwise ignores these columns."""

    step: int  # this step's number, unique in the process (the next step's `after`)
    after: int  # the step the plain decodes continue (-1: none)
    # The plain decodes' rows in step `after`, in this step's order; None: every sequence of this step is
    # one, and they are step `after`'s sequences in its order.
    rows: list[int] | None
    others: list[int]  # this step's indices of its other sequences, ascending
    tokens: list[int]  # the plain decodes' tokens, in step order (PLACEHOLDER_TOKEN: the step out samples it)
    # (index among the plain decodes, index in the step, block ids appended since step `after`)
    grown: list[tuple[int, int, list[int]]]


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    # Sequences that finished or were preempted/aborted since the last step: ranks drop any state they keep.
    finished_seq_ids: list[str] = field(default_factory=list)
    # Structured output: allowed tokens of the constrained sequences that sample this step (None: none).
    token_bitmask: TokenBitmask | None = None
    # Set by the scheduler (engine/scheduler.py) for the step encoder; a hand-built step has none. Not part
    # of the step's meaning: two steps with the same sequences are equal whatever their columns.
    plain_decodes: PlainDecodes | None = field(default=None, compare=False, repr=False)
    # The ids of the sequences that sample, in step order, once made (`sample_seq_ids`), or handed on from the
    # step before by the step encoder and decoder while the step's sequences stay the same (workers/step_delta.py).
    sample_ids: list[str] | None = field(default=None, compare=False, repr=False)

    def sample_seq_ids(self) -> list[str]:
        """The ids of the sequences that sample, in step order: the order of a step's answer."""
        ids = self.sample_ids
        if ids is None:
            ids = self.sample_ids = [s.seq_id for s in self.seqs if s.sample]
        return ids

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # log-softmax of the raw logits at the sampled token
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first, when asked


class ModelRunnerOutput:
    """Tokens sampled this step, keyed by sequence (only sequences with `sample=True`).

    The common paths (a plain decode step's sampler) build it from columns in the step's order:
    `from_columns(seq ids, token ids, logprobs, top logprobs)`. The dict of `SampledToken` is then made on
    first read of `sampled`, so a rank that only ships its tokens to the driver (workers/step_delta.py) never
    makes one, and the driver makes it once, as in-process."""

    __slots__ = ("_sampled", "columns", "spec", "prompt_logprobs")

    def __init__(self, sampled: dict[str, SampledToken] | None = None, spec: dict[str, list[SampledToken]] | None = None,
                 prompt_logprobs: dict[str, list] | None = None):
        self._sampled = sampled
        # (seq ids, token ids, logprobs, top logprobs per row or None for no row): `sampled`, not yet made.
        self.columns: tuple[list[str], list[int], list[float], list | None] | None = None
        # Speculating sequences: every token emitted this step, in order (accepted drafts, then the corrected
        # or bonus token); sampled[seq_id] is its first.
        self.spec: dict[str, list[SampledToken]] = {} if spec is None else spec
        # Prompt logprobs of this step's prefill chunks that asked for them (workers/prompt_logprobs.py):
        # seq_id -> [(prompt position, logprob of its token, top-n [(token id, logprob)])].
        self.prompt_logprobs: dict[str, list] = {} if prompt_logprobs is None else prompt_logprobs

    @classmethod
    def from_columns(cls, seq_ids: list[str], token_ids: list[int], logprobs: list[float],
                     top_logprobs: list | None = None) -> ModelRunnerOutput:
        if not len(seq_ids) == len(token_ids) == len(logprobs):
            raise ValueError(f"{len(seq_ids)} sequences, {len(token_ids)} tokens, {len(logprobs)} logprobs")
        out = cls()
        out.columns = (seq_ids, token_ids, logprobs, top_logprobs)
        return out

    @property
    def sampled(self) -> dict[str, SampledToken]:
        """Made from the columns on first read, which are then dropped: the dict may be changed, and one
        representation at a time cannot go stale."""
        if self._sampled is None:
            if self.columns is None:
                self._sampled = {}
            else:
                ids, tokens, logprobs, tops = self.columns
                self._sampled = dict(zip(ids, map(SampledToken, tokens, logprobs, tops or _nones(len(ids)))))
                self.columns = None
        return self._sampled

    def without_prompt_logprobs(self) -> ModelRunnerOutput:
        """The same sampled tokens (columns or dict, as they are) and drafts, without the prompt logprobs."""
        out = ModelRunnerOutput(self._sampled, self.spec)
        out.columns = self.columns
        return out

    def token_ids_by_seq(self) -> dict[str, int]:
        """seq id -> the token sampled for it (without making the `SampledToken`s where there are columns)."""
        if self.columns is not None:
            return dict(zip(self.columns[0], self.columns[1]))
        return {seq_id: t.token_id for seq_id, t in self.sampled.items()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelRunnerOutput):
            return NotImplemented
        return (self.sampled, self.spec, self.prompt_logprobs) == (other.sampled, other.spec, other.prompt_logprobs)

    def __repr__(self) -> str:
        return f"ModelRunnerOutput(sampled={self.sampled!r}, spec={self.spec!r}, prompt_logprobs={self.prompt_logprobs!r})"


def _nones(n: int) -> list[None]:
    return [None] * n
