"""Turns a `SchedulerOutput` into tensors, runs the model over the paged KV cache, and samples.

One runner per rank. It owns the model's weights (this rank's shard) and the KV cache memory:
kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads_per_rank, head_dim].
"""
from __future__ import annotations

import logging

import torch

from workers.attention import AttentionMetadata, forward_context, get_backend
from workers.config import EngineConfig
from workers.loader import load_model
from workers.models.layers import PagedAttention
from workers.sampler import Sampler
from workers.sampling_params import SamplingParams
from workers.scheduler_output import ModelRunnerOutput, ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, max_model_len: int, eos_token_ids: list[int], show_progress: bool = True):
        self.config = config
        self.device = config.model.resolved_device()
        self.dtype = config.model.resolved_dtype(hf_config)
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        self.model = load_model(hf_config, config.model.model, self.dtype, self.device, max_model_len,
                                config.model.load_format, config.model.seed, show_progress)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.backend = get_backend(config.model.attention_backend, self.device)
        self.sampler = Sampler(eos_token_ids)
        self.num_blocks = self._num_kv_blocks()
        first = self.attn_layers[0]
        self.kv_cache = torch.zeros(len(self.attn_layers), 2, self.num_blocks, self.block_size, first.num_kv_heads,
                                    first.head_dim, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.kv_cache, layer.backend = self.kv_cache[i], self.backend

    # ---- KV cache sizing ----
    def kv_bytes_per_block(self) -> int:
        a = self.attn_layers[0]
        return 2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
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
        """Free memory after weights and the peak activations of a full-size step, times the utilisation."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        probe_blocks = -(-n // self.block_size)
        a = self.attn_layers[0]
        probe = torch.zeros(len(self.attn_layers), 2, probe_blocks, self.block_size, a.num_kv_heads, a.head_dim,
                            dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.kv_cache, layer.backend = probe[i], self.backend
        fake = ScheduledSeq("profile", [0] * n, 0, list(range(probe_blocks)), True, _GREEDY, 0)
        self.execute(SchedulerOutput([fake]))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - probe.numel() * probe.element_size()
        del probe
        for layer in self.attn_layers:
            layer.kv_cache = None
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info()
        return int(total * self.config.cache.gpu_memory_utilization - peak)

    # ---- one step ----
    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        bs = self.block_size
        for s in out.seqs:
            token_ids.extend(s.token_ids)
            pos = range(s.start_pos, s.context_len)
            positions.extend(pos)
            table = s.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            query_start.append(query_start[-1] + s.num_tokens)
            if s.sample:
                sample_rows.append(query_start[-1] - 1)
        max_blocks = max(len(s.block_table) for s in out.seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in out.seqs]
        seq_lens = [s.context_len for s in out.seqs]
        query_lens = [s.num_tokens for s in out.seqs]

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=t(slots, torch.int64),
            query_start_loc=t(query_start, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            block_tables=t(tables, torch.int32),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return t(token_ids, torch.int64), t(positions, torch.int64), meta, sample_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if out.is_empty:
            return ModelRunnerOutput({})
        token_ids, positions, meta, sample_rows = self.prepare(out)
        with forward_context(meta):
            hidden, _ = self.model(token_ids, positions)
        to_sample = [s for s in out.seqs if s.sample]
        if not to_sample:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden[sample_rows])
        sampled = self.sampler(logits, to_sample)
        return ModelRunnerOutput({s.seq_id: tok for s, tok in zip(to_sample, sampled)})

