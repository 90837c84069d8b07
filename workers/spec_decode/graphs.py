"""CUDA graphs for verification steps: every sequence runs q = k + 1 tokens, one graph per batch size.

A speculative step whose sequences all sample and run at most q tokens each (a speculating sequence:
its last token and its drafts; a plain decode, or a shorter proposal, is padded to q) replays the
graph of the smallest captured batch size >= B. Padding tokens and padding rows have cache slot -1 (the
KV write skips them) and come after the real tokens, so causal attention keeps them out of the real
rows; their logits are never read. The prefill attention kernel reads each sequence's context length
and query span from device tensors, and its grid depends only on q: a fixed shape per graph, no host
reads. As for decode graphs (workers/cuda_graphs.py), every per-step input lives in one int64 device
buffer filled by one non-blocking copy from a pinned host mirror.

An eager step costs an 8B model about 20 ms of host work on an H100 against 6 ms for a graphed decode
(docs/benchmarks.md, "Speculative decoding"), so without these graphs verification never pays.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from parallel.state import tp_group
from workers.attention import AttentionMetadata, forward_context
from workers.cuda_graphs import capture_per_batch
from workers.sampler import Sampler
from workers.scheduler_output import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)


class VerifyGraphs:
    def __init__(self, runner, q: int, batch_sizes: list[int]):
        self.runner = runner
        self.q = q
        self.device = runner.device
        self.block_size = runner.block_size
        self.max_blocks = -(-runner.max_model_len // self.block_size)
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = n = self.batch_sizes[-1]
        t = n * q
        # [tokens (t) | positions (t) | slots (t) | seq_lens (n) | query_start (n + 1) | block_tables (n * max_blocks)]
        self._small = 3 * t + 2 * n + 1
        total = self._small + n * self.max_blocks
        self.host = torch.zeros(total, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.host_np = self.host.numpy()
        self.buf = torch.zeros(total, dtype=torch.int64, device=self.device)
        self.token_ids = self.buf[0:t]
        self.positions = self.buf[t:2 * t]
        self.slots = self.buf[2 * t:3 * t]
        self.seq_lens = self.buf[3 * t:3 * t + n]
        self.query_start = self.buf[3 * t + n:3 * t + 2 * n + 1]
        self.block_tables = self.buf[self._small:].view(n, self.max_blocks)
        h = self.host_np
        h[t:2 * t] = np.tile(np.arange(q), n)  # padding rows: positions 0..q-1, context 0
        h[2 * t:3 * t] = -1
        h[3 * t:3 * t + n] = q
        h[3 * t + n:3 * t + 2 * n + 1] = np.arange(n + 1) * q
        self.buf.copy_(self.host)
        self.with_head = tp_group().size == 1  # else the graph ends at the hidden states, the head runs eagerly
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # bs -> (logits [bs * q, V], greedy (argmax, logprob) [bs * q, 2]) with the head, else (hidden [bs * q, d],)
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        """Inside the captured step: the int32 copies (as the eager path passes them) are kernels of the
        graph. The prefill kernel needs them: int64 query offsets reach its TMA block loads, which take
        32-bit offsets only (an H100 run failed to compile with them)."""
        L = self.runner.max_model_len
        return AttentionMetadata(
            slot_mapping=self.slots[:bs * self.q], query_start_loc=self.query_start[:bs + 1].to(torch.int32),
            seq_lens=self.seq_lens[:bs].to(torch.int32), block_tables=self.block_tables[:bs].to(torch.int32),
            query_lens_cpu=[self.q] * bs, seq_lens_cpu=[L] * bs, max_query_len=self.q, max_seq_len=L, num_decodes=0)

    def _step(self, bs: int) -> tuple[torch.Tensor, ...]:
        model = self.runner.model
        with forward_context(self._meta(bs)):
            hidden, _ = model(self.token_ids[:bs * self.q], self.positions[:bs * self.q])
        if not self.with_head:
            return (hidden,)
        # Every row's argmax and its logprob in the replay too: an all-greedy step then needs one small copy
        # to the host and no eager kernel (`verify_greedy`); others read the logits.
        logits = model.lm_head.compute_logits(hidden)
        return logits, Sampler.greedy_pack(logits)

    @torch.inference_mode()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        self.graphs, self.outputs = capture_per_batch(self.batch_sizes, self._step)
        log.info("captured %d verification CUDA graphs (%d tokens per sequence, batch %d..%d) in %.1f s",
                 len(self.graphs), self.q, self.batch_sizes[0], self.max_bs, time.perf_counter() - t0)

    def can_run(self, out: SchedulerOutput) -> bool:
        seqs = out.seqs
        return (0 < len(seqs) <= self.max_bs and any(s.spec_token_ids for s in seqs)
                and all(s.sample and len(s.token_ids) <= self.q and len(s.block_table) <= self.max_blocks for s in seqs))

    def run(self, out: SchedulerOutput) -> tuple[tuple[torch.Tensor, ...], list[int]]:
        """Replay; returns the graph's outputs (`outputs`, [bs * q, ...] each) and, sequence by sequence, the
        rows the runner verifies or samples from (len(spec_token_ids) + 1 each, as `ModelRunner.prepare` picks them)."""
        seqs = out.seqs
        b, q = len(seqs), self.q
        bs = next(s for s in self.batch_sizes if s >= b)
        t, h, page, mb = self.max_bs * q, self.host_np, self.block_size, self.max_blocks
        rows: list[int] = []
        tables = h[self._small:self._small + bs * mb].reshape(bs, mb)
        for i, s in enumerate(seqs):
            m, start, table = len(s.token_ids), s.start_pos, s.block_table
            base = i * q
            h[base:base + m] = s.token_ids
            h[base + m:base + q] = s.token_ids[-1]  # padding: any valid id
            h[t + base:t + base + m] = np.arange(start, start + m)
            h[t + base + m:t + base + q] = start + m - 1  # a valid position (rope) even at max_model_len
            h[2 * t + base:2 * t + base + m] = [table[p // page] * page + p % page for p in range(start, start + m)]
            h[2 * t + base + m:2 * t + base + q] = -1
            h[3 * t + i] = start + q
            tables[i, :len(table)] = table
            # the rows the eager path samples: a speculating sequence's last token and drafts, else its last
            # token (a prompt's short final chunk can ride along)
            rows.extend(range(base + m - 1 - len(s.spec_token_ids), base + m))
        # padding rows: no KV writes, no context (a larger batch may have left real values there)
        h[2 * t + b * q:2 * t + bs * q] = -1
        h[3 * t + b:3 * t + bs] = q
        used = self._small + bs * mb
        self.buf[:used].copy_(self.host[:used], non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs], rows


def verify_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (speculation runs only below its batch-size limit)."""
    sizes = [1, 2, 4] + list(range(8, max_batch, 8))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def maybe_capture_verify(runner, k: int, max_batch: int) -> VerifyGraphs | None:
    """Verification graphs for k drafts per sequence, checked once against the eager path on scratch
    blocks (the cache is empty at start-up); None where decode graphs are off or the check fails."""
    if runner.cuda_graphs is None or max_batch < 1 or tp_group().size > 1:
        return None  # under TP the check below would gather logits out of step with the other ranks
    try:
        graphs = VerifyGraphs(runner, k + 1, verify_batch_sizes(max_batch))
        if not _agrees_with_eager(runner, graphs, k):
            log.error("verification CUDA graphs disagree with the eager path: speculation runs eagerly")
            return None
        return graphs
    except Exception:  # noqa: BLE001 - speculation still works eagerly; the reason is logged
        log.exception("could not capture verification CUDA graphs: speculation runs eagerly")
        return None


@torch.inference_mode()
def _agrees_with_eager(runner, graphs: VerifyGraphs, k: int) -> bool:
    from workers.sampling_params import SamplingParams

    bs = runner.block_size
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    nb = -(-(40 + k + 1) // bs)
    if 2 * nb > runner.num_blocks:
        return True  # too small a cache to check; the graphs run the same model code
    g = torch.Generator().manual_seed(0)
    seqs = [ScheduledSeq(f"check{i}", torch.randint(3, 100, (k + 1 - i if k > i else 1,), generator=g).tolist(), 40 - i,
                         list(range(i * nb, (i + 1) * nb)), True, greedy, 1) for i in range(2)]
    for s in seqs:
        s.spec_token_ids = s.token_ids[1:]
    out = SchedulerOutput(seqs)
    outputs, rows = graphs.run(out)
    graphed = outputs[0][rows].float()
    saved, runner.verify_graphs = getattr(runner, "verify_graphs", None), None
    try:
        eager = runner.logits_of(out).float()
    finally:
        runner.verify_graphs = saved
    same_argmax = (graphed.argmax(-1) == eager.argmax(-1)).float().mean().item()
    scale = eager.abs().max().item() + 1e-6
    return same_argmax >= 0.9 and (graphed - eager).abs().max().item() <= 0.05 * scale
