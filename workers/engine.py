"""One replica's engine: requests in, a scheduler step, the model runner, tokens and text out.

`LLMEngine` is synchronous and step-driven (the offline `LLM` loops over `step()`; the served pools
drive it from their own loop). It validates each request, keeps the per-request detokenizer and stop
logic, and returns `RequestOutput`s with both the whole output so far and this step's delta.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from transformers import AutoTokenizer, GenerationConfig

from workers.config import EngineConfig
from workers.detokenizer import IncrementalDetokenizer, find_stop_string, streamable_len
from workers.kv_cache import BlockManager
from workers.loader import load_hf_config
from workers.executor import Executor, make_executor
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler
from workers.scheduler_output import SampledToken
from workers.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # all generated tokens so far
    text: str = ""  # all generated text so far (stop string removed when finished by one)
    logprobs: list[dict[int, float]] | None = None  # per generated token: sampled + top-n
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    new_token_ids: list[int] = field(default_factory=list)  # this step's tokens
    new_text: str = ""  # text that became streamable this step
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    output: RequestOutput
    streamed_chars: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        path = config.model.model
        self.hf_config = load_hf_config(path)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer or path, local_files_only=True)
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = self._eos_token_ids(path)
        # One process, or one Ray actor per rank: the engine sees only `execute` and `num_blocks`.
        self.executor: Executor = make_executor(config, self.hf_config, self.max_model_len, self.eos_token_ids, show_progress)
        self.max_model_len = self._fit_max_model_len_to_cache(self.executor.num_blocks * config.cache.block_size)
        self.block_manager = BlockManager(self.executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.requests: dict[str, _Request] = {}
        self.vocab_size = self.hf_config.vocab_size

    def _max_model_len(self) -> int:
        cfg = self.hf_config
        limit = getattr(cfg, "max_position_embeddings", None) or 2048
        window = getattr(cfg, "sliding_window", None)
        if window and (cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)):
            # Attention over a sliding window is not implemented: stay inside it, where it equals full attention.
            limit = min(limit, window)
        wanted = self.config.model.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's limit of {limit} positions")
        return wanted or limit

    def _fit_max_model_len_to_cache(self, capacity: int) -> int:
        """A sequence longer than the whole KV cache could never finish: alone, it would preempt itself
        and wait forever. So max_model_len must fit in the cache (lowered to fit unless given explicitly)."""
        if capacity >= self.max_model_len:
            return self.max_model_len
        if self.config.model.max_model_len is not None:
            raise ValueError(f"max_model_len={self.max_model_len} does not fit in the KV cache, which holds {capacity} tokens "
                             f"({capacity // self.config.cache.block_size} blocks); lower max_model_len or give the cache more blocks")
        log.warning("KV cache holds %d tokens: lowering max_model_len from %d to %d", capacity, self.max_model_len, capacity)
        return capacity

    def _eos_token_ids(self, path: str) -> list[int]:
        ids: set[int] = set()
        if os.path.isfile(os.path.join(path, "generation_config.json")):
            eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        if not ids:
            eos = getattr(self.hf_config, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        if not ids and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    # ---- requests ----
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids (ints)")
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0) -> None:
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError(f"request {request_id}: the prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"request {request_id}: prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} "
                             "leaves no room for output")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, priority=priority)
        self.scheduler.add(seq)
        out = RequestOutput(request_id, list(token_ids), logprobs=[] if params.logprobs is not None else None)
        self.requests[request_id] = _Request(seq, IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens), out)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        req.output.finish_reason = "abort"
        return req.output

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        result = self.executor.execute(sched_out)
        outputs = []
        for seq in self.scheduler.update(sched_out, result):
            outputs.append(self._on_token(self.requests[seq.seq_id], result.sampled[seq.seq_id]))
        return outputs

    def _on_token(self, req: _Request, sampled: SampledToken) -> RequestOutput:
        seq, out, params = req.seq, req.output, req.seq.sampling_params
        token = sampled.token_id
        out.token_ids.append(token)
        out.new_token_ids = [token]
        if out.logprobs is not None:
            entry = {token: sampled.logprob}
            entry.update(sampled.top_logprobs or [])
            out.logprobs.append(entry)
        num_out = seq.num_output_tokens
        reason, stop = None, None
        if num_out >= params.min_tokens:
            if token in params.stop_token_ids:
                reason, stop = "stop", token
            elif token in self.eos_token_ids and not params.ignore_eos:
                reason = "stop"
        old_len = len(req.detok.text)
        if reason is None or params.include_stop_str_in_output:  # a stop token's own text is not output
            req.detok.add_token(token)
        text = req.detok.text
        if reason is None and params.stop and num_out >= params.min_tokens:
            hit = find_stop_string(text, len(text) - old_len, params.stop, params.include_stop_str_in_output)
            if hit is not None:
                stop, cut = hit
                text, reason = text[:cut], "stop"
        if reason is None and (num_out >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        out.text = text
        out.num_cached_tokens = seq.num_cached_tokens
        if reason is not None:
            out.finish_reason, out.stop_reason = reason, stop
            self.scheduler.finish(seq, reason)
            del self.requests[seq.seq_id]
        limit = streamable_len(text, params.stop, finished=reason is not None)
        out.new_text = text[req.streamed_chars : max(limit, req.streamed_chars)]
        req.streamed_chars = max(limit, req.streamed_chars)
        return out

    def shutdown(self) -> None:
        """Release the executor's ranks (Ray actors, device memory)."""
        self.executor.shutdown()

    # ---- introspection ----
    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_blocks": bm.num_blocks,
            "blocks_used": bm.num_used_blocks,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "prefix_hit_tokens": bm.hit_tokens,
            "prefix_queried_tokens": bm.queried_tokens,
            "preemptions": self.scheduler.num_preemptions,
        }
