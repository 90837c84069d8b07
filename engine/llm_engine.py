"""One replica's engine: requests in, a scheduler step, the model runner, tokens and text out.

`LLMEngine` is synchronous and step-driven (the offline `LLM` loops over `step()`; the served pools
drive it from their own loop). It validates each request, keeps the per-request detokenizer and stop
logic, and returns `RequestOutput`s with both the whole output so far and this step's delta.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace

from transformers import AutoTokenizer, GenerationConfig

from parallel.ulysses import choose_ulysses
from workers.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, find_stop_string, streamable_len
from engine.block_manager import BlockManager
from engine.grammar import GrammarManager
from workers.loader import load_hf_config
from engine.executor import make_executor
from workers.executor import Executor, PendingStep
from workers.sampling_params import SamplingParams, model_default_fields
from engine.scheduler import Scheduler
from engine.spec_decode import SpecDecoder, empty_metrics
from workers.gc_freeze import freeze_startup_objects
from workers.scheduler_output import SampledToken, SchedulerOutput, placeholder_seqs
from engine.sequence import Sequence

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
    # With SamplingParams.prompt_logprobs, on the first token's output and after: per prompt token, None
    # for the first, then {its id: logprob, top-n ids: logprobs} (vLLM's prompt_logprobs).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Wall-clock stamps (time.time(), comparable across processes) of this request's stages on this engine:
    # "queued" (added), "scheduled" (first step that ran it), "first_token", "decode_started" (a handed-off
    # request joined the batch), "first_decode_step". Set on the outputs of tokens 1 and 2 and on the last
    # one only, each time a new dict, so snapshots never share a dict that changes (docs/architecture.md,
    # "Request timeline"); callers upstream add their own stages to the last output's copy.
    timeline: dict[str, float] | None = None
    # Prefill pool, a handed-off prompt prefilled in pieces (`add_request(pieces=True)`): on the outputs of the steps
    # that computed part of it (no token, not finished), the ids of its first blocks, all full and computed, and
    # how often it was preempted so far (a preemption frees its blocks: pieces told before it may be stale).
    kv_blocks: list[int] | None = None
    kv_epoch: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


    def snapshot(self) -> "RequestOutput":
        """A copy safe to hand to another task or process while the engine keeps updating this one."""
        return replace(self, token_ids=list(self.token_ids), new_token_ids=list(self.new_token_ids),
                       logprobs=list(self.logprobs) if self.logprobs is not None else None)


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    output: RequestOutput
    streamed_chars: int = 0
    handoff: bool = False  # prefill pool: stop after the first token and hold the KV for the decode pool
    pieces: int = -1  # handoff in pieces: full blocks told so far (`LLMEngine._prefill_pieces`); -1: not in pieces
    prompt_lps: dict[int, dict[int, float]] = field(default_factory=dict)  # by prompt position, as chunks arrive
    timeline: dict[str, float] = field(default_factory=dict)  # see RequestOutput.timeline


def capacity_line(num_blocks: int, block_size: int, sp: int, max_model_len: int) -> str:
    """What a user sizing long-context requests needs at start: the KV cache's size in tokens, the longest
    prompt a request may have (one position is left for the first generated token), and how many
    sequences of max_model_len tokens fit in the cache at once (vLLM's "maximum concurrency")."""
    tokens = num_blocks * block_size
    over = f" over {sp} sequence-parallel ranks ({num_blocks // sp} blocks each)" if sp > 1 else ""
    return (f"KV cache: {num_blocks} blocks of {block_size} tokens = {tokens} tokens{over}; longest prompt "
            f"{max_model_len - 1} tokens (max_model_len {max_model_len}); {tokens / max_model_len:.2f}x "
            f"requests of max_model_len tokens fit at once")


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        path = config.model.model
        self.hf_config = load_hf_config(path)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer or path, local_files_only=True)
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = self._eos_token_ids(path)
        # Filled into every request's unset sampling fields (add_request, reserve): vLLM's --generation-config auto.
        self.default_sampling_fields = model_default_fields(path) if config.model.generation_config == "auto" else {}
        self._check_sp_attention()
        # One process, or one Ray actor per rank: the engine sees only `execute` and `num_blocks`.
        self.executor: Executor = make_executor(config, self.hf_config, self.max_model_len, self.eos_token_ids, show_progress)
        # Under SP each rank's cache is one pool of the block ids (engine/block_manager.py): sp times the blocks.
        sp = config.parallel.sequence_parallel_size
        num_blocks = self.executor.num_blocks * sp
        self.max_model_len = self._fit_max_model_len_to_cache(num_blocks * config.cache.block_size)
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, num_pools=sp)
        log.info("%s", capacity_line(num_blocks, config.cache.block_size, sp, self.max_model_len))
        # Pipelined steps (EngineConfig.step_groups): one step per group of sequences in flight (_step_pipelined).
        groups = config.step_groups
        self.step_groups = groups if getattr(self.executor, "max_steps_in_flight", 1) >= groups else 1
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.step_groups)
        spec = config.speculative.spec
        self.spec_decoder = None if spec is None else SpecDecoder(config, spec, num_blocks, self.max_model_len,
                                                                   self.eos_token_ids)
        runner = getattr(self.executor, "runner", None)
        if spec is not None and runner is not None and runner.device.type == "cuda" and runner.verify_graphs is None:
            log.warning("speculative decoding: verification steps run without CUDA graphs (TP, enforce_eager, or "
                        "their capture failed); on a GPU that is slower than plain decoding (docs/benchmarks.md)")
        self.requests: dict[str, _Request] = {}
        self._piece_requests = 0  # requests added with pieces=True, not yet gone: only then are steps searched for pieces
        self._inflight: tuple[SchedulerOutput, PendingStep] | None = None  # sent to the ranks, not yet collected
        # Pipelined steps sent and not yet collected, oldest first, with their group: at most one per group.
        self._pipeline: deque[tuple[SchedulerOutput, PendingStep, int]] = deque()
        # Asynchronous scheduling: step n+1 is planned and sent while the ranks compute step n (step()).
        self.async_scheduling = config.scheduler.async_scheduling and self.executor.supports_ahead
        self._unscheduled: dict[str, _Request] = {}  # added, not yet in any step: their "scheduled" stamp is due
        self.vocab_size = self.hf_config.vocab_size
        # Structured output: grammars compiled off the step loop, one matcher per constrained request.
        self.grammars = GrammarManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        # The step sent ahead of `_inflight` at the end of the last `step()`, before its text work (`_collect`).
        self._next: tuple[SchedulerOutput, PendingStep] | None = None
        freeze_startup_objects()  # the model, tokenizer and Ray's state leave the collector's walks (workers/gc_freeze.py)

    def _check_sp_attention(self) -> None:
        """An impossible `sequence_parallel_attention` fails here, before any rank starts."""
        par, cfg = self.config.parallel, self.hf_config
        heads = getattr(cfg, "num_attention_heads", None)
        if par.sequence_parallel_size == 1 or heads is None:
            return
        tp = par.tensor_parallel_size
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        choose_ulysses(par.sequence_parallel_attention, heads // tp, max(1, kv_heads // tp), par.sequence_parallel_size)

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

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0,
                    handoff: bool = False, speculate: bool = True, pieces: bool = False) -> None:
        """Queue a request. With handoff=True (prefill pool) it stops after its first token and its KV
        blocks are held for the decode pool until `release` or the KV lease runs out; with pieces=True too,
        every step that completes more of its prompt's blocks (chunked prefill) outputs them (`RequestOutput.
        kv_blocks`), so they can move while the later chunks compute. speculate=False: this request decodes
        one token per step even when the engine speculates."""
        if not speculate and self.spec_decoder is not None:
            self.spec_decoder.opted_out.add(request_id)
        params = (params or SamplingParams()).with_defaults(self.default_sampling_fields)
        token_ids = self._validated_prompt(request_id, prompt)
        if params.prompt_logprobs is not None and self.config.parallel.sequence_parallel_size > 1:
            raise ValueError("prompt_logprobs is not supported with sequence parallelism (the prompt's rows are spread over ranks)")
        seq = Sequence(request_id, token_ids, params, priority=priority)
        if params.structured_outputs is not None:  # validated now (GrammarError), compiled in the background
            self.grammars.add(request_id, params.structured_outputs)
        self.scheduler.add(seq)
        req = self.requests[request_id] = self._new_request(seq, handoff)
        if handoff and pieces:
            req.pieces = 0
            self._piece_requests += 1
        req.timeline["queued"] = time.time()
        self._unscheduled[request_id] = req

    def _new_request(self, seq: Sequence, handoff: bool = False) -> _Request:
        params = seq.sampling_params
        out = RequestOutput(seq.seq_id, seq.prompt_token_ids, logprobs=[] if params.logprobs is not None else None)
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
        return _Request(seq, detok, out, handoff=handoff)

    def _validated_prompt(self, request_id: str, prompt: str | list[int]) -> list[int]:
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
        return token_ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request in any state (queued, running, holding or awaiting KV) and free its blocks."""
        req = self.requests.pop(request_id, None)
        self._forget_pieces(req)
        self._unscheduled.pop(request_id, None)
        self.grammars.drop(request_id)
        if not self.executor.alive:  # its ranks are gone: no step out writes anything any more
            self.scheduler.steps_lost()
        self.scheduler.abort(request_id)  # blocks a step out may still write are parked until it answers
        if req is None:
            return None
        req.output.finish_reason = "abort"
        return req.output

    # ---- disaggregation (see docs/architecture.md, "Prefill/decode handoff") ----
    def held_block_ids(self, request_id: str) -> list[int]:
        """Prefill side: the blocks holding a handed-off prompt's KV."""
        return self.held_kv(request_id)[0]

    def held_kv(self, request_id: str) -> tuple[list[int], int]:
        """Prefill side: the blocks holding a handed-off prompt's KV, and how often it was preempted (its pieces'
        epoch: `RequestOutput.kv_epoch`)."""
        entry = self.scheduler.held.get(request_id)
        if entry is None:
            raise KeyError(f"request {request_id} holds no KV (released, expired or never prefilled here)")
        return list(entry[0].block_table), entry[0].num_preemptions

    def release(self, request_id: str) -> bool:
        """Prefill side: the KV was delivered (or given up on): free the held blocks."""
        return self.scheduler.release(request_id)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> tuple[list[int], int] | None:
        """Decode side: blocks for an incoming prompt's KV. Returns (block ids, number of leading blocks
        already cached here, which need not be sent), or None when this replica is full."""
        token_ids = self._validated_prompt(request_id, prompt_token_ids)
        seq = Sequence(request_id, token_ids, params.with_defaults(self.default_sampling_fields), priority=priority)
        if seq.sampling_params.structured_outputs is not None:  # compiles while the KV travels
            self.grammars.add(request_id, seq.sampling_params.structured_outputs)
        if not self.scheduler.reserve(seq, time.monotonic() + self.config.cache.kv_lease_seconds):
            self.grammars.drop(request_id)
            return None
        return list(seq.block_table), seq.num_cached_tokens // self.config.cache.block_size

    def start(self, request_id: str, first: SampledToken) -> RequestOutput:
        """Decode side: the KV has arrived; continue the request from its first sampled token."""
        if request_id not in self.scheduler.reserved:
            raise KeyError(f"request {request_id} has no reservation here (cancelled or expired)")
        seq = self.scheduler.activate(request_id, first.token_id)
        req = self._new_request(seq)
        req.timeline["decode_started"] = time.time()
        self.requests[request_id] = req
        return self._on_token(req, first)

    def cancel_reservation(self, request_id: str) -> bool:
        self.grammars.drop(request_id)
        return self.scheduler.cancel_reservation(request_id)

    def expire_leases(self) -> list[str]:
        """Free KV held or reserved past its lease (the peer pool vanished or gave up)."""
        expired = self.scheduler.expire(time.monotonic())
        for request_id in expired:
            self.grammars.drop(request_id)
        if expired:
            log.warning("freed the KV leases of %d requests whose peer never came: %s", len(expired), expired[:5])
        return expired

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs it produced.

        Where the executor runs steps elsewhere (Ray rank actors: `overlaps_host_work`), the ranks compute
        while this thread works. With `async_scheduling`, step n+1 is planned and sent before step n's
        tokens are back (`Scheduler.schedule(ahead_of=...)`); the tokens it needs from step n follow in a
        small message as soon as they arrive, so the ranks wait only for that round trip, not for the
        update, the checks, the schedule and the encoding. Otherwise the next step is sent as soon as this
        one's tokens are in and its finished sequences freed, and the text work (detokenizing, stop strings,
        outputs) runs while the ranks compute it. Either way a step may run a sequence that the step before
        ended (a stop token, a stop string, an abort): its token is dropped (`Scheduler.update` skips
        finished sequences) and its blocks stay parked until that step has answered.

        With pipelined steps (`step_groups > 1`, pipeline parallelism) see `_step_pipelined`. Once the last request
        has finished, the steps still out (run for sequences that have ended) are collected before this returns
        (`drain`): the engine is at rest, every block free, however the caller drives it (a loop on
        `has_unfinished_requests`, the served engine, `LLM.generate`)."""
        outputs = self._step_pipelined() if self.step_groups > 1 else self._step_one()
        if not self.requests:
            self.drain()
        return outputs

    def _step_one(self) -> list[RequestOutput]:
        """`step` with one step at a time (no pipelined groups)."""
        if self._inflight is None:
            self._inflight = self._submit()
            if self._inflight is None:
                return []
        sched_out, pending = self._inflight
        self._inflight = None
        got, verdicts, ahead = self._collect(sched_out, pending)
        if ahead is not None:
            self._inflight = ahead
        elif self.executor.overlaps_host_work:
            self._inflight = self._submit()
        pieces = self._prefill_pieces(sched_out) if self._piece_requests else []
        return pieces + [self._emit(req, ids, reason, stop) for (req, _), (ids, reason, stop) in zip(got, verdicts)]

    def _collect(self, sched_out: SchedulerOutput, pending: PendingStep, group: int | None = None):
        """Wait for a step's answer and apply it; with async scheduling the next step (of the same group, where steps
        are pipelined) is planned and sent first, and its placeholders filled as soon as the answer is in. Returns
        (requests with their tokens, their verdicts, the step sent ahead or None).

        Without groups, the step after that one is then planned and sent too, ahead of it (`_next`), before the
        caller's text work: the ranks run the step sent ahead meanwhile, and the next `step()` finds its successor
        out already. So the ranks wait for the driver only when its update, schedule and encoding of one step
        outlast a step; the detokenizing and the caller's handling of the outputs are off that path."""
        try:
            ahead, self._next = self._next, None
            if ahead is None and self._can_schedule_ahead(sched_out):
                ahead = self._submit(ahead_of=sched_out, group=group)
            result = pending.result()
            self.scheduler.step_done()
            if ahead is not None and self.executor.needs_fill:  # the ranks wait for these before the step sent ahead
                self.executor.fill([result.sampled[s.seq_id].token_id for s in placeholder_seqs(ahead[0].seqs)])
            got, verdicts = self._apply(sched_out, result)
            if ahead is not None and group is None and self._can_schedule_ahead(ahead[0]):
                self._next = self._submit(ahead_of=ahead[0])
        except BaseException:
            if not self.executor.alive:  # the ranks are gone: nothing writes any block any more
                self.scheduler.steps_lost()
            raise
        return got, verdicts, ahead

    def _prefill_pieces(self, sched_out: SchedulerOutput) -> list[RequestOutput]:
        """The outputs telling that a step completed more full blocks of a prompt prefilled in pieces (and sampled
        nothing: its last step's output is the handoff itself). Only full blocks: the next chunk, which may be
        running already (a step sent ahead), writes into the last partial one."""
        outputs = []
        block_size = self.config.cache.block_size
        for s in sched_out.seqs:
            req = self.requests.get(s.seq_id)
            if req is None or req.pieces < 0 or s.sample:
                continue
            seq = req.seq
            full = seq.num_computed_tokens // block_size
            if full > req.pieces:
                req.pieces = full
                outputs.append(replace(req.output.snapshot(), new_token_ids=[], new_text="",
                                       kv_blocks=list(seq.block_table[:full]), kv_epoch=seq.num_preemptions))
        return outputs

    def _apply(self, sched_out: SchedulerOutput, result) -> tuple[list[tuple[_Request, list[SampledToken]]], list[tuple]]:
        """A collected step's tokens into the scheduler and the requests; what finished is freed (or parked).
        Returns each request that got tokens with them, and the verdicts of `_check_tokens`."""
        for seq_id, entries in result.prompt_logprobs.items():
            self._add_prompt_logprobs(seq_id, entries)
        got = [(self.requests[seq.seq_id], result.spec.get(seq.seq_id) or [result.sampled[seq.seq_id]])
               for seq in self.scheduler.update(sched_out, result)]
        if self.spec_decoder is not None:
            self.spec_decoder.record(sched_out, result)
        return got, [self._check_tokens(req, tokens) for req, tokens in got]  # frees (or parks) what finished

    def _step_pipelined(self) -> list[RequestOutput]:
        """One step per group of sequences stays in flight (vLLM's virtual engines): while the later pipeline
        stages run one group's step, the first stage already runs another's. Each call collects the oldest step,
        applies its tokens, and sends that group's next step (it needs only its own group's tokens) before the
        text work, as `step` does. With `async_scheduling` that next step is planned and sent before the oldest
        step's tokens are back, behind the other groups' steps on every rank, and its placeholders are filled as
        soon as they are (as in `step`): the first stage then waits only for that small frame, not for the update,
        the schedule and the encoding. Groups whose step is not out (none yet, or nothing to run when last tried)
        are scheduled too, so a new request starts at once in a group that was idle."""
        self._fill_pipeline()
        if not self._pipeline:
            return []
        sched_out, pending, group = self._pipeline.popleft()
        got, verdicts, ahead = self._collect(sched_out, pending, group)
        if ahead is not None:
            self._pipeline.append((*ahead, group))
        self._fill_pipeline()
        return [self._emit(req, ids, reason, stop) for (req, _), (ids, reason, stop) in zip(got, verdicts)]

    def _fill_pipeline(self) -> None:
        """Send a step for every group that has none out and something to run."""
        busy = {group for _, _, group in self._pipeline}
        for group in range(self.step_groups):
            if group not in busy:
                sent = self._submit(group=group)
                if sent is not None:
                    self._pipeline.append((*sent, group))

    def _can_schedule_ahead(self, out: SchedulerOutput) -> bool:
        """Whether the step after `out` may be planned before `out`'s tokens are back. Not where its inputs
        depend on more than those tokens: speculative decoding (drafts come from them), structured output
        (the grammar advances by them), penalties of a sequence that samples in `out` (the ranks are sent
        its past tokens), SP (its block pools are not planned ahead)."""
        return (self.async_scheduling and self.spec_decoder is None and not self.grammars.active
                and self.block_manager.num_pools == 1
                and not any(s.sample and s.sampling_params.needs_token_history for s in out.seqs))

    def _will_finish(self, seq: Sequence) -> bool:
        """Whether the token a step out samples for `seq` surely ends it (length, or the prefill pool's
        handoff): such a sequence is not planned into the step after."""
        req = self.requests.get(seq.seq_id)
        return (req is None or req.handoff or seq.num_output_tokens + 1 >= seq.sampling_params.max_tokens
                or seq.num_tokens + 1 >= self.max_model_len)

    def _check_tokens(self, req: _Request, tokens: list[SampledToken]) -> tuple[list[int], str | None, int | None]:
        """A step's tokens for one request, in order (several from a verified speculative run): each is
        checked before the next is taken, so a stop token, EOS or max_tokens inside a run ends it there.
        Returns the tokens kept and the verdict of the last."""
        kept: list[int] = []
        reason = stop = None
        for j, sampled in enumerate(tokens):
            if j:
                self.scheduler.accept(req.seq, sampled.token_id)
            reason, stop = self._check_token(req, sampled, first=j == 0)
            kept.append(sampled.token_id)
            if reason is not None:
                break
        return kept, reason, stop

    def _add_prompt_logprobs(self, seq_id: str, entries: list) -> None:
        req = self.requests.get(seq_id)
        if req is not None:
            for pos, logprob, top in entries:
                req.prompt_lps[pos] = {req.seq.token_ids[pos]: logprob, **dict(top)}

    @contextlib.contextmanager
    def _full_prompts_if_needed(self):
        """A request that wants prompt logprobs needs the logits of every prompt position, so none may
        come from the prefix cache: while one waits for admission, the step's admissions skip the cache
        lookup (blocks are still cached for later requests)."""
        blocks = self.block_manager
        if not blocks.enable_prefix_caching or not any(
                r.seq.sampling_params.prompt_logprobs is not None for r in self._unscheduled.values()):
            yield
            return
        blocks.enable_prefix_caching = False
        try:
            yield
        finally:
            blocks.enable_prefix_caching = True

    def _submit(self, ahead_of: SchedulerOutput | None = None, group: int | None = None) -> tuple[SchedulerOutput, PendingStep] | None:
        """Schedule and send a step; `ahead_of`: the step still out, whose tokens this one waits for; `group`:
        the group a pipelined step runs (the other groups' steps may be out)."""
        spec = self.spec_decoder
        with self._full_prompts_if_needed():
            if ahead_of is not None:
                sched_out = self.scheduler.schedule(ahead_of=ahead_of, will_finish=self._will_finish, group=group)
            elif spec is None:
                sched_out = self.scheduler.schedule(group=group)
            else:
                spec.begin_step(len(self.scheduler.running))
                sched_out = self.scheduler.schedule(spec.lookahead)
                spec.propose(sched_out, self.scheduler.seqs)
        if sched_out is None or sched_out.is_empty:
            if sched_out is not None and sched_out.finished_seq_ids:  # not sent: the ranks hear of them next step
                self.scheduler.requeue_dropped(sched_out.finished_seq_ids)
            return None
        if self._unscheduled:  # only while some request waits for its first step: no cost at steady state
            self._stamp_scheduled(sched_out)
        if self.grammars.active:  # structured output: the step's allowed tokens go with it to the ranks
            sched_out.token_bitmask = self.grammars.bitmask(sched_out.seqs)
        if group is None or ahead_of is not None:
            pending = self.executor.submit(sched_out, ahead=ahead_of is not None)
        else:
            pending = self.executor.submit(sched_out, overlap=True)
        self.scheduler.step_sent()
        return sched_out, pending

    def _stamp_scheduled(self, sched_out: SchedulerOutput) -> None:
        """The end of a request's queue wait: the first step that runs (part of) its prompt is sent now."""
        now = time.time()
        for s in sched_out.seqs:
            req = self._unscheduled.pop(s.seq_id, None)
            if req is not None:
                req.timeline["scheduled"] = now

    def _on_token(self, req: _Request, sampled: SampledToken) -> RequestOutput:
        return self._emit(req, [sampled.token_id], *self._check_token(req, sampled))

    def _check_token(self, req: _Request, sampled: SampledToken, first: bool = True) -> tuple[str | None, int | None]:
        """Record the token and apply what the token alone decides (stop token, EOS, length, prefill
        handoff): a finished sequence's blocks are freed before the next step is scheduled."""
        seq, out, params = req.seq, req.output, req.seq.sampling_params
        token = sampled.token_id
        out.token_ids.append(token)
        if first:
            out.new_token_ids = [token]
        else:  # a later token of the same step (speculative decoding)
            out.new_token_ids.append(token)
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
        if seq.seq_id in self.grammars and self.grammars.accept(seq.seq_id, token) and reason is None:
            reason = "stop"  # the grammar is complete (it accepted EOS): nothing more may follow
        if reason is None and (num_out >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is None and req.handoff:
            reason = "handoff"  # the decode pool continues from here
        if reason == "handoff":
            self.scheduler.hold(seq, reason, time.monotonic() + self.config.cache.kv_lease_seconds)
        elif reason is not None:
            self.scheduler.finish(seq, reason)
        if reason is not None:
            self._forget_pieces(self.requests.pop(seq.seq_id))
            self.grammars.drop(seq.seq_id)
        return reason, stop

    def _forget_pieces(self, req: _Request | None) -> None:
        if req is not None and req.pieces >= 0:
            req.pieces = -1
            self._piece_requests -= 1

    def _emit(self, req: _Request, tokens: list[int], reason: str | None, stop: int | None) -> RequestOutput:
        """The text side of a step's tokens: detokenize, look for stop strings, fill the output's text
        fields. `reason` is the verdict of the last token; a stop string completed by an earlier one (a
        speculative run) drops the tokens after it."""
        seq, out, params = req.seq, req.output, req.seq.sampling_params
        text = req.detok.text
        for i, token in enumerate(tokens):
            later = len(tokens) - 1 - i  # tokens of this step after this one
            token_reason = reason if not later else None
            old_len = len(req.detok.text)
            if token_reason != "stop" or params.include_stop_str_in_output:  # a stop token's own text is not output
                req.detok.add_token(token)
            text = req.detok.text
            if token_reason != "stop" and params.stop and seq.num_output_tokens - later >= params.min_tokens:
                hit = find_stop_string(text, len(text) - old_len, params.stop, params.include_stop_str_in_output)
                if hit is not None:
                    stop, cut = hit
                    text = text[:cut]
                    if later:
                        del out.token_ids[-later:], out.new_token_ids[-later:]
                        if out.logprobs is not None:
                            del out.logprobs[-later:]
                    self._finish_late(seq, reason)
                    reason = "stop"
                    break
        out.text = text
        out.num_cached_tokens = seq.num_cached_tokens
        if params.prompt_logprobs is not None and out.prompt_logprobs is None:
            out.prompt_logprobs = [None] + [req.prompt_lps.get(p) for p in range(1, seq.num_prompt_tokens)]
        if reason is not None:
            out.finish_reason, out.stop_reason = reason, stop
        limit = streamable_len(text, params.stop, finished=reason is not None)
        out.new_text = text[req.streamed_chars : max(limit, req.streamed_chars)]
        req.streamed_chars = max(limit, req.streamed_chars)
        if reason is not None or seq.num_output_tokens <= 2:
            self._stamp_token(req)
        return out

    @staticmethod
    def _stamp_token(req: _Request) -> None:
        """Tokens 1 and 2 end the prefill and the first decode step; their outputs and the last one carry
        a copy of the timeline (a new dict each time: snapshots share the reference)."""
        n, timeline = req.seq.num_output_tokens, req.timeline
        if n == 1 and "decode_started" not in timeline:  # a handed-off request's token 1 came from its prefill
            timeline["first_token"] = time.time()
        elif n == 2:
            timeline["first_decode_step"] = time.time()
        req.output.timeline = dict(timeline)

    def _finish_late(self, seq: Sequence, token_reason: str | None) -> None:
        """A stop string ends a sequence that the token checks kept (or handed off, or ended by length). A
        step out may still run it: the scheduler parks its blocks until that step answers, so that nothing
        allocated meanwhile (a decode-side `reserve`, whose blocks a KV transfer fills) shares a block with a
        write still under way."""
        if token_reason is None:
            self._forget_pieces(self.requests.pop(seq.seq_id, None))
            self.grammars.drop(seq.seq_id)
            if self.scheduler.seqs.get(seq.seq_id) is seq:
                self.scheduler.finish(seq, "stop")
        elif token_reason == "handoff":
            self.scheduler.release(seq.seq_id)  # nothing left to continue: the held KV is not needed

    def drain(self) -> None:
        """With no request left, collect a step still in flight and free what waited on it (the offline
        `LLM` calls this after each `generate`, so the engine is at rest in between)."""
        if self.requests:
            return
        after = self._next  # sent ahead of `_inflight` (`_collect`): it waits for that step's tokens
        out = [step for step in (self._inflight, after) if step is not None]
        out += [(sched_out, pending) for sched_out, pending, _ in self._pipeline]
        self._inflight = self._next = None
        self._pipeline.clear()
        for sched_out, pending in out:  # oldest first: the order the answers come back in
            try:
                result = pending.result()
                if after is not None and sched_out is not after[0] and self.executor.needs_fill:
                    self.executor.fill([result.sampled[s.seq_id].token_id for s in placeholder_seqs(after[0].seqs)])
            except BaseException:
                if not self.executor.alive:
                    self.scheduler.steps_lost()
                raise
            self.scheduler.step_done()
            self.scheduler.update(sched_out, result)

    def shutdown(self) -> None:
        """Release the executor's ranks (Ray actors, device memory)."""
        self.grammars.shutdown()
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
            **(self.spec_decoder.metrics() if self.spec_decoder is not None else empty_metrics()),
        }
