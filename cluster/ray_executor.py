"""`RayExecutor`: a replica's ranks as Ray actors, driven one step at a time.

Start-up: place the ranks (`placement.py`), start one `RankWorker` actor per rank, ask rank 0 for a
rendezvous address, then every rank joins torch.distributed (gloo on CPU, NCCL on CUDA), builds its
process groups and loads its shard. The KV cache is cut down to the smallest block count of any
rank, since the scheduler's block ids must be valid on all of them.

A step goes through the step channel (cluster/step_channel.py), not a Ray task: the changes since the
last step (workers/step_delta.py) are pickled once and sent to every rank's loop over its own TCP
connection; every rank answers, the output rank (last pipeline stage, first TP rank) with the sampled
tokens. `submit` returns once the step is sent, so the engine's text work for one step runs while the
ranks compute the next (LLMEngine.step). A step sent ahead (asynchronous scheduling) waits on the ranks for
the tokens of the step before, which the driver forwards in a small "fill" message, unless every rank has them
itself: the only rank of a replica, or every rank of a TP-only replica after an all plain greedy step
(`tp_ranks_fill_own`); then the step goes `own` and no fill follows.

Failure: every wait has a deadline, and results are collected as they arrive, so a rank that dies
or raises is noticed at once even while the others sit in a collective waiting for it. The executor
then kills every rank (the survivors may be stuck in that collective) and raises `ExecutorError`
naming the rank.
"""
from __future__ import annotations

import time
from typing import NoReturn

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster.placement import RankPlacement
from cluster.rank_worker import RankWorker
from cluster.ray_runtime import ensure_ray, rank_runtime_env
from cluster.rendezvous import node_address
from cluster.step_channel import RankFailure, StepChannel
from parallel.state import rank_grid
from parallel.config import ParallelConfig
from workers.config import EngineConfig
from workers.executor import Executor, ExecutorError, PendingStep
from workers.kv_transfer.peer_ipc import peer_ipc_enabled
from workers.scheduler_output import ModelRunnerOutput, SchedulerOutput, num_placeholders
from workers.step_delta import StepEncoder, sampled_on_every_tp_rank, tp_own_fill_enabled, unpack_output

PLACEMENT_TIMEOUT_S = 300.0  # resources exist but are held by others: wait this long for them
INIT_TIMEOUT_S = 900.0  # process start, weight loading
STEP_TIMEOUT_S = 300.0  # one step on every rank
# GPU ranks: how long the driver polls for a step's answers, and a rank loop for the next step, before
# blocking (cluster/step_channel.py). The driver's covers a decode step (5-15 ms for an 8B model); a
# prefill-heavy step (tens of ms) then pays one wake-up, which is small against it, and the driver leaves
# the core (possibly a hyperthread sibling of a rank's launching thread) alone. The ranks' covers the
# driver's work between two steps; an idle engine's ranks block after 50 ms.
DRIVER_SPIN_S = 0.02
RANK_SPIN_S = 0.05


def tp_ranks_fill_own(parallel: ParallelConfig, step_groups: int) -> bool:
    """Whether every rank may fill a step sent ahead itself after an all plain greedy step: a TP-only replica
    (PP's later stages and SP's other ranks never see the tokens), one step out at a time (the placeholders are
    the last step sent's), unless TANDEM_TP_OWN_FILL=0. Must agree with `ModelRunner.greedy_everywhere`."""
    return (parallel.tensor_parallel_size > 1 and parallel.pipeline_parallel_size == 1
            and parallel.sequence_parallel_size == 1 and step_groups == 1 and tp_own_fill_enabled())


def ranks_see_node_gpus(parallel: ParallelConfig, use_cuda: bool) -> bool:
    """Whether the rank actors on GPUs see every GPU of their node (else each sees its own): a TP group's for its P2P
    all-reduce, and any rank (a pool replica's) so that a decode rank can map a prefill rank's KV cache on the same
    node (workers/kv_transfer/peer_ipc.py; TANDEM_KV_PEER_IPC=0 turns that off)."""
    return use_cuda and (peer_ipc_enabled() or parallel.tensor_parallel_size > 1 and not parallel.disable_p2p_all_reduce)


class RayExecutor(Executor):
    overlaps_host_work = True  # the ranks compute while the engine's thread does its text work
    supports_ahead = True  # a step may be sent while the one before is out (asynchronous scheduling)

    def __init__(self, config: EngineConfig, hf_config, max_model_len: int, eos_token_ids: list[int], show_progress: bool = True,
                 init_timeout_s: float = INIT_TIMEOUT_S, step_timeout_s: float = STEP_TIMEOUT_S):
        self.parallel = config.parallel
        self.step_timeout_s = step_timeout_s
        self.world_size = self.parallel.world_size
        # A TP-only replica's ranks each learn an all plain greedy step's tokens (`ModelRunner.greedy_everywhere`):
        # the step sent ahead after one is sent `own`, and filled by every rank itself, without the fill's round
        # trip rank 0 -> driver -> ranks that cost a TP=2 decode step ~1 ms on 2 x H100 (8B, ~98 sequences; issue 26).
        self._tp_own = tp_ranks_fill_own(self.parallel, config.step_groups)
        self._last_known_everywhere = False  # the last step sent: every rank will know its tokens (`_tp_own` only)
        self._own_ahead = False  # the step sent ahead is filled by the ranks themselves: `fill` sends nothing
        self.own_fills = 0  # steps sent ahead that the ranks filled themselves (tests, diagnosis)
        self._error: str | None = None
        self._coords = {r: (p, s, t) for p, stage in enumerate(rank_grid(self.parallel))
                        for s, row in enumerate(stage) for t, r in enumerate(row)}
        self.output_rank = rank_grid(self.parallel)[-1][0][0]
        self.workers: list = []
        self.placement: RankPlacement | None = None
        self.channel: StepChannel | None = None
        self._inflight: PendingStep | None = None  # the newest step sent; it collects any older one first
        # Pipelined steps: up to one per stage out at once, each over its own group of sequences.
        self.max_steps_in_flight = config.step_groups
        self._steps_out = 0  # sent and not yet collected
        self._to_fill = 0  # placeholders of the step sent ahead, which the ranks hold until `fill`
        use_cuda = config.model.resolved_device().type == "cuda"
        self._spin = use_cuda  # CPU ranks compute on the cores a spinning wait would take
        ensure_ray(self.world_size)
        self.placement = RankPlacement(self.parallel, use_cuda, PLACEMENT_TIMEOUT_S)
        try:
            actor = ray.remote(RankWorker)
            resources = {"num_gpus": self.parallel.gpus_per_rank, "num_cpus": 0} if use_cuda else {"num_cpus": 1}
            resources["resources"] = dict(self.parallel.rank_resources)
            see_node_gpus = ranks_see_node_gpus(self.parallel, use_cuda)
            self.workers = [
                actor.options(**resources, scheduling_strategy=self.placement.strategy(r), runtime_env=rank_runtime_env(see_node_gpus),
                              max_restarts=0, max_concurrency=16).remote(r)
                for r in range(self.world_size)
            ]
            address, port = self._collect({0: self.workers[0].rendezvous_address.remote()}, init_timeout_s, "rendezvous")[0]
            blocks = self._collect({
                r: w.init.remote(address, port, config, hf_config, max_model_len, eos_token_ids, show_progress and r == 0, init_timeout_s)
                for r, w in enumerate(self.workers)
            }, init_timeout_s, "start-up")
            self.num_blocks = min(blocks.values())
            self._collect({r: w.resize_kv_cache.remote(self.num_blocks) for r, w in enumerate(self.workers)}, init_timeout_s, "KV cache sizing")
            self._open_step_channel(init_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _open_step_channel(self, timeout_s: float) -> None:
        self.channel = StepChannel(node_address(), self.world_size, spin_s=DRIVER_SPIN_S if self._spin else 0.0)
        self.encoder = StepEncoder()
        rank_spin_s = RANK_SPIN_S if self._spin else 0.0
        refs = {r: w.start_step_loop.remote(*self.channel.address, rank_spin_s, self.channel.local_path) for r, w in enumerate(self.workers)}
        try:
            self.channel.accept(timeout_s)
        except TimeoutError as e:
            self._collect(refs, 1.0, "step loop start")  # a rank that failed to connect says why
            self._fail(f"step loop start: {e}", e)
        self._collect(refs, timeout_s, "step loop start")

    @property
    def needs_fill(self) -> bool:  # type: ignore[override]
        """Whether the step sent last needs `fill`: not at world size 1, nor one sent `own` (the engine then does not
        build the token list at all)."""
        return self.world_size > 1 and not self._own_ahead

    def describe(self, rank: int) -> str:
        p, s, t = self._coords[rank]
        return f"rank {rank} (pp={p}, sp={s}, tp={t})"

    @property
    def alive(self) -> bool:
        """False once a rank failed (every rank is then killed) or after shutdown."""
        return self._error is None and bool(self.workers)

    def _check_usable(self, what: str) -> None:
        if self._error is not None:
            raise ExecutorError(f"the executor failed earlier and cannot {what}: {self._error}")
        if not self.workers:
            raise ExecutorError("the executor was shut down")

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(out).result()

    def submit(self, out: SchedulerOutput, ahead: bool = False, overlap: bool = False) -> PendingStep:
        """Send the step to every rank and return at once; `result()` waits for the answers. Without
        `ahead` or `overlap`, an uncollected earlier step is collected first. With `ahead`, the earlier steps
        may still be out (one, or with pipelined steps one per group): the ranks run this one after them,
        once `fill` has sent its placeholders' tokens. With `overlap`, up to `max_steps_in_flight - 1` earlier
        steps over other sequences stay out: every rank takes its steps in the order sent, so the first stage
        starts this one as soon as it has passed its part of them on, while the later stages still run them.
        Either way this step's `result()` collects the earlier ones first (answers come back in order)."""
        self._check_usable("run more steps")
        if self._to_fill:
            raise ExecutorError("a step was sent ahead and its placeholders were never filled")
        if overlap and (ahead or self._steps_out >= self.max_steps_in_flight):
            raise ExecutorError(f"{self._steps_out} steps are out, at most {self.max_steps_in_flight} may be "
                                "(and none sent ahead beside them)")
        previous = self._inflight if ahead or overlap else None
        if previous is None:
            self._settle()
        to_fill = num_placeholders(out)
        payload = self.encoder.encode(out)
        # The ranks have the tokens themselves (the only rank; TP-only ranks after an all plain greedy step): they fill
        # the step without a `fill`. Its placeholders are the last step sent's tokens (one step out: `_tp_own`).
        own = self.world_size == 1 or (self._tp_own and self._last_known_everywhere and ahead)
        if self._tp_own:
            self._last_known_everywhere = sampled_on_every_tp_rank(out)
        try:
            self.channel.broadcast(("step", payload, to_fill, own))
        except RankFailure as e:
            self._step_failed("step", e)
        self._to_fill = 0 if own else to_fill
        self._own_ahead = bool(own and to_fill)
        self.own_fills += self._own_ahead and self.world_size > 1
        self._steps_out += 1

        def collect() -> ModelRunnerOutput:
            if previous is not None:
                previous.result()
            if self._inflight is pending and self._to_fill:  # the ranks would wait for the fill forever
                raise ExecutorError("a step's result was asked for before its placeholders were filled")
            result = self._collect_step(out)
            self._steps_out -= 1
            return result

        pending = self._inflight = PendingStep(collect)
        return pending

    def fill(self, tokens: list[int]) -> None:
        if self.world_size == 1 or self._own_ahead:
            self._own_ahead = False
            return  # the ranks filled the step themselves, from the result these tokens came in
        if len(tokens) != self._to_fill:
            raise ExecutorError(f"the step sent ahead has {self._to_fill} placeholders, {len(tokens)} tokens came")
        if not tokens:
            return
        self._to_fill = 0
        try:
            self.channel.broadcast(("fill", tokens))
        except RankFailure as e:
            self._step_failed("fill", e)

    def _collect_step(self, out: SchedulerOutput) -> ModelRunnerOutput:
        try:
            results = self.channel.gather(self.step_timeout_s)
        except RankFailure as e:
            self._step_failed("step", e)
        return unpack_output(results[self.output_rank], out)

    def _settle(self) -> None:
        if self._inflight is not None:
            pending, self._inflight = self._inflight, None
            pending.result()

    def _step_failed(self, what: str, e: RankFailure) -> NoReturn:
        if len(e.late) > 1:
            self._fail(f"{what}: {', '.join(self.describe(r) for r in e.late)} {e.what}", e)
        self._fail(f"{what}: {self.describe(e.rank)} {e.what}", e)

    def profile(self, action: str, gpu_every: int = 0) -> list[dict]:
        self._check_usable("profile")
        self._settle()
        message = ("profile", "start", gpu_every) if action == "start" else ("profile", "report")
        try:
            self.channel.broadcast(message)
            results = self.channel.gather(self.step_timeout_s)
        except RankFailure as e:
            self._step_failed("profile", e)
        return [] if action == "start" else [results[r] for r in range(self.world_size)]

    def kv_setup(self, role: str) -> None:
        self._collect({r: w.kv_setup.remote(role) for r, w in enumerate(self.workers)}, self.step_timeout_s, "KV agent set-up")

    def kv_call(self, method: str, *args, ranks: list[int] | None = None) -> list:
        from workers.kv_transfer.transport import KVTransferError

        self._check_usable(f"run KV {method}")
        ranks = list(range(self.world_size)) if ranks is None else ranks
        refs = {r: self.workers[r].kv.remote(method, *args) for r in ranks}
        try:
            results = [ray.get(refs[r], timeout=self.step_timeout_s) for r in ranks]
        except RayTaskError as e:  # the transfer failed on that rank: the ranks themselves are fine
            raise KVTransferError(str(e.cause)) from e
        except GetTimeoutError as e:
            raise KVTransferError(f"KV {method} did not finish within {self.step_timeout_s:.0f}s") from e
        except RayActorError as e:
            self._fail(f"KV {method}: a rank died ({type(e).__name__}: {e})", e)
        return results

    def _collect(self, refs: dict[int, ray.ObjectRef], timeout_s: float, what: str) -> dict:
        """Results by rank. Fails fast: the first rank to die or raise ends the wait."""
        rank_of = {ref: rank for rank, ref in refs.items()}
        pending = list(refs.values())
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                late = ", ".join(self.describe(rank_of[ref]) for ref in pending)
                self._fail(f"{what}: {late} did not answer within {timeout_s:.0f}s")
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
                except RayActorError as e:  # includes ActorDiedError
                    self._fail(f"{what}: {self.describe(rank)} died ({type(e).__name__}: {e})", e)
                except RayTaskError as e:
                    self._fail(f"{what}: {self.describe(rank)} raised {e.cause!r}", e)
                except GetTimeoutError as e:
                    self._fail(f"{what}: the result of {self.describe(rank)} did not arrive within {timeout_s:.0f}s", e)
        return results

    def _fail(self, message: str, cause: BaseException | None = None) -> NoReturn:
        # The other ranks may be blocked in a collective with the failed one: kill them all.
        self._error = message
        self.shutdown()
        raise ExecutorError(message) from cause

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()  # the rank loops see the connection end and return
            self.channel = None
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already dead, or Ray is gone: nothing to release
                pass
        self.workers = []
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
