"""Turns a `SchedulerOutput` into tensors, runs the model over the paged KV cache, and samples.

One runner per rank. It owns the model's weights (this rank's shard) and the KV cache memory:
kv_cache [num_layers_of_this_stage, 2, num_blocks, block_size, num_kv_heads_per_rank, head_dim].
With pipeline parallelism the step's batch runs as micro-batches; activations (hidden states and
residual) travel from stage to stage through `parallel/pp.py`, and only the last stage samples.
"""
from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import torch

from parallel.p2p_allreduce import (enable_p2p_all_reduce, enable_pushed_all_reduce, enable_pushed_greedy,
                                    enable_pushed_partials)
from parallel.pp import PendingSend, recv_from_prev_stage, send_to_next_stage
from parallel.state import pp_group, sp_group, tp_group
from workers.attention import AttentionMetadata, forward_context, get_backend
from workers.attention.sp_backend import SequenceParallelAttention
from workers.config import EngineConfig
from workers.loader import load_model
from workers.microbatch import split_by_sequence
from workers.models.fused_decode import pushed_sites
from workers.models.layers import PagedAttention
from workers.host_fetch import host_lists
from workers.launched_step import LaunchedStep
from workers.sampler import Sampler, no_top_logprobs
from workers.sampling_params import SamplingParams
from workers.scheduler_output import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput, TokenBitmask
from workers.structured_output import apply_token_bitmask, is_constrained
from workers.prompt_logprobs import compute_prompt_logprobs, wants_prompt_logprobs
from parallel.ulysses import choose_ulysses
from workers.sp_plan import gather_sample_hidden, plan_sp_step, sample_owner
from workers.step_delta import tp_own_fill_enabled
from workers.step_memory import NewPeakRelease, graph_pool_bytes, kv_budget_bytes
from workers.spec_decode.verify import verify, verify_greedy

log = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def _sample_rows(seqs: list[ScheduledSeq], ends: np.ndarray) -> list[int]:
    """The rows of a step's flat tokens that are sampled: each sampled sequence's last token, and a speculating
    one's drafts too (it is verified at its last token and at each draft). `ends`: each sequence's end row + 1."""
    if any(s.spec_token_ids for s in seqs):
        rows: list[int] = []
        for s, end in zip(seqs, ends.tolist()):
            if s.sample:
                rows.extend(range(end - 1 - len(s.spec_token_ids), end))
        return rows
    return (ends[np.fromiter((s.sample for s in seqs), dtype=bool, count=len(seqs))] - 1).tolist()


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, max_model_len: int, eos_token_ids: list[int], show_progress: bool = True):
        self.step_phases: dict[str, float] = {}  # the last eager step's host seconds by phase (`_run_step`)
        self.config = config
        self.device = config.model.resolved_device()
        self.dtype = config.model.resolved_dtype(hf_config)
        self.kv_dtype = torch.float8_e4m3fn if config.cache.kv_cache_dtype.startswith("fp8") else self.dtype
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        if self.device.type == "cuda":
            if self.device.index is None:  # the current device: a rank that sees its node's GPUs has chosen its own
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self._watch_compiles(False)  # this runner's start-up compiles (a draft model's, after the target's start)
        if self.device.type == "cuda" and tp_group().size > 1 and not config.parallel.disable_p2p_all_reduce:
            if enable_p2p_all_reduce(tp_group(), self.device, self.dtype) and pp_group().size == 1:
                # the batch-1 fused decoder's two row-parallel outputs a layer, pushed instead of all-reduced
                enable_pushed_partials(tp_group(), self.device, self.dtype, hf_config.hidden_size,
                                       pushed_sites(hf_config.num_hidden_layers))
                enable_pushed_greedy(tp_group(), self.device, config.scheduler.max_num_seqs)
                # TANDEM_P2P_PUSHED (opt-in): the larger all-reduces on the pushed kernel, up to a step's tokens
                enable_pushed_all_reduce(tp_group(), self.device, self.dtype,
                                         config.scheduler.max_num_batched_tokens * hf_config.hidden_size)
        self.model = load_model(hf_config, config.model.model, self.dtype, self.device, max_model_len,
                                config.model.load_format, config.model.seed, show_progress,
                                quantization_config=config.model.quantization_config())
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.sp = sp_group()
        # Under SP each rank holds part of every sequence's KV: attention goes through the SP backend.
        if self.sp.size > 1 and self.kv_dtype != self.dtype:
            raise ValueError(f"kv_cache_dtype={config.cache.kv_cache_dtype!r} with sequence parallelism is not supported yet")
        self.backend = SequenceParallelAttention() if self.sp.size > 1 else get_backend(config.model.attention_backend, self.device)
        a = self.attn_layers[0] if self.attn_layers else None
        self.sp_ulysses = a is not None and choose_ulysses(config.parallel.sequence_parallel_attention, a.num_heads,
                                                           a.num_kv_heads, self.sp.size)
        self.sampler = Sampler(eos_token_ids)
        self.pp = pp_group()
        # A TP-only replica's ranks all learn a plain greedy step's tokens (an all-gather of three numbers a row, not a
        # gather to the first rank), so each fills the next step sent ahead itself (cluster/rank_worker.py).
        self.greedy_everywhere = (tp_group().size > 1 and self.pp.size == 1 and self.sp.size == 1
                                  and tp_own_fill_enabled())
        self._pp_seq_no = 0  # micro-batches sent/received so far: every stage counts the same
        # Micro-batches per step. Pipelined steps (EngineConfig.step_groups) keep the stages busy with other groups'
        # steps instead: a step runs whole, since each micro-batch of a decode step reads the weights again.
        self.pp_micro_batches = self.pp.size if config.step_groups == 1 else 1
        self._pp_sends: list[PendingSend] = []  # pipelined steps: sends to the next stage not yet complete (_keep_sends)
        # Before a step larger than any so far, the allocator's cache is emptied (workers/step_memory.py).
        self.new_peak_release = NewPeakRelease(torch.cuda.empty_cache if self.device.type == "cuda" else None)
        self.num_blocks = self._num_kv_blocks()
        self.kv_cache = self._allocate_kv_cache(self.num_blocks)
        self._warm_up_kernels()
        # TP ranks capture together in `resize_kv_cache` (a capture runs collectives), once the block count is agreed.
        self.cuda_graphs = self._capture_cuda_graphs() if tp_group().size == 1 else None
        self.piecewise_graphs = self._capture_piecewise_graphs() if tp_group().size == 1 else None
        self.verify_graphs = self._capture_verify_graphs()
        if tp_group().size == 1:
            self._watch_compiles(True)

    def _watch_compiles(self, on: bool) -> None:
        """On: start-up's compiles are over, so log each later one with its kernel and time (a step waits for it;
        parallel/kernels/compile_watch.py). Off while the KV cache is resized: that captures graphs again."""
        if self.device.type != "cuda":
            return
        from parallel.kernels import compile_watch

        if not on:
            compile_watch.disarm()
        elif compile_watch.install():
            compile_watch.arm()

    def _warm_up_kernels(self) -> None:
        """Compile the Triton kernels for every prefill tile size (16, 32, 64, 128 tokens; 512 for the
        fused MoE's GEMM tiles) and the mixed decode+prefill layout (decode context in one slice and in
        several) now, not while serving: each first use of a variant stalls its step for a compile (about
        a second; on an H100 the first 1,000-request offline run of an 8B model took 36 s against 21 s for
        the second). Runs real steps on scratch KV blocks, on every rank alike."""
        if self.device.type != "cuda" or getattr(self.backend, "name", "") != "triton":
            return
        from parallel.kernels.paged_attention import decode_block_n

        bs = self.block_size
        blocks = lambda first, tokens: list(range(first, first + -(-tokens // bs)))  # noqa: E731
        decode_ctx = 2 * decode_block_n(bs)  # two tiles: the decode kernel splits the context
        chunk_blocks = len(blocks(0, decode_ctx + 1))
        if self.num_blocks < chunk_blocks + len(blocks(0, 56)) or self.max_model_len <= decode_ctx:
            return  # too small for the mixed steps (the prefill sizes are filtered below)
        t0 = time.perf_counter()
        # 512 tokens: the fused MoE's middle GEMM tiles (the profiling step covers the largest)
        budget = min(self.max_model_len, self.config.scheduler.max_num_batched_tokens, self.num_blocks * bs)
        sizes = [n for n in (16, 32, 64, 128, 512) if n <= budget]  # never a bigger step than serving runs
        for n in sizes:
            self.execute(SchedulerOutput([ScheduledSeq("warm-up", [0] * n, 0, blocks(0, n), True, _GREEDY, 0)]))
        for ctx in (16, decode_ctx):
            decode = ScheduledSeq("warm-up-decode", [0], ctx, blocks(0, ctx + 1), True, _GREEDY, 1)
            chunk = ScheduledSeq("warm-up-chunk", [0] * 40, 16, blocks(chunk_blocks, 56), True, _GREEDY, 0)
            self.execute(SchedulerOutput([decode, chunk]))
        self._warm_up_split_counts(blocks)
        torch.cuda.synchronize()
        log.info("Triton kernels warmed up in %.1f s", time.perf_counter() - t0)

    def _warm_up_split_counts(self, blocks) -> None:
        """A decode row's context, and that of a sequence running 2..16 new tokens (the split-context kernel of
        parallel/kernels/verify_attention.py), is cut into 1..64 slices by its length (`num_decode_splits`), and
        each count is a variant of the merge kernel. The decode graphs compile the counts their batch sizes take;
        an eager step meets others: one long decode beside a prefill chunk, or a prompt's last few tokens. On
        2 x H100 such a first use stalled its step 1.06 s (the compile watch's log; issues 26, 27). One step per count compiles them:
        a decode at a context of 64 x 2^k tokens beside 8 new tokens after as many."""
        few = 8
        longest = self.max_model_len - few  # its count too: 1,000 tokens are cut in 16, not 8
        for ctx in sorted({min(64 << k, longest) for k in range(7)}):
            if ctx < 16 or 2 * len(blocks(0, ctx + few)) > self.num_blocks:
                break
            second = len(blocks(0, ctx + 1))
            decode = ScheduledSeq("warm-up-decode", [0], ctx, blocks(0, ctx + 1), True, _GREEDY, 1)
            tail = ScheduledSeq("warm-up-tail", [0] * few, ctx, blocks(second, ctx + few), True, _GREEDY, 0)
            self.execute(SchedulerOutput([decode, tail]))

    def _capture_cuda_graphs(self):
        """Decode CUDA graphs (workers/cuda_graphs.py) on CUDA, alone, under TP, or per pipeline stage where
        steps are pipelined (one micro-batch a step: each stage replays its part of the whole step, the
        activations passed between the replays); None where they don't apply: a step cut into micro-batches,
        and SP attention (and EP's dispatch over SP ranks), which size their messages on the host. EP over the
        TP group is an all-reduce."""
        if self.device.type != "cuda" or self.pp_micro_batches > 1 or sp_group().size > 1:
            return None
        from workers.cuda_graphs import maybe_capture

        return maybe_capture(self)

    def _capture_piecewise_graphs(self):
        """Prefill and mixed steps' graphs, split at attention (workers/piecewise_graphs.py); any TP or PP size."""
        if self.device.type != "cuda":
            return None
        from workers.piecewise_graphs import maybe_capture

        graphs = maybe_capture(self)
        if graphs is not None:
            # Attention now reads q/k/v from the graphs' contiguous buffers, not from views of the QKV
            # projection: other strides, other Triton variants. Compile them now, not on a first request.
            self.piecewise_graphs = graphs
            self._warm_up_kernels()
        return graphs

    def _capture_verify_graphs(self):
        """Speculative decoding's verification steps in CUDA graphs (workers/spec_decode/graphs.py), for the
        batch sizes that speculate; None without speculation, where decode graphs are off, or under TP."""
        spec = self.config.speculative.spec
        if spec is None or self.cuda_graphs is None or self.pp.size > 1:
            return None
        from workers.spec_decode.graphs import maybe_capture_verify

        max_batch = min(self.config.scheduler.max_num_seqs, spec.batch_size_limit(self.device.type) - 1, 256)
        return maybe_capture_verify(self, spec.num_speculative_tokens, max_batch)

    @torch.inference_mode()
    def logits_of(self, out: SchedulerOutput) -> torch.Tensor:
        """The eager forward of one single-rank step: logits at its sample rows (each verified row)."""
        token_ids, positions, meta, rows = self.prepare(out)
        with forward_context(meta):
            hidden, _ = self.model(token_ids, positions, None, None)
        return self.model.lm_head.compute_logits(hidden[rows])

    @property
    def is_output_rank(self) -> bool:
        """The rank whose `execute` returns the sampled tokens: last pipeline stage, first TP/SP rank."""
        return self.pp.is_last and tp_group().is_first and sp_group().is_first

    # ---- KV cache ----
    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        a = self.attn_layers[0]
        kv_cache = torch.zeros(len(self.attn_layers), 2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim,
                               dtype=self.kv_dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.kv_cache, layer.backend = kv_cache[i], self.backend
        return kv_cache

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Shrink to the block count every rank can hold (block ids are shared across ranks).

        A multi-rank executor calls this on every rank at once after start-up, even when the count is
        unchanged: that is when TP ranks capture their decode graphs, all together."""
        if num_blocks > self.num_blocks:
            raise ValueError(f"cannot grow the KV cache from {self.num_blocks} to {num_blocks} blocks")
        self._watch_compiles(False)
        if num_blocks < self.num_blocks:
            for layer in self.attn_layers:
                layer.kv_cache = None
            self.cuda_graphs = self.verify_graphs = self.piecewise_graphs = None  # they read the old cache's addresses
            del self.kv_cache  # freed before the smaller one is made, so peak memory does not double
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
                self.new_peak_release.reset()
            self.num_blocks = num_blocks
            self.kv_cache = self._allocate_kv_cache(num_blocks)
        if self.cuda_graphs is None:
            self.cuda_graphs = self._capture_cuda_graphs()
            self.verify_graphs = self._capture_verify_graphs()
        if self.piecewise_graphs is None:
            self.piecewise_graphs = self._capture_piecewise_graphs()
        self._watch_compiles(True)

    def kv_bytes_per_block(self) -> int:
        a = self.attn_layers[0]
        return 2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_dim * self.kv_dtype.itemsize

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            budget = self._gpu_kv_budget()
        else:
            budget = cache.cpu_kv_cache_bytes
        # More blocks than every sequence at full length could use is wasted memory.
        cap = self.config.scheduler.max_num_seqs * -(-self.max_model_len // self.block_size)
        num = min(budget // per_block, cap)
        if num < -(-self.max_model_len // self.block_size):
            log.warning("KV cache of %d blocks cannot hold one sequence of max_model_len=%d", num, self.max_model_len)
        if num < 1:
            raise ValueError(f"KV budget of {budget} bytes holds no block of {per_block} bytes; raise the memory budget")
        return int(num)

    def _gpu_kv_budget(self) -> int:
        """The utilisation's share of the GPU, less what the weights and a full-size step hold: the
        allocator's peak *reserved* bytes, its split and waiting blocks too (workers/step_memory.py)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the peak starts from the weights alone
        torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated()
        probe_bytes = self._run_profile_step()
        torch.cuda.synchronize()
        peak_reserved, peak_allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        self.new_peak_release.reset()  # the cache is empty: the next step lays out its own segments, as this one did
        _, total = torch.cuda.mem_get_info()
        utilization = self.config.cache.gpu_memory_utilization
        # Piecewise graphs keep the activations of their largest step for good, beside any eager step's.
        from workers.piecewise_graphs import max_graph_tokens

        activations = peak_reserved - probe_bytes - weights
        graphs = graph_pool_bytes(activations, max_graph_tokens(self), min(self.config.scheduler.max_num_batched_tokens,
                                                                           self.max_model_len))
        budget = kv_budget_bytes(total, utilization, peak_reserved + graphs, probe_bytes)
        gib = 1 << 30
        log.info("KV budget %.2f GiB = %.2f x %.2f GiB - %.2f GiB reserved at the profiling step's peak "
                 "(weights included; %.2f GiB of it allocated) - %.2f GiB for piecewise CUDA graphs", budget / gib,
                 utilization, total / gib, (peak_reserved - probe_bytes) / gib, (peak_allocated - probe_bytes) / gib,
                 graphs / gib)
        return budget

    def _run_profile_step(self) -> int:
        """Run the largest step serving can schedule (one max_num_batched_tokens prompt) on scratch KV,
        on any device; returns the scratch KV's bytes. Under SP this is a full ring-attention prefill of
        that prompt, whose attention is blockwise: its activations grow with the prompt, not its square."""
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        probe_blocks = -(-n // self.block_size)
        a = self.attn_layers[0]
        probe = torch.zeros(len(self.attn_layers), 2, probe_blocks, self.block_size, a.num_kv_heads, a.head_dim,
                            dtype=self.kv_dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.kv_cache, layer.backend = probe[i], self.backend
        fake = ScheduledSeq("profile", [0] * n, 0, list(range(probe_blocks)), True, _GREEDY, 0)
        self.execute(SchedulerOutput([fake]))
        probe_bytes = probe.numel() * probe.element_size()
        del probe
        for layer in self.attn_layers:
            layer.kv_cache = None
        return probe_bytes

    # ---- one step ----
    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        if self.sp.size > 1:  # only the tokens this SP rank owns (workers/sp_plan.py)
            blocks_per_rank = self.attn_layers[0].kv_cache.shape[1]
            return plan_sp_step(out.seqs, self.block_size, blocks_per_rank, self.sp, self.device, self.sp_ulysses)
        return self._prepare_flat(out.seqs)

    def _prepare_flat(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The step's tokens laid end to end. Built with numpy, not per-token Python: a mixed step of ~250
        sequences and ~800 tokens is built on every rank before each forward, and the GPU waits for it."""
        b, bs = len(seqs), self.block_size
        # Per-sequence Python is kept to one pass per field (no properties, no per-row numpy assignment):
        # the block tables go in with one masked assignment (~30% less host time a step of ~230 sequences, on CPU).
        query_lens = [len(s.token_ids) for s in seqs]
        lens = np.array(query_lens, dtype=np.int64)
        starts = np.array([s.start_pos for s in seqs], dtype=np.int64)
        query_start = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(lens, out=query_start[1:])
        total = int(query_start[-1])
        seq_lens_np = starts + lens
        seq_lens = seq_lens_np.tolist()
        token_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64, count=total)
        row = np.repeat(np.arange(b), lens)  # each token's sequence
        positions = np.arange(total, dtype=np.int64) - query_start[row] + starts[row]
        block_tables = [s.block_table for s in seqs]
        num_blocks = np.array([len(t) for t in block_tables], dtype=np.int64)
        tables = np.zeros((b, int(num_blocks.max())), dtype=np.int32)
        # Row-major order of the mask's True cells is each table's entries in sequence order.
        tables[np.arange(tables.shape[1]) < num_blocks[:, None]] = np.fromiter(
            itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(num_blocks.sum()))
        slots = tables[row, positions // bs].astype(np.int64) * bs + positions % bs
        sample_rows = _sample_rows(seqs, query_start[1:])
        num_decodes = 0
        while num_decodes < b and query_lens[num_decodes] == 1:
            num_decodes += 1

        def t(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(x).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=t(slots),
            query_start_loc=t(query_start.astype(np.int32)),
            seq_lens=t(seq_lens_np.astype(np.int32)),
            block_tables=t(tables),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
        )
        return t(token_ids), t(positions), meta, sample_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on this rank. Only `is_output_rank` returns the sampled tokens (and the prompt
        logprobs of the prefill chunks that asked for them); other ranks return an empty output, except that
        with `greedy_everywhere` every TP rank returns an all plain greedy step's tokens too."""
        self._prompt_logprobs = {}  # filled per micro-batch by _run_step (workers/prompt_logprobs.py)
        self.step_phases = {}  # an eager step's host seconds by phase (_run_step; rank profiles read them)
        result = self._run_step(out)
        if self.chunk_ends is not None:  # a prefill rank on a GPU: where its prompts' chunks end (KV in pieces)
            self.chunk_ends.record(out)
        if self._prompt_logprobs:
            result.prompt_logprobs = self._prompt_logprobs
        return result

    @torch.inference_mode()
    def launch_greedy(self, out: SchedulerOutput, token_ids: torch.Tensor | None = None,
                      mixed: bool = False) -> LaunchedStep | None:
        """Queue a plain greedy step on the device and return without waiting for its tokens (workers/launched_step.py):
        a decode step, and with `mixed` (TANDEM_LAUNCH_MIXED, on by default) one with prefill chunks too; None where `out` is not
        one, samples nothing, or this rank would not hold its tokens (then `execute` runs it). token_ids: a decode
        step's input tokens [len(out.seqs)] on the device, e.g. a launched step's `next_ids`, when the sequences' own
        are placeholders still. Returns the sampling sequences' tokens (in the order a whole step samples them:
        decodes first) on every rank that holds them: the only rank, or every rank of a TP-only replica
        (`greedy_everywhere`)."""
        seqs = out.seqs
        decode = all(len(s.token_ids) == 1 and s.sample for s in seqs)
        if (not seqs or not (decode or (mixed and token_ids is None)) or self.pp.size > 1 or self.sp.size > 1
                or self.chunk_ends is not None or self.config.speculative.spec is not None
                or not (tp_group().size == 1 or self.greedy_everywhere) or not self._all_greedy(out)
                or (not decode and (not any(s.sample for s in seqs) or any(wants_prompt_logprobs(s) for s in seqs)))):
            return None
        graphs = getattr(self, "cuda_graphs", None)
        if decode and graphs is not None and graphs.can_run(out):
            if graphs.with_head:
                packed = graphs.run(out, token_ids)[1].t()  # [2, B]
            else:
                packed = self._greedy_everywhere(graphs.run(out, token_ids)[0])
            return LaunchedStep([s.seq_id for s in seqs], packed, no_top_logprobs([s.sampling_params for s in seqs]))
        ordered = seqs if decode else sorted(seqs, key=lambda s: s.num_tokens != 1)  # decodes first, as `_run_step`
        self.new_peak_release.before_step(sum(s.num_tokens for s in seqs))
        own_ids, positions, meta, sample_rows = self._prepare_flat(ordered)
        hidden, _, _ = self._forward(own_ids if token_ids is None else token_ids, positions, meta, None, None)
        if not decode:  # the sampling sequences' last rows only
            hidden = hidden.index_select(0, self.on_device(sample_rows))
        if tp_group().size == 1:
            packed = Sampler.greedy_pack(self.model.lm_head.compute_logits(hidden)).t()
        else:  # every TP rank learns the tokens (the all-gathered greedy head)
            packed = self._greedy_everywhere(hidden)
        sampling = ordered if decode else [s for s in ordered if s.sample]
        return LaunchedStep([s.seq_id for s in sampling], packed, no_top_logprobs([s.sampling_params for s in sampling]),
                            mixed=not decode)

    def _greedy_everywhere(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head.greedy_packed(hidden, everywhere=True)

    def _run_step(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if out.is_empty:
            return ModelRunnerOutput({})
        verify_graphs = getattr(self, "verify_graphs", None)
        if verify_graphs is not None and verify_graphs.can_run(out):  # speculative decoding, graphed
            outputs, rows = verify_graphs.run(out)
            if len(outputs) == 2 and self._all_greedy(out):  # the replay's argmax per row is all it needs
                return self._verified(out.seqs, verify_greedy(outputs[1], rows, out.seqs))
            return self._verify_logits(outputs[0][rows], out.seqs, out.token_bitmask)
        graphs = getattr(self, "cuda_graphs", None)  # unset while the KV budget is being profiled
        if graphs is not None and graphs.can_run(out):
            if self.pp.size > 1:
                return self._run_stage_graph(graphs, out)
            if not graphs.with_head:  # TP: every rank replays, the head runs eagerly
                return self.sample(graphs.run(out)[0], out.seqs, out.token_bitmask)
            return self._sampled_in_graph(*graphs.run(out), out)
        seqs = out.seqs
        self.new_peak_release.before_step(sum(s.num_tokens for s in seqs))  # eager steps only: graphs allocate nothing
        if self.sp.size == 1:  # decodes first: attention runs them with the decode kernel (AttentionMetadata.num_decodes)
            seqs = sorted(seqs, key=lambda s: s.num_tokens != 1)
        # One micro-batch per stage keeps every stage busy once the pipeline is full (unless steps are pipelined).
        micro_batches = split_by_sequence(seqs, self.pp_micro_batches) if self.pp_micro_batches > 1 else [seqs]
        sends: list[PendingSend] = []
        sample_hidden: list[torch.Tensor] = []
        phases = self.step_phases = {"prepare": 0.0, "forward": 0.0, "sample": 0.0}
        for batch in micro_batches:
            t0 = time.perf_counter()
            token_ids, positions, meta, sample_rows = self.prepare(SchedulerOutput(batch))
            t1 = time.perf_counter()
            hidden = residual = None
            if not self.pp.is_first:
                hidden, residual = self._recv_activations(token_ids.shape[0])
            hidden, residual, graphed = self._forward(token_ids, positions, meta, hidden, residual)
            phases["prepare"] += t1 - t0
            phases["forward"] += time.perf_counter() - t1
            if self.pp.is_last and self.sp.size == 1 and any(wants_prompt_logprobs(s) for s in batch):
                self._prompt_logprobs.update(compute_prompt_logprobs(self.model.lm_head, batch, hidden))
            if not self.pp.is_last:
                if graphed:  # the graphs' output buffers are overwritten by the next micro-batch while this send runs
                    hidden, residual = hidden.clone(), residual.clone()
                sends.append(send_to_next_stage([hidden, residual], self._pp_seq_no, self.pp))
            elif sample_rows or self.sp.size > 1:
                sample_hidden.append(hidden.index_select(0, self.on_device(sample_rows)))
            self._pp_seq_no += 1
        if self.pp_micro_batches > 1:
            for pending in sends:
                pending.wait()
        elif sends:
            self._keep_sends(sends)
        to_sample = [s for s in seqs if s.sample]
        if not self.pp.is_last or not to_sample:
            return ModelRunnerOutput({})
        # Micro-batches are contiguous runs of seqs, so the rows line up with to_sample.
        hidden = torch.cat(sample_hidden)
        t0 = time.perf_counter()
        if self.sp.size > 1:  # the rows are spread over the SP ranks: the first one samples
            hidden = gather_sample_hidden(hidden, [sample_owner(s, self.block_size, self.sp.size) for s in to_sample], self.sp)
            if hidden is None:
                return ModelRunnerOutput({})
        result = self.sample(hidden, to_sample, out.token_bitmask)
        phases["sample"] = time.perf_counter() - t0  # with the wait for the device's tokens
        return result

    def _sampled_in_graph(self, logits: torch.Tensor, greedy: torch.Tensor, out: SchedulerOutput) -> ModelRunnerOutput:
        """A graph's step with the head in it: its greedy (token, logprob) columns serve plain greedy rows,
        anything else samples from its logits."""
        if all(Sampler.is_plain_greedy(s) for s in out.seqs) and not is_constrained(out.seqs, out.token_bitmask):
            columns = Sampler.greedy_columns(greedy, [s.sampling_params for s in out.seqs])
        else:
            apply_token_bitmask(logits, out.seqs, out.token_bitmask)  # structured output
            columns = self.sampler.columns(logits, out.seqs)
        return ModelRunnerOutput.from_columns([s.seq_id for s in out.seqs], *columns)

    def _run_stage_graph(self, graphs, out: SchedulerOutput) -> ModelRunnerOutput:
        """A pipeline stage's decode step in its CUDA graph: the stage before's activations in, this stage's out
        to the next (copies: the next replay rewrites the graph's buffers while the send may still read them), or
        sampled on the last stage. Eagerly this took 17 graph pieces and 16 attention launches a stage."""
        hidden = residual = None
        if not self.pp.is_first:
            hidden, residual = self._recv_activations(len(out.seqs))
        outputs = graphs.run(out, hidden=hidden, residual=residual)
        seq_no, self._pp_seq_no = self._pp_seq_no, self._pp_seq_no + 1
        if not self.pp.is_last:
            self._keep_sends([send_to_next_stage([t.clone() for t in outputs], seq_no, self.pp)])
            return ModelRunnerOutput({})
        if graphs.with_head:
            return self._sampled_in_graph(*outputs, out)
        return self.sample(outputs[0], out.seqs, out.token_bitmask)

    def on_device(self, rows: list[int]) -> torch.Tensor:
        """Row indices as a tensor on this runner's device, copied without a wait. Indexing a CUDA tensor with a
        Python list copies the list with a blocking copy, which waits for the whole forward queued before it: on
        2 x H200 a TP=2 rank's mixed step then sat 1.8-5.1 ms in `cudaStreamSynchronize` and left its GPU idle
        1.4-1.9 ms more while it launched the sampling (issue 26's traces)."""
        return torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(self.device, non_blocking=True)

    def _keep_sends(self, sends: list[PendingSend]) -> None:
        """Pipelined steps: a send to the next stage completes only once that stage receives it (gloo's send waits
        for the matching receive; NCCL's, on the GPU, too), which it does after finishing the step before. Waiting
        here would hold this stage's next step (another group's) behind the next stage's current one, so the sends
        are kept, their buffers alive, and dropped once complete; only past one outstanding step per stage does
        this stage wait for the oldest (a bound on the activations held)."""
        self._pp_sends = [p for p in self._pp_sends if not p.done()] + sends
        while len(self._pp_sends) > self.pp.size:
            self._pp_sends.pop(0).wait()

    def _forward(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 hidden: torch.Tensor | None, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The model's forward of one (micro-)batch: piecewise CUDA graphs where they cover its token count,
        else eager. Returns (hidden, residual, whether graphs ran)."""
        graphs = getattr(self, "piecewise_graphs", None)  # unset while the KV budget is being profiled
        with forward_context(meta):
            if graphs is not None and graphs.can_run(token_ids.shape[0]):
                return (*graphs.run(token_ids, positions, meta, hidden, residual), True)
            return (*self.model(token_ids, positions, hidden, residual), False)

    def _recv_activations(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = recv_from_prev_stage(self._pp_seq_no, self.pp, self.device)
        if hidden.shape[0] != num_tokens or residual.shape != hidden.shape:
            raise RuntimeError(f"pipeline stage {self.pp.rank} got activations {tuple(hidden.shape)}/{tuple(residual.shape)} "
                               f"for a micro-batch of {num_tokens} tokens")
        return hidden, residual

    def sample(self, hidden: torch.Tensor, seqs: list[ScheduledSeq], mask: TokenBitmask | None = None) -> ModelRunnerOutput:
        """hidden [len(seqs), d] at the sampled positions -> next tokens (on the output rank only).

        Under TP, a batch of plain greedy rows gathers (max, id, log-sum-exp) per rank instead of
        the full vocabulary; anything else gathers full logits to the first TP rank, where a grammar's
        bitmask (structured output) is applied before the sampler.
        """
        head = self.model.lm_head
        if any(s.spec_token_ids for s in seqs):  # speculative decoding: verify the drafts
            return self._verify(hidden, seqs, mask)
        if head.group.size > 1 and all(Sampler.is_plain_greedy(s) for s in seqs) and not is_constrained(seqs, mask):
            result = head.greedy_tokens(hidden, everywhere=self.greedy_everywhere)
            if result is None:
                return ModelRunnerOutput({})
            ids, logprobs = result
            return ModelRunnerOutput.from_columns([s.seq_id for s in seqs], *host_lists(ids, logprobs),
                                                  no_top_logprobs([s.sampling_params for s in seqs]))
        logits = head.compute_logits(hidden)
        if logits is None:
            return ModelRunnerOutput({})
        apply_token_bitmask(logits, seqs, mask)
        return ModelRunnerOutput.from_columns([s.seq_id for s in seqs], *self.sampler.columns(logits, seqs))

    def _verify(self, hidden: torch.Tensor, seqs: list[ScheduledSeq], mask: TokenBitmask | None = None) -> ModelRunnerOutput:
        """A step with speculating sequences: hidden has len(spec_token_ids) + 1 rows for each of them
        (one for the others). Their proposals are verified (workers/spec_decode/verify.py); the others
        sample as usual. Under TP the full logits meet on the first rank, as for any sampled batch."""
        logits = self.model.lm_head.compute_logits(hidden)
        if logits is None:
            return ModelRunnerOutput({})
        return self._verify_logits(logits, seqs, mask)

    @staticmethod
    def _all_greedy(out: SchedulerOutput) -> bool:
        return all(Sampler.is_plain_greedy(s) for s in out.seqs) and not is_constrained(out.seqs, out.token_bitmask)

    @staticmethod
    def _verified(seqs: list[ScheduledSeq], emitted: list[list[SampledToken]]) -> ModelRunnerOutput:
        """Each sequence's emitted tokens as the step's output: the first as its sampled token, all of a
        speculating sequence's in `spec`."""
        out = ModelRunnerOutput({})
        for s, toks in zip(seqs, emitted):
            out.sampled[s.seq_id] = toks[0]
            if s.spec_token_ids:
                out.spec[s.seq_id] = toks
        return out

    def _verify_logits(self, logits: torch.Tensor, seqs: list[ScheduledSeq], mask: TokenBitmask | None) -> ModelRunnerOutput:
        """logits: len(spec_token_ids) + 1 rows per sequence, in order. A grammar's mask (structured output)
        applies to the sequences that do not speculate (a constrained one never does)."""
        if all(Sampler.is_plain_greedy(s) for s in seqs) and not is_constrained(seqs, mask):
            return self._verified(seqs, verify_greedy(Sampler.greedy_pack(logits), list(range(logits.shape[0])), seqs))
        spec = [s for s in seqs if s.spec_token_ids]
        plain = [s for s in seqs if not s.spec_token_ids]
        spec_rows: list[int] = []
        plain_rows: list[int] = []
        row = 0
        for s in seqs:
            n = len(s.spec_token_ids) + 1
            (spec_rows if s.spec_token_ids else plain_rows).extend(range(row, row + n))
            row += n
        out = ModelRunnerOutput({})
        if plain:
            plain_logits = logits[plain_rows]
            apply_token_bitmask(plain_logits, plain, mask)
            out.sampled.update((s.seq_id, tok) for s, tok in zip(plain, self.sampler(plain_logits, plain)))
        for s, toks in zip(spec, verify(self.sampler, logits[spec_rows], spec)):
            out.sampled[s.seq_id] = toks[0]
            out.spec[s.seq_id] = toks
        return out

    chunk_ends = None  # workers/kv_transfer/chunk_ends.py, once `track_chunk_ends` made it

    def track_chunk_ends(self):
        """A prefill rank's record of where its prompts' chunks end on the engine stream, for the KV agent's piece
        sends (GPU only: on CPU a step's work is done when it returns). Made once, then returned again."""
        if self.chunk_ends is None and self.device.type == "cuda":
            from workers.kv_transfer.chunk_ends import ChunkEnds

            self.chunk_ends = ChunkEnds()
        return self.chunk_ends

    def kv_shard(self, rank: int) -> "RankShard":
        """Which global layers and KV heads this rank's cache holds, and under SP which blocks (its SP
        rank's), for resharding KV transfers."""
        from parallel.linear import QKVParallelLinear
        from workers.kv_transfer.plan import RankShard

        qkv = next(m for m in self.model.modules() if isinstance(m, QKVParallelLinear))
        layers = self.model.layer_range
        device = str(torch.cuda.get_device_properties(self.device).uuid) if self.device.type == "cuda" else ""
        return RankShard(rank, range(layers.start, layers.stop), range(qkv.kv_head_start, qkv.kv_head_start + qkv.num_kv_heads),
                         self.sp.rank, self.sp.size, device)
