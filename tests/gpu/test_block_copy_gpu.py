"""The KV handoff's gather and scatter on a GPU go through the Triton row copy (parallel/kernels/block_copy.py):
bit for bit what PyTorch's index ops give, for bf16 and FP8 caches, a layer slice, blocks out of order, and a head
slice (which keeps the index ops); nothing outside the listed blocks changes."""
from __future__ import annotations

import pytest
import torch

from workers.kv_transfer.blocks import _as_words, _as_wire, gather_blocks, scatter_blocks, wire_dtype

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [slice(None), slice(2, 6)], ids=["all-heads", "head-slice"])
def test_gather_and_scatter_equal_pytorchs_index_ops(dtype, heads):
    torch.manual_seed(0)
    cache = torch.randn(4, 2, 300, 16, 8, 128, device="cuda").to(dtype)
    ids, layers = [211, 3, 97, 150, 0, 299], slice(1, 3)
    index = torch.tensor(ids, device="cuda")
    got = gather_blocks(cache, ids, layers, heads)
    want = _as_wire(cache)[layers].index_select(2, index)[..., heads, :].contiguous()
    assert got.dtype == wire_dtype(dtype) and torch.equal(got, want)

    before = _as_wire(cache).clone()
    new = torch.randint(0, 255, got.shape, dtype=torch.uint8, device="cuda").view(got.dtype) if got.dtype == torch.uint8 \
        else torch.randn(got.shape, device="cuda").to(got.dtype)
    scatter_blocks(cache, ids, layers, heads, new)
    expect = before.clone()
    for i, b in enumerate(ids):
        expect[layers][:, :, b, :, heads, :] = new[:, :, i]
    assert torch.equal(_as_wire(cache), expect)


def test_the_row_copy_takes_whole_head_transfers():
    from workers.kv_transfer.blocks import _by_rows

    words = _as_words(torch.zeros(2, 2, 4, 16, 8, 128, dtype=torch.bfloat16, device="cuda"))
    assert _by_rows(words, slice(None)) and not _by_rows(words, slice(0, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_launches_through_the_handle_equal_the_jit_path(dtype, monkeypatch):
    """After a row copy's first launch, the same specialisation launches through the compiled kernel's handle
    (block_copy._HANDLES): bit for bit what the JIT path gives, for every layer and a layer slice, the full grid and
    the capped one, both directions, repeated with other block lists and counts (the key holds, the arguments do
    not), through `CacheBlocks` (what the agent calls) and `gather_blocks` / `scatter_blocks`."""
    from parallel.kernels import block_copy
    from workers.kv_transfer.blocks import CacheBlocks

    torch.manual_seed(0)
    base = torch.randn(6, 2, 300, 16, 8, 128, device="cuda").to(dtype)
    results = {}
    for direct in (False, True):
        monkeypatch.setattr(block_copy, "DIRECT", direct)
        block_copy._HANDLES.clear()
        torch.manual_seed(1)  # the same new values in both runs
        cache = base.clone()
        blocks, got = CacheBlocks(cache), []
        for rep, (ids, layers, programs) in enumerate([([211, 3, 97, 150, 0, 299], slice(None), 0),
                                                       ([5, 6, 7], slice(1, 4), 0), ([9, 1, 250, 40], slice(None), 7),
                                                       ([211, 3, 97, 150, 0, 299], slice(2, 6), 5),
                                                       (list(range(100, 164)), slice(None), 0)]):
            index = torch.tensor(ids, device="cuda")
            buf = blocks.gather(ids, layers, slice(None), index, programs)
            assert torch.equal(buf, gather_blocks(cache, ids, layers, slice(None), index, programs)), (direct, rep)
            got.append(buf.clone())
            new = torch.randint(0, 255, buf.shape, dtype=torch.uint8, device="cuda").view(buf.dtype) \
                if buf.dtype == torch.uint8 else torch.randn(buf.shape, device="cuda").to(buf.dtype)
            back = [(i + 7) % 300 for i in ids]  # other blocks, still distinct
            blocks.scatter(back, layers, slice(None), new, torch.tensor(back, device="cuda"), programs)
            got.append(_as_wire(cache).clone())
        torch.cuda.synchronize()
        assert (len(block_copy._HANDLES) > 0) == direct  # the handle path ran where it is on
        results[direct] = got
    assert all(torch.equal(a, b) for a, b in zip(results[False], results[True]))
