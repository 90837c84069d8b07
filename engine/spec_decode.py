"""The engine's side of speculative decoding: when to speculate, the proposals, and the counters.

Each step the scheduler asks `lookahead(seq)` how many draft slots to reserve for a decoding
sequence; after scheduling, `propose` fills those slots (n-gram lookup over the sequence's tokens, or
the draft model), and the target verifies them in the same forward pass as everything else
(workers/spec_decode/verify.py). `record` counts what was proposed and accepted.

Speculation turns itself down where it cannot pay: a step with `batch_size_limit` or more running
sequences is compute-bound on a GPU (verifying k+1 tokens per sequence then costs about k+1 times a
decode), so it decodes plainly; near max_model_len or max_tokens fewer drafts are proposed.
"""
from __future__ import annotations

from workers.config import EngineConfig
from workers.scheduler_output import ModelRunnerOutput, SchedulerOutput
from workers.spec_decode.config import SpeculativeConfig
from workers.spec_decode.ngram import TokenArrays, propose_ngram
from engine.sequence import Sequence


class SpecDecoder:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, num_blocks: int, max_model_len: int,
                 eos_token_ids: list[int]):
        if config.parallel.sequence_parallel_size > 1:
            raise ValueError("speculative_config: not supported with sequence_parallel_size > 1 (ring attention runs "
                             "prompts; a decode pool or a colocated replica without SP can speculate)")
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.max_len = max_model_len if spec.max_model_len is None else min(max_model_len, spec.max_model_len)
        self.draft = None
        if spec.method == "draft_model":
            from workers.spec_decode.draft import DraftProposer

            self.draft = DraftProposer(config, spec, num_blocks, max_model_len, eos_token_ids)
            self.max_len = min(self.max_len, self.draft.max_model_len)
        self.batch_limit = spec.batch_size_limit(config.model.resolved_device().type)
        self._step_k = self.k
        # Counters (vLLM's names): proposals, drafted and accepted tokens, acceptance per draft position.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        self.drafted_per_pos = [0] * self.k
        self.num_steps_disabled = 0
        self.opted_out: set[str] = set()  # requests that decode without speculation
        self.token_arrays = TokenArrays()  # n-gram: each sequence's tokens as an array, extended per step

    # ---- scheduling ----
    def begin_step(self, num_running: int) -> None:
        """The policy for the coming step: no speculation at batch sizes where it cannot pay."""
        self._step_k = self.k if num_running < self.batch_limit else 0
        if self._step_k == 0 and num_running:
            self.num_steps_disabled += 1

    def lookahead(self, seq: Sequence) -> int:
        """Draft slots for a decoding sequence this step: k, fewer near its limits."""
        if self._step_k == 0 or seq.seq_id in self.opted_out:
            return 0
        if getattr(seq.sampling_params, "structured_outputs", None) is not None:
            return 0  # a grammar masks one position per step: its drafts could not be verified against it
        room = self.max_len - seq.num_tokens  # the target writes KV at positions up to num_tokens - 1 + k
        left = seq.sampling_params.max_tokens - seq.num_output_tokens - 1  # the step's own token is one more
        return max(0, min(self._step_k, room, left))

    # ---- proposals ----
    def propose(self, out: SchedulerOutput, seqs: dict[str, Sequence]) -> None:
        """Fill the reserved slots: each scheduled sequence's `spec_token_ids` (and `token_ids` after its
        last known token), with `spec_probs` for a draft model's sampled requests."""
        if self.draft is not None:
            self.draft.forget(out.finished_seq_ids)
        for seq_id in out.finished_seq_ids:
            if seq_id not in seqs:  # finished (a preempted sequence keeps its tokens)
                self.opted_out.discard(seq_id)
                self.token_arrays.forget(seq_id)
        todo = [s for s in out.seqs if s.num_lookahead > 0]
        if not todo:
            return
        if self.draft is None:
            for s in todo:
                p = self.spec
                tokens = self.token_arrays.get(s.seq_id, seqs[s.seq_id].token_ids)
                s.spec_token_ids = propose_ngram(tokens, s.num_lookahead, p.prompt_lookup_min, p.prompt_lookup_max)
        else:
            proposals = self.draft.propose(todo, {s.seq_id: seqs[s.seq_id].token_ids for s in todo})
            for s, (drafts, probs) in zip(todo, proposals):
                s.spec_token_ids, s.spec_probs = drafts, probs
        for s in todo:
            if s.spec_token_ids:
                s.token_ids = s.token_ids + s.spec_token_ids

    # ---- counters ----
    def record(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        for s in out.seqs:
            drafts = len(s.spec_token_ids)
            if not drafts or s.seq_id not in result.spec:
                continue
            accepted = len(result.spec[s.seq_id]) - 1
            self.num_drafts += 1
            self.num_draft_tokens += drafts
            self.num_accepted_tokens += accepted
            for j in range(drafts):
                self.drafted_per_pos[j] += 1
            for j in range(accepted):
                self.accepted_per_pos[j] += 1

    def metrics(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_num_draft_tokens_per_pos": list(self.drafted_per_pos),
            "spec_decode_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "spec_decode_mean_accepted_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
            "spec_decode_num_steps_disabled": self.num_steps_disabled,
        }


def empty_metrics(k: int = 0) -> dict:
    """The same keys with nothing counted (an engine without speculation)."""
    return {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0,
            "spec_decode_num_accepted_tokens_per_pos": [0] * k, "spec_decode_num_draft_tokens_per_pos": [0] * k,
            "spec_decode_acceptance_rate": 0.0, "spec_decode_mean_accepted_length": 0.0,
            "spec_decode_num_steps_disabled": 0}
