"""CUDA graphs for the steps decode graphs do not take: prefill chunks and mixed batches, split at attention.

Why: an eager step launches a dozen kernels per layer from Python, ~1 ms of host time per layer with
Triton's launcher. On an H200 (Llama-3.1-8B shapes, 2026-11-26) a mixed step of ~600 tokens kept the GPU
busy 15 ms of its 51: the step was bound by the host, and under TP, where each GPU's work halves and the
host's does not, more so (docs/benchmarks.md). Here everything between two attention calls is one graph
(o_proj, its all-reduce, the residual add and norm, the MLP and its all-reduce, the next layer's norm, QKV
projection and RoPE): a step replays L + 1 graphs and runs only attention eagerly, whose grid depends on
the step's sequences (vLLM's "piecewise" graphs, without torch.compile: the split is at `PagedAttention`).

Graphs are captured per token count of a ladder (`token_ladder`); a step of n tokens replays the smallest
size >= n, its rows past n padding whose results are never read (every op but attention is row-wise, and
attention runs eagerly on the n real rows). Attention's inputs and output go through one set of buffers
shared by all layers: a graph copies q, k and v in, attention writes the output the next graph reads.
"""
from __future__ import annotations

import logging
import time

import torch

from workers.attention import AttentionMetadata, forward_context
from workers.cuda_graphs import capture_session
from workers.models.layers import PagedAttention

log = logging.getLogger(__name__)


def token_ladder(max_tokens: int) -> list[int]:
    """Token counts to capture: 16, 32, 64, then every 64 to 512 and every 128 above, capped at max_tokens."""
    sizes = [16, 32] + list(range(64, 513, 64)) + list(range(640, max_tokens + 1, 128))
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class PiecewiseGraphs:
    """One graph list per token count: graphs[n][0] runs up to the first attention, graphs[n][i + 1] from
    attention i to attention i + 1 (the last to the end of the forward); `calls[n][i]` is attention i's layer."""

    def __init__(self, runner, token_sizes: list[int]):
        self.runner = runner
        self.model = runner.model
        self.token_sizes = sorted(token_sizes)
        self.max_tokens = n = self.token_sizes[-1]
        device, dtype = runner.device, runner.dtype
        self.token_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.first_stage = self.model.is_first_stage
        d = self.model.config.hidden_size
        # A later pipeline stage starts from the previous stage's (hidden, residual)
        self.hidden_in = None if self.first_stage else torch.zeros(n, d, dtype=dtype, device=device)
        self.residual_in = None if self.first_stage else torch.zeros(n, d, dtype=dtype, device=device)
        a = runner.attn_layers[0]
        self.q = torch.zeros(n, a.num_heads, a.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(n, a.num_kv_heads, a.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.out = torch.zeros_like(self.q)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.calls: dict[int, list[PagedAttention]] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.replays = 0  # steps (micro-batches) run through the graphs
        self._capture()

    # ---- capture ----
    def _dummy_meta(self, t: int) -> AttentionMetadata:
        """Nothing reads it (attention is intercepted while capturing); the forward context must exist."""
        zeros = self.token_ids[:1].to(torch.int32)
        return AttentionMetadata(slot_mapping=self.token_ids[:t], query_start_loc=zeros, seq_lens=zeros, block_tables=zeros,
                                 query_lens_cpu=[t], seq_lens_cpu=[t], max_query_len=t, max_seq_len=t)

    def _forward(self, t: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        with forward_context(self._dummy_meta(t)):
            if self.first_stage:
                return self.model(self.token_ids[:t], self.positions[:t])
            return self.model(self.token_ids[:t], self.positions[:t], self.hidden_in[:t], self.residual_in[:t])

    def _into_buffers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[0]
        self.q[:t].copy_(q)
        self.k[:t].copy_(k)
        self.v[:t].copy_(v)
        return self.out[:t]

    @torch.inference_mode()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        try:
            with capture_session() as (pool, _):
                for t in reversed(self.token_sizes):  # largest first: the smaller ones reuse its pool
                    self._capture_size(t, pool)
        finally:
            PagedAttention.intercept = None
        log.info("captured piecewise CUDA graphs for %d token counts (%d..%d), %d layers each, in %.1f s",
                 len(self.graphs), self.token_sizes[0], self.max_tokens, len(self.calls[self.max_tokens]),
                 time.perf_counter() - t0)

    def _capture_size(self, t: int, pool) -> None:
        """Graphs of one token count, on the capture stream (`capture_begin` captures the current one)."""
        PagedAttention.intercept = lambda layer, q, k, v: self._into_buffers(q, k, v)
        for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels for this size
            self._forward(t)
        graphs = [torch.cuda.CUDAGraph()]
        calls: list[PagedAttention] = []
        capturing = [False]  # whether graphs[-1] is being captured (an error may come between two pieces)

        def begin() -> None:
            graphs[-1].capture_begin(pool=pool)
            capturing[0] = True

        def end() -> None:
            capturing[0] = False
            graphs[-1].capture_end()

        def split(layer: PagedAttention, q, k, v) -> torch.Tensor:
            out = self._into_buffers(q, k, v)
            end()
            calls.append(layer)
            graphs.append(torch.cuda.CUDAGraph())
            begin()
            return out

        PagedAttention.intercept = split
        begin()
        try:
            hidden, residual = self._forward(t)
        finally:
            if capturing[0]:
                end()
            PagedAttention.intercept = None
        self.graphs[t], self.calls[t], self.outputs[t] = graphs, calls, (hidden, residual)

    # ---- replay ----
    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward for n <= max_tokens tokens: (hidden, residual) as `CausalLM.forward` returns
        them, views of buffers the next run overwrites (copy what must outlive it, e.g. a pipeline send)."""
        n = token_ids.shape[0]
        t = next(s for s in self.token_sizes if s >= n)
        self.token_ids[:n].copy_(token_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if not self.first_stage:
            self.hidden_in[:n].copy_(hidden)
            self.residual_in[:n].copy_(residual)
        q, k, v, out = self.q[:n], self.k[:n], self.v[:n], self.out[:n]
        graphs = self.graphs[t]
        graphs[0].replay()
        for i, layer in enumerate(self.calls[t]):
            layer.backend.forward(q, k, v, layer.kv_cache, meta, layer.scale, out=out)
            graphs[i + 1].replay()
        self.replays += 1
        h, r = self.outputs[t]
        return h[:n], (r[:n] if r is not None else None)


def max_graph_tokens(runner) -> int:
    """The largest token count to capture; 0 where piecewise graphs do not apply: off CUDA, enforce_eager,
    a model or backend that syncs with the host, or sequence parallelism (its attention talks to other ranks)."""
    from workers.cuda_graphs import graph_safe

    max_tokens = min(runner.config.model.cuda_graph_max_tokens, runner.config.scheduler.max_num_batched_tokens)
    if max_tokens <= 0 or runner.sp.size > 1 or not graph_safe(runner):
        return 0
    return max_tokens


def maybe_capture(runner) -> PiecewiseGraphs | None:
    max_tokens = max_graph_tokens(runner)
    if max_tokens == 0:
        return None
    try:
        return PiecewiseGraphs(runner, token_ladder(max_tokens))
    except torch.OutOfMemoryError as e:  # the graphs' activations did not fit beside the KV cache
        PagedAttention.intercept = None
        torch.cuda.empty_cache()
        log.warning("piecewise CUDA graphs off: capture ran out of memory (%s); lower cuda_graph_max_tokens or "
                    "gpu_memory_utilization", str(e).splitlines()[0])
        return None
