"""The Triton GEMV equals an fp32 reference as closely as cuBLAS does: ragged N and K, bias,
strided x, several tile configs; the model's linears route exactly batch-1 calls to it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

DEV = "cuda"


def _check(x, w, b, config=None):
    from parallel.kernels.gemv import gemv

    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = gemv(x, w, b, config)
    cublas = F.linear(x, w, b)
    assert got.shape == ref.shape and got.dtype == x.dtype
    scale = ref.abs().max().item()
    err = (got.float() - ref).abs().max().item() / scale
    err_cublas = (cublas.float() - ref).abs().max().item() / scale
    # fp32 accumulation, then one rounding to the 16-bit dtype: the same error budget as cuBLAS
    assert err <= max(2 * err_cublas, 1e-2), (err, err_cublas)


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (128256, 4096), (1000, 136), (37, 4104)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(n, k, dtype):
    torch.manual_seed(n + k)
    x = torch.randn(1, k, device=DEV).to(dtype)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    _check(x, w, None)


@pytest.mark.parametrize("block_n,block_k,warps", [(8, 1024, 8), (16, 256, 4), (32, 512, 8)])
def test_configs_and_bias(block_n, block_k, warps):
    torch.manual_seed(0)
    cfg = dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=3)
    x = torch.randn(1, 2056, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(3000, 2056, device=DEV, dtype=torch.bfloat16) / 45
    b = torch.randn(3000, device=DEV, dtype=torch.bfloat16)
    _check(x, w, b, cfg)
    _check(x, w, None, cfg)


def test_strided_input_and_dispatch():
    """x as a slice of a wider row, and which calls `supports` takes (more rows: tests/gpu/test_gemv_rows.py)."""
    from parallel.kernels.gemv import max_rows, supports

    x = torch.randn(1, 8192, device=DEV, dtype=torch.bfloat16)[:, :4096]
    w = torch.randn(512, 4096, device=DEV, dtype=torch.bfloat16) / 64
    _check(x, w, None)
    assert supports(x, w)
    assert not supports(torch.randn(max_rows() + 1, 4096, device=DEV, dtype=torch.bfloat16), w)
    assert not supports(x.float(), w.float())
    assert not supports(x.cpu(), w.cpu())


def test_parallel_linear_routes_batch_one_in_graphs():
    """Calls of 1..max_rows() rows captured in a CUDA graph run the GEMV; eager calls and larger batches
    run cuBLAS."""
    from parallel.matmul import linear
    from parallel.kernels.gemv import gemv, max_rows

    torch.manual_seed(0)
    w = torch.randn(2048, 1024, device=DEV, dtype=torch.bfloat16) / 32
    for m in (1, 4, max_rows() + 1):
        x = torch.randn(m, 1024, device=DEV, dtype=torch.bfloat16)
        assert torch.equal(linear(x, w), F.linear(x, w))  # eager: cuBLAS, bit for bit
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            linear(x, w)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = linear(x, w)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, gemv(x, w) if m <= max_rows() else F.linear(x, w))


def _two_rank_slots(k: int, sites: int, dtype=torch.bfloat16):
    """Two TP ranks' pushed-partials slots on one GPU, each rank's `site(rank, s)` as PushedPartials gives it."""
    from parallel.p2p_allreduce import EMPTY_BITS, PushedSite

    slots = [torch.empty(sites, 2, k, dtype=dtype, device=DEV) for _ in range(2)]
    for t in slots:
        t.view(torch.int16).fill_(EMPTY_BITS)

    def site(rank: int, s: int) -> PushedSite:
        ptrs = [slots[p].data_ptr() + (s * 2 + rank) * k * dtype.itemsize for p in range(2)]
        return PushedSite(2, slots[rank][s], slots[rank][(s - 1) % sites], torch.tensor(ptrs, device=DEV))
    return slots, site


@pytest.mark.parametrize("take_wait,take_x", [("grid", "l2"), ("slots", "l2"), ("slots", "l1")])
def test_pushed_partials_in_a_graph_give_the_all_reduced_values(take_wait, take_x, monkeypatch):
    """The compiled push / take / sum_pushed, captured with PDL and replayed twice on new inputs: two ranks' parts
    pushed at site 0 and taken by a SiLU GEMV, pushed at site 1 and summed for the final norm; each equals the
    plain fused GEMVs on the parts summed as an all-reduce sums them, and every site ends marked empty once the
    next site is taken. take_wait "slots": the takes wait for their slots only, not for the kernel ahead; take_x
    "l1": their K loops read the parts through L1 (the second replay takes the same sites with new values)."""
    from parallel.kernels.gemv import TAKE_WAIT_ENV, TAKE_X_ENV, gemv, sum_pushed
    from parallel.p2p_allreduce import EMPTY_BITS

    monkeypatch.setenv(TAKE_WAIT_ENV, take_wait)
    monkeypatch.setenv(TAKE_X_ENV, take_x)

    torch.manual_seed(0)
    k, kh, n = 4096, 7168, 7168
    bf = torch.bfloat16
    x = [torch.randn(1, kh, device=DEV, dtype=bf) for _ in range(2)]
    w = [torch.randn(k, kh, device=DEV, dtype=bf) / kh**0.5 for _ in range(2)]
    wg = [torch.randn(2 * n, k, device=DEV, dtype=bf) / k**0.5 for _ in range(2)]
    wd = [torch.randn(k, n, device=DEV, dtype=bf) / n**0.5 for _ in range(2)]
    resid, nw = torch.randn(1, k, device=DEV, dtype=bf), torch.rand(k, device=DEV, dtype=bf) + 0.5
    slots, make_site = _two_rank_slots(k, 2)
    sites = {(r, s): make_site(r, s) for r in range(2) for s in range(2)}  # the pointer tensors, before the capture
    site = lambda r, s: sites[r, s]  # noqa: E731
    h = [torch.empty(1, k, device=DEV, dtype=bf) for _ in range(2)]
    final = [torch.empty(1, k, device=DEV, dtype=bf) for _ in range(2)]

    def step():
        acts = []
        for r in range(2):
            gemv(x[r], w[r], None, residual=resid if r == 0 else None, push=site(r, 0))
        for r in range(2):
            acts.append(gemv(h[r], wg[r], None, norm_weight=nw, eps=1e-5, silu=True, take=site(r, 0)))
        for r in range(2):
            gemv(acts[r], wd[r], None, residual=h[r] if r == 0 else None, push=site(r, 1))
        for r in range(2):
            sum_pushed(site(r, 1), final[r])
        return acts

    step()  # compiles the kernels outside the capture
    for t in slots:
        t.view(torch.int16).fill_(EMPTY_BITS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        acts = step()
    for _ in range(2):
        for r in range(2):
            x[r].copy_(torch.randn_like(x[r]))
        graph.replay()
        torch.cuda.synchronize()
        h_ref = (gemv(x[0], w[0], None, residual=resid).float() + gemv(x[1], w[1]).float()).to(bf)
        act_ref = [gemv(h_ref, wg[r], None, norm_weight=nw, eps=1e-5, silu=True) for r in range(2)]
        final_ref = (gemv(act_ref[0], wd[0], None, residual=h_ref).float() + gemv(act_ref[1], wd[1]).float()).to(bf)
        for r in range(2):
            assert torch.equal(h[r], h_ref) and torch.equal(acts[r], act_ref[r]) and torch.equal(final[r], final_ref)
            assert bool((slots[r][0].view(torch.int16) == EMPTY_BITS).all())  # emptied by the site-1 sum


def test_a_take_waits_for_the_peer_push():
    """A taking GEMV launched before its peer has pushed keeps running (reading the empty marks) until the push
    lands from another stream, then gives the summed values."""
    import time

    from parallel.kernels.gemv import gemv

    torch.manual_seed(1)
    k, kh, n = 4096, 2048, 1024
    bf = torch.bfloat16
    x = [torch.randn(1, kh, device=DEV, dtype=bf) for _ in range(2)]
    w = [torch.randn(k, kh, device=DEV, dtype=bf) / kh**0.5 for _ in range(2)]
    wq, nw = torch.randn(n, k, device=DEV, dtype=bf) / k**0.5, torch.rand(k, device=DEV, dtype=bf) + 0.5
    slots, site = _two_rank_slots(k, 2)
    h = torch.empty(1, k, device=DEV, dtype=bf)
    gemv(x[0], w[0], None, push=site(0, 0))
    torch.cuda.synchronize()
    taker, pusher = torch.cuda.Stream(), torch.cuda.Stream()
    done = torch.cuda.Event()
    with torch.cuda.stream(taker):
        y = gemv(h, wq, None, norm_weight=nw, eps=1e-5, take=site(0, 0))
        done.record()
    time.sleep(0.2)
    assert not done.query(), "the take finished before the peer pushed"
    with torch.cuda.stream(pusher):
        gemv(x[1], w[1], None, push=site(1, 0))
    deadline = time.monotonic() + 20
    while not done.query():
        assert time.monotonic() < deadline, "the take did not see the push (the GPU is left spinning)"
        time.sleep(0.01)
    h_ref = (gemv(x[0], w[0]).float() + gemv(x[1], w[1]).float()).to(bf)
    assert torch.equal(h, h_ref) and torch.equal(y, gemv(h_ref, wq, None, norm_weight=nw, eps=1e-5))
