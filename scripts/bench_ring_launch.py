#!/usr/bin/env python3
"""Host cost of one SP rank's ring launches (parallel/ring_attention.py `_RingSteps`), per call, on a GPU.

At 16K tokens a ring step's kernel runs 0.3-1.1 ms, and the rank's first launch cannot start before the host has
set the ring up and issued it: that host time is part of the rank's time (tune_ring_kernel.py's ratio column
waits for the GPU before each run). This script splits it: with a spin kernel queued first (so no launch waits for
the GPU), the host microseconds of

  setup        `_RingSteps(...)`: the cached plan, the accumulators (setup_plan0: and the first launch's
               `StepLaunch`, kept in the plan after the first call)
  first        `_RingSteps(...)` and `step(0, own block)`: the host time from the call to the first kernel issued
               (plan: `_ring_plan`'s lookup; alloc: the accumulators; run0: the first launch's `StepLaunch.run`)
  step i       `steps.step(i, block)`: the launch as the ring issues it (a planned `StepLaunch` run)
  ring_step    the same launch through `ring_step` (checks and argument set-up on every call, as before plans)
  jit          the bare Triton launch `_ring_kernel[grid](...)` with the step's arguments ready (Triton's own path)
  handle       the compiled kernel's handle (`CompiledKernel[grid](...)`, no binding or cache lookup): the floor
  whole        `ring_rank_attention(...)`: everything a rank's call costs the host (whole_jit: with
               TANDEM_RING_DIRECT=0, every launch through the JIT path)

each the median of --iters calls, for each SP size at the given length (rank 0, the default config or
--config). The handle launch is checked against the ordinary one (same output, bitwise) before it is timed.

    python scripts/bench_ring_launch.py --tokens 16384 --sp 2,4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from parallel.kernels import ring_attention_triton as rt  # noqa: E402
from parallel.ring_attention import _RingSteps, _ring_plan, ring_rank_attention, split_for_ranks  # noqa: E402
from workers.sp_plan import owned_positions  # noqa: E402


def host_us(fn, iters: int) -> float:
    """Median host microseconds of fn() over `iters` calls, a long spin kernel queued first (no call waits)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # ~0.1 s at ~2 GHz: longer than every call below together
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def handle_args(launch: rt.StepLaunch, k: torch.Tensor, v: torch.Tensor, steps: _RingSteps) -> list:
    """The kernel's arguments in signature order for `steps`' tensors, constexprs included (Triton's
    `bound_args.values()`)."""
    return [*launch.args(k, v, steps.q, steps.acc, steps.out), *(launch.kw[name] for name in CONSTEXPRS)]


# The kernel's constexpr parameters (upper-case names), in signature order, after its runtime ones.
CONSTEXPRS = [name for name in rt._ring_kernel.arg_names if name.isupper()]
N_CONST = len(CONSTEXPRS)


class HandleLaunch:
    """A `StepLaunch` issued through the compiled kernel's handle: Triton's `CompiledKernel[grid](*args)`, with the
    arguments in signature order, constexprs included ("all") or, if this Triton's launcher refuses that, without
    ("runtime"); the kernel from `JITFunction.warmup` (compiled or found in its cache, not launched)."""

    def __init__(self, launch: rt.StepLaunch, steps: _RingSteps, kernel=None, form: str | None = None):
        self.launch, self.steps, self.kernel, self.form = launch, steps, kernel, form

    def run(self, k: torch.Tensor, v: torch.Tensor, *_call) -> None:
        """As `StepLaunch.run` (the ring's call; its tensors are `steps`')."""
        self(k, v)

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        cl = self.launch
        args = handle_args(cl, k, v, self.steps)
        if self.kernel is None:
            self.kernel = rt._ring_kernel.warmup(*args[:-N_CONST], grid=cl.grid, **cl.kw)
        run = self.kernel[(*cl.grid, 1, 1)]  # the handle's runner reads grid[0], grid[1] and grid[2]
        if self.form is None:
            try:
                run(*args)
                self.form = "all"
            except TypeError:
                run(*args[:-N_CONST])
                self.form = "runtime"
        else:
            run(*(args if self.form == "all" else args[:-N_CONST]))
        if cl.merge is not None:
            acc, out = self.steps.acc, self.steps.out
            rt._merge_kernel[cl.merge_grid](*cl.merge_parts, *acc, out if cl.writes_out else acc[0], *cl.merge_post,
                                            **cl.merge_kw)


def step_again(steps: _RingSteps, i: int, blocks: list[torch.Tensor], srcs: list[int]) -> None:
    """`steps.step(i, ...)` once more, the blocks it holds for a later scatter (fused, hybrid) as they were when
    step i first came (else each repeat would add one)."""
    if steps.hybrid or steps.fused:
        steps.pending[:] = [blocks[s] for s in srcs[0 if steps.hybrid else steps.f0:i]]
    steps.step(i, blocks[srcs[i]])


def one_sp(n: int, sp: int, config: str | None, iters: int, q, k, v) -> dict:
    positions = [owned_positions(0, n, r, sp, 16 if n >= 1024 else 4) for r in range(sp)]
    qs, blocks, shards = split_for_ranks(q, k, v, positions)
    scale = q.shape[-1] ** -0.5
    srcs = [(0 - s) % sp for s in range(sp)]
    make = lambda: _RingSteps(qs[0], blocks[0], shards[0], [shards[s] for s in srcs], scale, None, True,  # noqa: E731
                              config)
    want = ring_rank_attention(qs[0], blocks, shards, 0, scale, "triton", kernel_config=config)
    res = {"sp": sp, "setup": host_us(make, iters), "setup_plan0": host_us(lambda: make()._launch(0), iters),
           "first": host_us(lambda: make().step(0, blocks[0]), iters)}
    steps = make()
    # The first launch's pieces: the plan's lookup, the accumulators' allocation, the launch itself (K/V descriptors,
    # the handle's key, Triton's launcher).
    res["plan"] = host_us(lambda: _ring_plan(qs[0], blocks[0], shards[0], [shards[s] for s in srcs], config), iters)
    res["alloc"] = host_us(lambda: (torch.empty(steps.acc[0].shape, dtype=steps.acc[0].dtype, device="cuda"),
                                    torch.empty(steps.acc[1].shape, dtype=torch.float32, device="cuda")), iters)
    k0, v0 = blocks[0][0], blocks[0][1]
    res["run0"] = host_us(lambda: steps._launch(0).run(k0, v0, steps.q, steps.acc, steps.out), iters)
    last = steps.n_launch - 1
    for i, src in enumerate(srcs):  # each step's own call, on a ring set up once (its launches repeat)
        res[f"step{i}"] = host_us(lambda: step_again(steps, i, blocks, srcs), iters)
    kb = steps.fused_kv if steps.fused or steps.hybrid else blocks[srcs[-1]]
    if steps.hybrid:  # its last launch is over the other block alone
        kb = blocks[srcs[-1]]
    launch = steps._launch(last)
    tiles, merge, _ = steps.tables[last]
    load_prev, store_acc, _, groups = steps.specs[last]
    res["ring_step"] = host_us(lambda: rt.ring_step(
        steps.q, kb[0], kb[1], scale, tiles, steps.q_pos, steps.k_pos[last], steps.config, steps.acc, load_prev,
        store_acc, out=steps.out, tma=launch.tma, merge=merge, partials=steps.partials, chained=not steps.fused),
        iters) if groups is None else None
    args = handle_args(launch, kb[0], kb[1], steps)
    res["jit"] = host_us(lambda: rt._ring_kernel[launch.grid](*args[:-N_CONST], **launch.kw), iters)
    # The handle: the compiled kernel itself, called with every argument; checked first on a whole ring whose last
    # launch goes through it (same output as the ordinary launches, bitwise).
    try:
        check = make()
        handle = HandleLaunch(check._launch(last), check)
        check.launches[last] = handle  # this call's list: the plan keeps its own launch
        for i, src in enumerate(srcs):
            check.step(i, blocks[src])
        torch.cuda.synchronize()
        res["handle_exact"] = bool(torch.equal(check.out, want))
        res["handle_form"] = handle.form
        timed_handle = HandleLaunch(launch, steps, handle.kernel, handle.form)
        res["handle"] = host_us(lambda: timed_handle(kb[0], kb[1]), iters)
    except Exception as e:  # noqa: BLE001 - an API this Triton lacks: recorded, the rest stands
        res["handle_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    whole = lambda: ring_rank_attention(qs[0], blocks, shards, 0, scale, "triton", kernel_config=config)  # noqa: E731
    res["whole"] = host_us(whole, iters)
    before = os.environ.get(rt.DIRECT_ENV)
    os.environ[rt.DIRECT_ENV] = "0"  # a plan of its own (the plan's key holds the variable): the JIT path
    try:
        whole()
        res["whole_jit"] = host_us(whole, iters)
    finally:
        if before is None:
            del os.environ[rt.DIRECT_ENV]
        else:
            os.environ[rt.DIRECT_ENV] = before
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--sp", default="2,4")
    p.add_argument("--config", default=None, help="TANDEM_RING_KERNEL-style config (default: the kernel's default)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="bench_results/bench_ring_launch.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(a.tokens, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(a.tokens, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rows = [one_sp(a.tokens, int(sp), a.config, a.iters, q, k, v) for sp in a.sp.split(",") if sp]
    print(f"{torch.cuda.get_device_name()}: host us per call, rank 0, {a.tokens} tokens, config "
          f"{a.config or 'default (by SP size: default_config)'} (median of {a.iters}; a spin kernel queued first)")
    for r in rows:
        print("  " + "  ".join(f"{key} {val:.1f}" if isinstance(val, float) else f"{key} {val}"
                               for key, val in r.items()))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "tokens": a.tokens, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
