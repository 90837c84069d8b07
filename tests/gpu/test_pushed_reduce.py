"""The pushed all-reduce (parallel/kernels/pushed_reduce.py, TANDEM_P2P_PUSHED) compiled, on one GPU, before any
two-GPU run: two TP ranks played on the same device, each with its own slots, pointers and rotation state.

- Halves in turn (every rank pushes, then every rank sums): exact sums in rank order, every rank the same bits,
  over more uses than sites, with messages that grow and shrink (the resets must cover the longer ones) and more
  blocks than CTAs (the grid-stride loops).
- The whole kernel (push and sum in one launch, as on two GPUs), each rank on its own stream at once: a rank's CTAs
  wait for the other's pushes, so this also shows that every CTA of both launches is resident together.
- Replayed from CUDA graphs, one a rank, new inputs each replay: the device state moves the site on, so replays
  never reuse a site the peer may still read.
The two-GPU run in the engine: tests/gpu/test_two_gpu_bf16.py -k pushed_all_reduce."""
from __future__ import annotations

import pytest
import torch

DEV = "cuda"


def _played(world: int, width: int, dtype: torch.dtype):
    from parallel.kernels import pushed_reduce as P
    from parallel.p2p_allreduce import mark_empty

    slots = [torch.empty(P.SITES, world, width, dtype=dtype, device=DEV) for _ in range(world)]
    for t in slots:
        mark_empty(t)
    size = slots[0].element_size()
    ptrs = [torch.tensor([[slots[q].data_ptr() + (s * world + r) * width * size for q in range(world)]
                          for s in range(P.SITES)], dtype=torch.int64, device=DEV) for r in range(world)]
    return slots, ptrs, [P.new_state(DEV) for _ in range(world)]


def _parts(n: int, world: int, dtype: torch.dtype, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    parts = [torch.randn(n, device=DEV, generator=g).to(dtype) for _ in range(world)]
    parts[0][:5] = -0.0
    want = parts[0].float()
    for q in parts[1:]:
        want = want + q.float()
    return parts, want.to(dtype)


def _sizes(blocks_over_grid: int) -> list[int]:
    from parallel.kernels import pushed_reduce as P

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    big = blocks_over_grid * P.CTAS_PER_SM * sms * P.BLOCK + 77  # more blocks than CTAs, and a ragged end
    return [big, 4096, 1_048_576 + 3, 2048, big // 2, 8]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_halves_in_turn_sum_exactly_over_rotating_sites(dtype):
    from parallel.kernels.pushed_reduce import pushed_all_reduce

    world, sizes = 2, _sizes(3)
    slots, ptrs, state = _played(world, max(sizes), dtype)
    for use, n in enumerate(sizes):
        parts, want = _parts(n, world, dtype, use)
        for r in range(world):
            pushed_all_reduce(parts[r], slots[r], ptrs[r], state[r], r, world, reduce=False)
        for r in range(world):
            pushed_all_reduce(parts[r], slots[r], ptrs[r], state[r], r, world, push=False)
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(parts[r], want), (use, r)
            assert torch.equal(parts[r].view(torch.int16), parts[0].view(torch.int16))
            assert int(state[r][0]) == use + 1 and int(state[r][1]) == 0


def _both_at_once(parts, slots, ptrs, state, streams):
    from parallel.kernels.pushed_reduce import pushed_all_reduce

    main = torch.cuda.current_stream()
    for r, s in enumerate(streams):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            pushed_all_reduce(parts[r], slots[r], ptrs[r], state[r], r, len(streams))
    for s in streams:
        main.wait_stream(s)


def test_whole_kernels_of_two_ranks_at_once_on_two_streams():
    world, dtype, sizes = 2, torch.bfloat16, _sizes(2)
    slots, ptrs, state = _played(world, max(sizes), dtype)
    streams = [torch.cuda.Stream() for _ in range(world)]
    for use, n in enumerate(sizes * 2):
        parts, want = _parts(n, world, dtype, 100 + use)
        _both_at_once(parts, slots, ptrs, state, streams)
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(parts[r], want), (use, r)


def test_cuda_graph_replays_rotate_the_sites():
    world, dtype, n = 2, torch.bfloat16, 3 * 1024 * 1024 + 5
    slots, ptrs, state = _played(world, n, dtype)
    streams = [torch.cuda.Stream() for _ in range(world)]
    bufs = [torch.zeros(n, dtype=dtype, device=DEV) for _ in range(world)]
    _both_at_once(bufs, slots, ptrs, state, streams)  # a warm-up use (compiles): the turn moves on to 1
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in range(world)]
    for r in range(world):  # captured one after the other: nothing runs at capture, so nothing waits
        from parallel.kernels.pushed_reduce import pushed_all_reduce

        with torch.cuda.graph(graphs[r], stream=streams[r]):
            pushed_all_reduce(bufs[r], slots[r], ptrs[r], state[r], r, world)
    for replay in range(2 * 3 + 1):  # more replays than sites
        parts, want = _parts(n, world, dtype, 200 + replay)
        for r in range(world):
            bufs[r].copy_(parts[r])
        torch.cuda.synchronize()
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(bufs[r], want), (replay, r)
            assert int(state[r][0]) == replay + 2
