"""CUDA graphs for decode steps: one graph per batch size of a ladder, captured once at start-up.

A decode step (every sequence runs one token) at batch B replays the graph of the smallest captured
size >= B; rows past B are padding (slot -1: their K/V is not written; seq_len 0: attention reads
nothing). All per-step inputs live in one int64 device buffer that the graphs read from fixed
addresses; a step fills a pinned host mirror of it and copies the used part over in one non-blocking copy,
so a replay costs a few host microseconds whatever the model's depth.

On one rank the graph runs the model's forward, the LM head, and greedy decoding (argmax and its
logprob): a batch of plain-greedy rows needs nothing after the replay but one small device-to-host
copy; other batches sample eagerly from the graph's logits. Under tensor parallelism every rank
captures and replays the same graphs (their all-reduces are NCCL kernels inside them) and the graph
ends at the hidden states: the LM head, whose result travels to the first rank only, runs eagerly
(`ModelRunner.sample`). Needs an attention backend that never syncs or reads device tensors on
the host (the Triton one) and a model with no host syncs (the MoE expert loop has one; the fused
MoE kernel has none).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch

from parallel.state import tp_group
from workers.attention import AttentionMetadata, forward_context
from workers.sampler import Sampler
from workers.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)


@contextlib.contextmanager
def capture_session() -> Iterator[tuple[Any, torch.cuda.Stream]]:
    """A memory pool and a side stream to capture graphs on (every graph kind here uses it), with the
    garbage collector off: a collection during a capture can destroy an unreachable engine's graphs or
    events, a CUDA call that invalidates the capture. Collects first; on exit the device has finished."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            yield pool, stream
    finally:
        if gc_was_enabled:
            gc.enable()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def capture_per_batch(batch_sizes: list[int], step: Callable[[int], Any]) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, Any]]:
    """One graph of `step(bs)` per batch size, largest first so the others reuse its memory pool; each
    size runs twice before its capture (Triton compiles, cuBLAS picks its kernels). Returns the graphs and
    the outputs each replay refills, by batch size."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, Any] = {}
    with capture_session() as (pool, stream):
        for bs in sorted(batch_sizes, reverse=True):
            for _ in range(2):
                step(bs)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                outputs[bs] = step(bs)
            graphs[bs] = g
    return graphs, outputs


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16 (vLLM's ladder), capped at max_batch."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 1025, 16))
    out = [s for s in sizes if s < max_batch] + [max_batch]
    return sorted(set(out))


class DecodeGraphs:
    def __init__(self, runner, batch_sizes: list[int]):
        self.runner = runner
        self.device = runner.device
        self.block_size = runner.block_size
        self.max_blocks = -(-runner.max_model_len // self.block_size)
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = n = self.batch_sizes[-1]
        # [tokens | positions | slots | seq_lens | query_start (n+1) | block_tables (n * max_blocks)]
        self._small = 5 * n + 1
        total = self._small + n * self.max_blocks
        # Two pinned staging buffers, taken in turn: a replay's inputs are copied from one without the host waiting,
        # and a caller that replays again before reading anything back (the draft model's greedy passes) must not
        # rewrite a buffer whose copy the GPU has not made yet; `_copied[i]` marks buffer i's last copy.
        self._hosts = [torch.zeros(total, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.buf = torch.zeros(total, dtype=torch.int64, device=self.device)
        self.token_ids = self.buf[0:n]
        self.positions = self.buf[n:2 * n]
        self.slots = self.buf[2 * n:3 * n]
        self.seq_lens = self.buf[3 * n:4 * n]
        self.query_start = self.buf[4 * n:5 * n + 1]
        self.block_tables = self.buf[self._small:].view(n, self.max_blocks)
        for host in self._hosts:
            host[2 * n:3 * n] = -1
            host[4 * n:5 * n + 1] = torch.arange(n + 1)
        self.buf.copy_(self._hosts[0])
        # A pipeline stage after the first takes the previous stage's (hidden, residual) in these buffers; one
        # before the last ends at its (hidden, residual), which the runner sends on.
        self.stage_in, self.stage_out = not runner.pp.is_first, not runner.pp.is_last
        if self.stage_in:
            d = runner.model.config.hidden_size
            self.hidden_in = torch.zeros(n, d, dtype=runner.dtype, device=self.device)
            self.residual_in = torch.zeros_like(self.hidden_in)
        self.with_head = tp_group().size == 1 and not self.stage_out  # else the graph ends at the hidden states
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # bs -> (logits [bs, V], greedy [bs, 2]) with the head, (hidden, residual) [bs, d] each before the last
        # pipeline stage, else (hidden [bs, d],)
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        L = self.runner.max_model_len
        return AttentionMetadata(
            slot_mapping=self.slots[:bs], query_start_loc=self.query_start[:bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs], query_lens_cpu=[1] * bs, seq_lens_cpu=[L] * bs,
            max_query_len=1, max_seq_len=L)

    @torch.inference_mode()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        self.graphs, self.outputs = capture_per_batch(self.batch_sizes, self._step)
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.graphs), self.batch_sizes[0],
                 self.max_bs, time.perf_counter() - t0)

    def _step(self, bs: int) -> tuple[torch.Tensor, ...]:
        model = self.runner.model
        with forward_context(self._meta(bs)):
            if self.stage_in:
                hidden, residual = model(self.token_ids[:bs], self.positions[:bs], self.hidden_in[:bs],
                                         self.residual_in[:bs])
            else:
                hidden, residual = model(self.token_ids[:bs], self.positions[:bs])
        if self.stage_out:
            return hidden, residual
        if not self.with_head:
            return (hidden,)
        logits = model.lm_head.compute_logits(hidden)  # [bs, V]: one rank holds the whole head
        return logits, Sampler.greedy_pack(logits)

    def can_run(self, out: SchedulerOutput) -> bool:
        seqs = out.seqs
        return (0 < len(seqs) <= self.max_bs and all(len(s.token_ids) == 1 and s.sample for s in seqs)
                and all(len(s.block_table) <= self.max_blocks for s in seqs))

    def _staging(self) -> tuple[int, torch.Tensor]:
        """This replay's pinned staging buffer (its index and itself), once the GPU has copied what it held last."""
        i, self._turn = self._turn, self._turn ^ 1
        if self._copied[i] is None:
            self._copied[i] = torch.cuda.Event()
        else:
            self._copied[i].synchronize()
        return i, self._hosts[i]

    def run(self, out: SchedulerOutput, token_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Replay the decode step; returns the B real rows' logits [B, V] and greedy (token, logprob)
        [B, 2], or without the head (`with_head`) their hidden states [B, d], or before the last pipeline stage
        their (hidden, residual) (views of the graph's buffers: the next replay rewrites them). token_ids: the B
        input tokens on the device (the sequences' own are then not read), e.g. a draft model's last argmax.
        hidden, residual [B, d]: a later pipeline stage's input from the stage before."""
        seqs = out.seqs
        b = len(seqs)
        bs = next(s for s in self.batch_sizes if s >= b)
        staging, host = self._staging()
        n, h, page, mb = self.max_bs, host.numpy(), self.block_size, self.max_blocks
        pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=b)
        if token_ids is None:
            h[0:b] = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=b)
        h[n:n + b] = pos
        h[2 * n:2 * n + b] = [s.block_table[p // page] * page + p % page for s, p in zip(seqs, pos.tolist())]
        h[2 * n + b:2 * n + bs] = -1
        h[3 * n:3 * n + b] = pos + 1
        h[3 * n + b:3 * n + bs] = 0
        tables = h[self._small:self._small + bs * mb].reshape(bs, mb)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        used = self._small + bs * mb  # the small fields and the first bs block-table rows: one contiguous copy
        self.buf[:used].copy_(host[:used], non_blocking=True)
        self._copied[staging].record()
        if token_ids is not None:  # after the host copy (same stream), which wrote stale tokens there
            self.token_ids[:b].copy_(token_ids)
        if self.stage_in:
            self.hidden_in[:b].copy_(hidden)
            self.residual_in[:b].copy_(residual)
        self.graphs[bs].replay()
        return tuple(t[:b] for t in self.outputs[bs])


def graph_safe(runner) -> bool:
    """On CUDA, eager mode off, and a model and attention backend that never sync with the host."""
    if runner.device.type != "cuda" or getattr(runner.config.model, "enforce_eager", False):
        return False
    if getattr(runner.backend, "name", "") != "triton":
        log.info("CUDA graphs off: attention backend %r syncs with the host", getattr(runner.backend, "name", "?"))
        return False
    from workers.models.moe import Experts

    for m in runner.model.modules():
        if isinstance(m, Experts) and not getattr(m, "graph_safe", False):
            log.info("CUDA graphs off: the MoE expert loop syncs with the host (fused MoE unavailable)")
            return False
    return True


def maybe_capture(runner) -> DecodeGraphs | None:
    """Capture decode graphs when the runner is on CUDA, eager mode is off and the model is graph-safe."""
    if not graph_safe(runner):
        return None
    max_bs = min(runner.config.scheduler.max_num_seqs, 512)
    return DecodeGraphs(runner, batch_size_ladder(max_bs))
