"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI completions' `echo` with `logprobs`): the
log-softmax of the logits at every prompt position of a prefill chunk, read at the next prompt token
(and the top-n), on the rank that holds the full-vocabulary logits.

A chunk's rows are the hidden states the model just computed for its tokens (positions start_pos ..
context_len - 1); position p predicts prompt token p + 1, so the last prompt position (which predicts
the first output token) is left out. The scheduler ships the prompt's tokens with such a request
(`SamplingParams.needs_token_history`), so a chunk's last row knows the next chunk's first token.
Every rank of the last pipeline stage calls `compute_logits` for the same rows (a TP collective);
only the first TP rank gets the logits and an answer.
"""
from __future__ import annotations

import torch

from workers.host_fetch import host_lists
from workers.scheduler_output import ScheduledSeq

# seq_id -> [(prompt position, its token's logprob, top-n [(token id, logprob)], best first)]
PromptLogprobs = dict[str, list[tuple[int, float, list[tuple[int, float]]]]]


def wants_prompt_logprobs(s: ScheduledSeq) -> bool:
    return s.sampling_params.prompt_logprobs is not None and s.start_pos < len(s.prompt_token_ids) - 1


def compute_prompt_logprobs(head, seqs: list[ScheduledSeq], hidden: torch.Tensor) -> PromptLogprobs:
    """seqs: one micro-batch in the order its tokens were run; hidden [its tokens, d] (sequence
    parallelism is not supported: its rows are spread over ranks)."""
    out: PromptLogprobs = {}
    offset = 0
    for s in seqs:
        if wants_prompt_logprobs(s):
            last = min(s.context_len, len(s.prompt_token_ids) - 1)  # positions start_pos .. last - 1
            targets = s.prompt_token_ids[s.start_pos + 1: last + 1]
            logits = head.compute_logits(hidden[offset: offset + len(targets)])
            if logits is not None:
                out[s.seq_id] = _entries(logits, targets, s.start_pos + 1, s.sampling_params.prompt_logprobs)
        offset += s.num_tokens
    return out


def _entries(logits: torch.Tensor, targets: list[int], first_pos: int, n_top: int):
    logprobs = logits.float().log_softmax(dim=-1)  # [T, V]
    index = torch.tensor(targets, device=logprobs.device)[:, None]
    chosen_t = logprobs.gather(1, index).squeeze(1)
    if n_top > 0:
        values, ids = logprobs.topk(n_top, dim=-1)
        chosen, ids_l, values_l = host_lists(chosen_t, ids, values)  # one wait, pinned (workers/host_fetch.py)
        tops = [list(zip(i, v)) for i, v in zip(ids_l, values_l)]
    else:
        (chosen,) = host_lists(chosen_t)
        tops = [[] for _ in targets]
    return [(first_pos + k, lp, top) for k, (lp, top) in enumerate(zip(chosen, tops))]
