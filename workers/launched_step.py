"""A greedy step whose work is queued on the device and not yet waited for (`ModelRunner.launch_greedy`).

A rank that waits for each step's tokens before it builds the next step leaves its GPU idle for that host work,
every step: receiving the next step, rebuilding it, filling its staging buffers. A launched step keeps its tokens on
the device (`next_ids`), where the next step can take them as its inputs, and copies them to pinned host memory
behind an event; `finish` waits for that event only. So a rank can queue step n+1 behind step n and then wait for
step n's tokens (cluster/rank_worker.py).
"""
from __future__ import annotations

import os

import torch

from workers.scheduler_output import ModelRunnerOutput


class LaunchedStep:
    """packed: [2, B] float64 on the step's device, each row's (argmax token id, its logprob); float64 holds any
    token id exactly, so one copy brings both. seq_ids: the rows' sequences; top: the top-logprobs column; mixed:
    whether the step held prefill chunks (TANDEM_LAUNCH_MIXED=1), not only decodes."""

    def __init__(self, seq_ids: list[str], packed: torch.Tensor, top: list | None, mixed: bool = False):
        self.seq_ids, self.top, self.mixed = seq_ids, top, mixed
        self.next_ids = packed[0].long()  # [B]: a next step's input tokens, made before anything overwrites packed
        if packed.is_cuda:
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.ready: torch.cuda.Event | None = torch.cuda.Event()
            self.ready.record()
        else:  # computed already: nothing to wait for
            self.host, self.ready = packed, None

    def done(self) -> bool:
        """Whether the step's tokens are on the host (never blocks)."""
        return self.ready is None or self.ready.query()

    def finish(self) -> ModelRunnerOutput:
        """Wait for the tokens (this step's work only: work queued after it is not waited for)."""
        if self.ready is not None:
            self.ready.synchronize()
        ids, logprobs = self.host.tolist()
        return ModelRunnerOutput.from_columns(self.seq_ids, [int(t) for t in ids], logprobs, self.top)


# TANDEM_RANK_LAUNCH_AHEAD: "auto" (default) launches ahead on GPU ranks only; "1" on any device (CPU ranks too: their
# "launch" computes the step whole, so it only delays the answer there; tests use it); "0" never (the A/B switch).
LAUNCH_AHEAD_ENV = "TANDEM_RANK_LAUNCH_AHEAD"


# TANDEM_LAUNCH_MIXED ("1", the default) launches plain greedy steps with prefill chunks in them too, not only decode
# steps: run whole, such a step keeps the host waiting for its tokens, so the in-process engine applies, detokenizes
# and schedules only after the GPU is done and before the next step starts. Measured on 2 x H200, 2026-11-30 (offline,
# 1,000 requests, Llama-3.1-8B shapes): one GPU 14.39 -> 13.09 s, TP=2 9.58 -> 9.12 s; "0" runs them whole (A/B).
LAUNCH_MIXED_ENV = "TANDEM_LAUNCH_MIXED"


def launch_mixed_enabled(environ: dict[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(LAUNCH_MIXED_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{LAUNCH_MIXED_ENV}={value!r}: expected '0' or '1'")
    return value == "1"


def launch_ahead_enabled(device: torch.device, environ: dict[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(LAUNCH_AHEAD_ENV, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{LAUNCH_AHEAD_ENV}={value!r}: expected 'auto', '0' or '1'")
    return value == "1" or (value == "auto" and device.type == "cuda")
