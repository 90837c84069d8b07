"""Which model the batch-1 fused decoder lets push its row-parallel partial sums (workers/models/fused_decode.py
`_pushed_partials`), and the slots' owner (parallel/p2p_allreduce.PushedPartials.claim). The slots themselves
need CUDA symmetric memory; their kernels are tested in tests/test_pushed_partials_interpreted.py and on GPUs. Also:
every rank falls back to the all-reduce when one cannot allocate its slots, none entering the mapping collective;
and which kernel the P2P all-reduce picks by message size."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

from parallel.p2p_allreduce import PushedPartials
from workers.models.fused_decode import _pushed_partials


def _slots(width: int, sites: int) -> PushedPartials:
    pushed = PushedPartials.__new__(PushedPartials)  # the bookkeeping only: no device memory on CPU
    pushed.width, pushed.sites, pushed._owner = width, sites, None
    return pushed


class _Model:
    def __init__(self, pushed, layers: int = 2, hidden: int = 64, quantized: bool = False):
        group = SimpleNamespace(pushed_partials=pushed)
        lin = lambda: SimpleNamespace(group=group, gemv_weight=object() if quantized else None)  # noqa: E731
        self.config = SimpleNamespace(hidden_size=hidden)
        self.layers = {str(i): SimpleNamespace(self_attn=SimpleNamespace(qkv_proj=lin(), o_proj=lin()),
                                               mlp=SimpleNamespace(gate_up_proj=lin(), down_proj=lin()))
                       for i in range(layers)}


def test_the_slots_serve_one_model_of_their_shape():
    pushed = _slots(64, 4)
    target = _Model(pushed)
    assert _pushed_partials(target) is pushed
    assert _pushed_partials(_Model(pushed)) is None  # a second model (a draft) would share the sites: refused
    assert _pushed_partials(_Model(_slots(64, 6))) is None  # more sites than the model's 2 x layers
    assert _pushed_partials(_Model(_slots(32, 4))) is None  # another width
    assert _pushed_partials(_Model(_slots(64, 4), quantized=True)) is None  # the quantized GEMVs do not push
    assert _pushed_partials(_Model(None)) is None  # no slots (one rank, NCCL only, TANDEM_TP_PUSH_PARTIALS=0)


def test_the_owner_is_held_weakly_and_the_next_model_takes_over():
    pushed = _slots(64, 4)
    first = _Model(pushed)
    assert pushed.claim(first) and pushed.claim(first)
    second = _Model(pushed)
    assert not pushed.claim(second)
    del first
    gc.collect()
    assert pushed.claim(second)


def _agreement_rank(rank: int) -> None:
    """Rank 0 cannot allocate its slots, rank 1 can: neither maps them (a collective rank 0 would never join)."""
    import torch
    import torch.distributed._symmetric_memory as symm_mem

    from parallel import p2p_allreduce
    from parallel.state import tp_group

    def empty(n, dtype, device):
        if rank == 0:
            raise torch.OutOfMemoryError("no room for the slots")
        return torch.empty(n, dtype=dtype)

    symm_mem.empty = empty
    mapped = []
    p2p_allreduce.PushedPartials = lambda *a: mapped.append(a)  # reached only past the agreement
    group = tp_group()
    group.fast_all_reduce = lambda x: False  # as if the P2P all-reduce were up
    assert not p2p_allreduce.enable_pushed_partials(group, torch.device("cpu"), torch.bfloat16, 64, 4)
    assert mapped == [] and group.pushed_partials is None


def test_a_rank_that_cannot_allocate_the_slots_leaves_every_rank_on_the_all_reduce():
    from tests.multiprocess import run_ranks

    run_ranks(_agreement_rank, 2, parallel={"tensor_parallel_size": 2})


def test_the_p2p_all_reduce_picks_its_kernel_by_size():
    """parallel/p2p_allreduce.P2PAllReduce: the one-shot kernel up to its limit, the two-shot (its input staged in
    the mapped buffer) up to the larger one, and NCCL (False: not taken) above; the kernels themselves run on GPUs
    (scripts/bench_allreduce.py checks every sum)."""
    import torch

    from parallel.p2p_allreduce import P2PAllReduce

    calls = []
    reducer = P2PAllReduce.__new__(P2PAllReduce)  # the routing only: no mapped memory on CPU
    reducer.group_name, reducer.dtype = "tp", torch.bfloat16
    reducer.one_shot_max, reducer.two_shot_max, reducer.max_bytes = 64, 256, 256
    reducer.buffer = torch.zeros(128, dtype=torch.bfloat16)
    reducer.one_shot = lambda buf, x, op, group, out: calls.append(("one", buf.numel()))
    reducer.two_shot = lambda staged, op, group, out: calls.append(("two", bool(torch.equal(staged, out))))
    assert reducer(torch.ones(32, dtype=torch.bfloat16)) and reducer(torch.full((64,), 2.0, dtype=torch.bfloat16))
    assert not reducer(torch.ones(136, dtype=torch.bfloat16))  # 272 bytes: NCCL's
    assert not reducer(torch.ones(32))  # another dtype
    assert calls == [("one", 32), ("two", True)]


def test_the_take_wait_mode_is_read_and_a_bad_one_refused(monkeypatch):
    from parallel.kernels.gemv import TAKE_WAIT_ENV, take_waits_for_grid

    monkeypatch.delenv(TAKE_WAIT_ENV, raising=False)
    assert not take_waits_for_grid()
    monkeypatch.setenv(TAKE_WAIT_ENV, " Grid ")
    assert take_waits_for_grid()
    monkeypatch.setenv(TAKE_WAIT_ENV, "never")
    with pytest.raises(ValueError, match="TANDEM_TP_TAKE_WAIT='never'"):
        take_waits_for_grid()


def test_the_greedy_rows_are_pushed_only_when_asked_and_the_p2p_all_reduce_is_up(monkeypatch):
    import torch

    from parallel import p2p_allreduce
    from parallel.state import Group

    made = []
    monkeypatch.setattr(p2p_allreduce, "_symmetric_slots", lambda *a: made.append(a) or "slots")
    group = Group(ranks=[0, 1], rank=0)
    monkeypatch.setenv(p2p_allreduce.GREEDY_GATHER_ENV, "nccl")
    group.fast_all_reduce = lambda x: False
    assert not p2p_allreduce.enable_pushed_greedy(group, torch.device("cpu"), 8)  # nccl: the all-gather
    monkeypatch.delenv(p2p_allreduce.GREEDY_GATHER_ENV, raising=False)  # push, the default
    group.fast_all_reduce = None
    assert not p2p_allreduce.enable_pushed_greedy(group, torch.device("cpu"), 8)  # no mapped memory
    group.fast_all_reduce = lambda x: False
    assert p2p_allreduce.enable_pushed_greedy(group, torch.device("cpu"), 8) and group.pushed_greedy == "slots"
    assert [a[2:5] for a in made] == [(torch.float64, 24, 3)]  # 3 sites of 8 rows of (max, id, lse)
    monkeypatch.setenv(p2p_allreduce.GREEDY_GATHER_ENV, "all-gather")
    with pytest.raises(ValueError, match="TANDEM_TP_GREEDY_GATHER='all-gather'"):
        p2p_allreduce.greedy_gather_pushed()
