"""Triton's own hook calls reach the compile watch: once armed, a new specialisation of a kernel (an
integer argument that now divides by 16) counts as one compile while serving, a launch of a known
variant counts nothing."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel.kernels import compile_watch


@triton.jit
def _fill_kernel(out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, offs.to(tl.float32), mask=offs < n)


def test_a_new_specialisation_after_arming_is_counted_once():
    assert compile_watch.install()
    out = torch.empty(64, device="cuda")
    _fill_kernel[(1,)](out, 7, BLOCK=64)  # before arming: start-up's compile
    compile_watch.arm()
    try:
        before = compile_watch.compiles_while_armed()
        _fill_kernel[(1,)](out, 9, BLOCK=64)  # the same variant as n=7
        assert compile_watch.compiles_while_armed() == before
        _fill_kernel[(1,)](out, 32, BLOCK=64)  # n % 16 == 0: Triton specialises on it
        torch.cuda.synchronize()
        assert compile_watch.compiles_while_armed() == before + 1
        assert out[:32].tolist() == [float(i) for i in range(32)]
    finally:
        compile_watch.disarm()


def test_served_step_shapes_compile_nothing_after_start_up():
    """The start-up warm-up leaves no Triton variant for serving to compile: one long decode beside a prompt's
    last few tokens (the split-context kernel and every count of context slices its merge takes), a prompt of a
    few tokens alone, and a long prompt's prefill. On 2 x H100 the first such step stalled 1.06 s."""
    from tandem import LLM, SamplingParams
    from workers.scheduler_output import ScheduledSeq, SchedulerOutput

    llm = LLM("models/tandem-tiny", device="cuda", dtype="bfloat16", max_model_len=1024)
    runner = llm.llm_engine.executor.runner
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    before = compile_watch.compiles_while_armed()
    bs = runner.block_size
    for ctx in (40, 100, 300, 700, 1000):
        n = -(-(ctx + 9) // bs)
        decode = ScheduledSeq("d", [1], ctx, list(range(n)), True, greedy, 1)
        tail = ScheduledSeq("t", [2] * 9, ctx, list(range(n, 2 * n)), True, greedy, 0)
        runner.execute(SchedulerOutput([decode, tail]))
        runner.execute(SchedulerOutput([tail]))
    llm.generate([[3] * 5, [4] * 900], SamplingParams(max_tokens=4, temperature=0.0))
    torch.cuda.synchronize()
    assert compile_watch.compiles_while_armed() == before


def test_a_kv_transfer_agent_compiles_its_copy_kernels_at_set_up_unlogged():
    """The KV handoff's row-copy kernels compile when the rank's transfer agent is made, with the watch paused (set-up,
    not serving), so a handoff's gathers and scatters find them: on 2 x H100 a pair's first join compiled them while
    its replicas served (0.07-0.17 s each)."""
    from parallel.kernels import block_copy
    from workers.kv_transfer.blocks import _as_wire, _as_words
    from workers.kv_transfer.plan import RankShard
    from workers.kv_transfer.transport import KVTransferAgent

    assert compile_watch.install()
    cache = torch.zeros(2, 2, 8, 16, 2, 64, dtype=torch.bfloat16, device="cuda")  # [L, 2, blocks, page, H, D]
    compile_watch.arm()
    try:
        before = compile_watch.compiles_while_armed()
        KVTransferAgent(cache, RankShard(0, range(2), range(2)), "decode")
        assert compile_watch.compiles_while_armed() == before  # compiled at set-up, not counted as serving
        block_copy.warm_up(cache.device, _as_words(_as_wire(cache)).dtype)  # every variant a handoff launches
        assert compile_watch.compiles_while_armed() == before  # already there
    finally:
        compile_watch.disarm()
