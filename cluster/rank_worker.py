"""One rank of a replica, as a Ray actor: joins torch.distributed, builds the process groups, loads
its shard of the model in a `ModelRunner`, and runs every step the driver sends it."""
from __future__ import annotations

import os
import time

import torch

from cluster.ray_runtime import RANK_SEES_NODE_GPUS
from cluster.rendezvous import join_process_group, node_address
from cluster.step_channel import NO_REPLY, Later, run_rank_loop
from parallel.net import free_port
from parallel.state import init_groups
from workers.config import EngineConfig
from workers.gc_freeze import freeze_startup_objects
from workers.launched_step import LaunchedStep, launch_ahead_enabled, launch_mixed_enabled
from workers.gil import shorten_switch_interval
from workers.model_runner import ModelRunner
from workers.rank_profile import RankProfile, logged_profile, step_kind
from workers.scheduler_output import ModelRunnerOutput, SchedulerOutput, fill_placeholders
from workers.step_delta import StepDecoder, decode_own, fill_own, pack_output, tokens_by_row


def set_rank_threads(world_size: int) -> None:
    """Ray starts actors with OMP_NUM_THREADS=1. A GPU rank's host work (building a step's inputs,
    sampling bookkeeping) gets its share of the node's cores instead, as the in-process engine has.
    CPU ranks keep one thread each: they compute on the cores they share with each other."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // world_size))


def own_gpu_index(assigned: list[str], visible: str | None) -> int:
    """This rank's CUDA device index where the process sees every GPU of its node: Ray's assigned GPU id
    (the node's numbering, itself the raylet's CUDA_VISIBLE_DEVICES entries where that is set)."""
    if len(assigned) != 1:
        raise RuntimeError(f"a rank needs exactly one GPU, Ray assigned {assigned}")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if assigned[0] not in ids:
            raise RuntimeError(f"GPU {assigned[0]} assigned by Ray is not in CUDA_VISIBLE_DEVICES={visible}")
        return ids.index(assigned[0])
    return int(assigned[0])


def _is_own(message: tuple) -> bool:
    """A step sent ahead whose placeholders the rank fills from its own last result (no "fill" follows)."""
    return len(message) > 3 and bool(message[2]) and bool(message[3])


class RankWorker:
    def __init__(self, rank: int):
        self.rank = rank
        shorten_switch_interval()  # the step loop's Python must not hold KV transfers and Ray's calls for 5 ms a turn
        self.runner: ModelRunner | None = None
        self.gpu: int | None = None  # set where this process sees all its node's GPUs (RANK_SEES_NODE_GPUS)

    def _bind_device(self) -> None:
        """CUDA's current device is per thread and Ray runs this actor's calls on a pool of threads: each
        call that touches the GPU first makes this rank's GPU current (a no-op when it sees one GPU only)."""
        if self.gpu is not None:
            torch.cuda.set_device(self.gpu)

    def rendezvous_address(self) -> tuple[str, int]:
        """Called on rank 0 only: where the process group's store will listen."""
        return node_address(), free_port(host="")  # other nodes connect to it

    def init(self, address: str, port: int, config: EngineConfig, hf_config, max_model_len: int,
             eos_token_ids: list[int], show_progress: bool, timeout_s: float) -> int:
        """Join the process group, load this rank's shard; returns how many KV blocks it can hold."""
        backend = "nccl" if config.model.resolved_device().type == "cuda" else "gloo"
        if backend == "nccl":
            set_rank_threads(config.parallel.world_size)
            if os.environ.get(RANK_SEES_NODE_GPUS) == "1":  # for P2P all-reduce (parallel/p2p_allreduce.py)
                import ray

                self.gpu = own_gpu_index([str(i) for i in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES"))
                self._bind_device()
        join_process_group(address, port, self.rank, config.parallel.world_size, backend, timeout_s)
        init_groups(config.parallel)
        self.runner = ModelRunner(config, hf_config, max_model_len, eos_token_ids, show_progress)
        return self.runner.num_blocks

    def resize_kv_cache(self, num_blocks: int) -> None:
        self._bind_device()
        self.runner.resize_kv_cache(num_blocks)

    def cuda_graph_sizes(self) -> list[int]:
        """The decode batch sizes this rank replays from CUDA graphs ([] when it runs eagerly)."""
        graphs = self.runner.cuda_graphs
        return sorted(graphs.graphs) if graphs is not None else []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step as a Ray task (tests and tools; the engine's steps go through the step loop)."""
        self._bind_device()
        result = self.runner.execute(out)
        # Only the output rank's answer is read; the others send nothing back.
        return result if self.runner.is_output_rank else None

    def start_step_loop(self, address: str, port: int, spin_s: float = 0.0, local_path: str | None = None) -> None:
        """Connect to the driver's step channel and serve its steps on a thread of this actor
        (cluster/step_channel.py); returns once connected. `spin_s`: poll for the next step this long."""
        self.decoder = StepDecoder()
        self._waiting: tuple[float, SchedulerOutput] | None = None  # a step sent ahead, until its fill
        # The only rank of its replica fills a step sent ahead itself, from its last answer's tokens (no fill
        # frame, no round trip through the driver). So does every rank of a TP-only replica after an all plain
        # greedy step, whose tokens each learns itself (`ModelRunner.greedy_everywhere`), when the driver says
        # `own`: on 2 x H100 (8B, ~98 sequences) a TP=2 decode step waited ~1 ms for the fill's round trip
        # rank 0 -> driver -> ranks, and rank 1, later, started its graph ~1.7 ms behind rank 0. Ranks without
        # the tokens (PP, SP, a step that sampled otherwise) take the fill.
        self._keep_sampled = self.runner.config.parallel.world_size == 1 or self.runner.greedy_everywhere
        self._last_result: ModelRunnerOutput | None = None  # the last step's result on this rank (kept only then)
        # The last step's tokens, one per sequence in its order, where its answer is that (every sequence sampled,
        # in step order: a decode step's): the next step's plain decodes take theirs by row (StepDecoder.decode).
        self._last_tokens: list[int] | None = None
        self.profile: RankProfile | None = logged_profile(self.rank)
        # A plain greedy decode step is launched and answered once its tokens are in; meanwhile the next step, sent
        # ahead, is taken in, and where it continues this one's decodes it is launched too, with this step's tokens on
        # the device (`_finish`). So the GPU does not idle while the rank answers and builds the next step: on 2 x H200
        # a TP=2 rank's decode step of ~100 sequences spent ~2.3 ms of its ~8.8 ms with the GPU idle (issue 26).
        self._launch = self._keep_sampled and launch_ahead_enabled(self.runner.device)
        # TANDEM_LAUNCH_MIXED=1 (default): plain greedy steps with prefill chunks are launched too, so the next step's message
        # is taken in and decoded while the GPU runs them (a TP=2 rank's mixed step on 2 x H200 spent ~1.8 ms decoding
        # its message and ~1.1 ms building its inputs with the GPU idle, of ~15.5 ms, 2026-11-29).
        self._launch_mixed = self._launch and launch_mixed_enabled()
        # steps run launched, those launched behind the one before, and those with prefill chunks
        self.launches = {"launched": 0, "continued": 0, "mixed": 0}
        # Start-up is over (weights, KV cache, graphs): its objects leave the collector's walks (workers/gc_freeze.py).
        freeze_startup_objects()
        self._answered_at = time.perf_counter()
        run_rank_loop((address, port), self.rank, self._on_message, spin_s, local_path)

    def _on_message(self, message: tuple):
        self._bind_device()  # the step loop's own thread
        kind = message[0]
        if kind == "step":  # ("step", payload, placeholders, own): with placeholders it waits for its "fill"
            start = time.perf_counter()
            if _is_own(message):  # the tokens are this rank's own last result's
                return self._run(start, decode_own(self.decoder, message[1], self._last_result, self._last_tokens,
                                                   f"rank {self.rank}"))
            out = self.decoder.decode(message[1])
            if len(message) > 2 and message[2]:
                self._waiting = (start, out)
                return NO_REPLY
            return self._run(start, out)
        if kind == "fill":  # ("fill", tokens): the tokens the step before sampled, for the step sent ahead
            if self._waiting is None:
                raise RuntimeError("a fill came with no step waiting for it")
            (start, out), self._waiting = self._waiting, None
            fill_placeholders(out.seqs, message[1])
            return self._run(start, out)
        if kind == "profile":  # ("profile", "start", gpu_every) or ("profile", "report")
            if message[1] == "start":
                if self.profile is not None:
                    self.profile.gc.remove()
                self.profile = RankProfile(self.rank, message[2])
                return None
            return self.profile.summary(starts=True) if self.profile is not None else {}
        raise ValueError(f"unknown step-channel message {kind!r}")

    def _run(self, start: float, out: SchedulerOutput):
        """Run a step: launched (a `Later` that finishes it) where it is a plain greedy decode this rank may launch,
        else whole."""
        if self._launch and (self.profile is None or not self.profile.samples_next()):
            launched_at = time.perf_counter()
            launched = self.runner.launch_greedy(out, mixed=self._launch_mixed)
            if launched is not None:
                self.launches["launched"] += 1
                self.launches["mixed"] += launched.mixed
                out.sample_seq_ids()  # made now: taking the next step in moves these very sequences on
                return Later(lambda peek: self._finish(start, launched_at, out, launched, peek))
        return self._step(start, out)

    def _finish(self, start: float, launched_at: float, out: SchedulerOutput, launched: LaunchedStep, peek):
        """Wait for a launched step's tokens and answer. A step that comes before they are in is taken in now; sent
        `own`, it is decoded now, and if it continues this step's plain decodes (the same sequences, or some of them)
        it is launched now too, its input tokens this step's on the device: it runs behind this one with no gap.
        Returns (this step's answer, what runs next or None)."""
        message = peek(launched.done)
        following = launched_next = None
        if message is not None and message[0] == "step" and _is_own(message):
            following = (time.perf_counter(), self.decoder.decode(message[1]))  # its placeholders: filled below
            # Only behind a decode step: `continue_rows` count that step's sequences in its order, and a launched
            # mixed step's `next_ids` hold its sampling ones only, decodes first.
            if (self.decoder.continues and not launched.mixed
                    and (self.profile is None or not self.profile.samples_next(ahead=1))):
                rows = self.decoder.continue_rows
                ids = launched.next_ids if rows is None else launched.next_ids.index_select(0, self.runner.on_device(rows))
                next_at = time.perf_counter()
                launched_next = self.runner.launch_greedy(following[1], ids)
        result = launched.finish()
        if self.profile is not None:
            self.profile.record(step_kind(out, self.runner.cuda_graphs), max(0.0, launched_at - self._answered_at),
                                launched_at - start, launched_at, time.perf_counter() - launched_at, len(out.seqs), len(out.seqs))
        packed = self._answer(result, out)
        if following is None:
            return packed, (None if message is None else lambda: self._on_message(message))
        fill_own(self.decoder, self._last_result, self._last_tokens, f"rank {self.rank}")
        step_start, step_out = following
        if launched_next is None:
            return packed, lambda: self._run(step_start, step_out)
        self.launches["launched"] += 1
        self.launches["continued"] += 1
        step_out.sample_seq_ids()
        return packed, lambda: Later(lambda p: self._finish(step_start, next_at, step_out, launched_next, p))

    def _step(self, start: float, out: SchedulerOutput):
        if self.profile is None:
            result = self.runner.execute(out)
        else:
            kind = step_kind(out, self.runner.cuda_graphs)
            result = self.profile.step(kind, start - self._answered_at, time.perf_counter() - start,
                                       lambda: self.runner.execute(out), out.num_tokens, len(out.seqs),
                                       phases=lambda: getattr(self.runner, "step_phases", {}))
        return self._answer(result, out)

    def _answer(self, result: ModelRunnerOutput, out: SchedulerOutput):
        if self._keep_sampled:  # a step sent ahead fills its placeholders from these (empty: it has none)
            self._last_result, self._last_tokens = result, tokens_by_row(result, out)
        # Only the output rank's answer is read: the others send nothing back, whatever they hold.
        packed = pack_output(result if self.runner.is_output_rank else None, out)
        self._answered_at = time.perf_counter()
        return packed

    def launch_counts(self) -> dict[str, int]:
        """How many steps this rank's loop ran launched, and how many of them behind the step before (tests)."""
        return dict(getattr(self, "launches", {}))

    def kv_setup(self, role: str) -> None:
        from workers.kv_transfer.transport import KVTransferAgent

        self._bind_device()
        self.kv_agent = KVTransferAgent(self.runner.kv_cache, self.runner.kv_shard(self.rank), role,
                                        self.runner.config.cache.kv_transfer_timeout_seconds,
                                        self.runner.track_chunk_ends() if role == "prefill" else None)

    def kv(self, method: str, *args):
        """KV transfers and their waits run on other actor threads, beside the steps (max_concurrency > 1)."""
        self._bind_device()
        return getattr(self.kv_agent, method)(*args)

