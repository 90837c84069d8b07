"""The KV handoff's Triton row copy (parallel/kernels/block_copy.py) on CPU, through Triton's interpreter, against
PyTorch's index_select / index_copy_: gather and scatter, a layer slice of the cache (strided outer dims), rows
shorter and longer than a program's BLOCK, 8-byte words and bf16 elements, blocks listed out of order; nothing
outside the listed blocks changes; and `copy_blocks`, block to block between two caches. tests/gpu/test_block_copy_gpu.py runs the same on a GPU through
`gather_blocks` / `scatter_blocks`."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
from parallel.kernels.block_copy import BLOCK, copy_rows

torch.manual_seed(0)
checks = 0
for dtype, row in ((torch.int64, (4, 2, 2)), (torch.int64, (2, 3, BLOCK + 300)), (torch.bfloat16, (4, 2, 8))):
    layers, blocks = 3, 9
    cache = (torch.randint(-2**40, 2**40, (layers, 2, blocks) + row) if dtype == torch.int64
             else torch.randn((layers, 2, blocks) + row).to(dtype))
    view = cache[1:3]  # a layer slice: the cache's own strides
    ids = torch.tensor([7, 2, 5, 0], dtype=torch.long)
    for programs in (0, 3):  # the full grid; a capped grid, each program looping over several row slices
        out = torch.empty((2, 2, len(ids)) + row, dtype=dtype)
        copy_rows(view, out, ids, gather=True, programs=programs)
        assert torch.equal(out, view.index_select(2, ids)), (dtype, programs)
        before = cache.clone()
        new = (torch.randint(-2**40, 2**40, out.shape) if dtype == torch.int64 else torch.randn(out.shape).to(dtype))
        copy_rows(new, view, ids, gather=False, programs=programs)
        want = before.clone()
        want[1:3].index_copy_(2, ids, new)
        assert torch.equal(cache, want), (dtype, programs)  # the listed blocks of layers 1-2 only
    checks += 1
try:
    copy_rows(cache[:, :, :2], torch.empty((3, 2, 2, 4, 2, 8), dtype=torch.float32), ids[:2], gather=True)
except ValueError as e:
    assert "do not match" in str(e)
    checks += 1
from parallel.kernels.block_copy import copy_blocks
for row in ((4, 2, 2), (2, 3, BLOCK + 300)):  # block to block between two caches (the same-node handoff's copy)
    src = torch.randint(-2**40, 2**40, (4, 2, 9) + row)
    dst = torch.randint(-2**40, 2**40, (3, 2, 6) + row)
    src_ids, dst_ids = torch.tensor([7, 2, 5, 0]), torch.tensor([1, 4, 0, 3])
    want = dst.clone()
    want[1:3].index_copy_(2, dst_ids, src[2:4].index_select(2, src_ids))
    copy_blocks(src[2:4], dst[1:3], src_ids, dst_ids)  # layer slices on both sides, different block counts
    assert torch.equal(dst, want), row
    checks += 1
for bad in ((src, dst[:, :1], src_ids, dst_ids), (src[:3], dst, src_ids, dst_ids[:2])):
    try:
        copy_blocks(*bad)
        raise AssertionError("accepted")
    except ValueError:
        checks += 1
from parallel.kernels.block_copy import warm_up
warm_up(torch.device("cpu"))  # both directions on scratch tensors
checks += 1
print("ok", checks)
'''


@pytest.mark.interpreted(SCRIPT, timeout=600)
def test_row_copy_gathers_and_scatters_whole_blocks_like_pytorchs_index_ops():
    assert run_interpreted(SCRIPT).strip().endswith("ok 9")


def test_the_handoff_uses_pytorchs_index_ops_off_the_gpu():
    """On CPU (and for a head slice) `gather_blocks` / `scatter_blocks` keep PyTorch's index ops: no Triton."""
    torch = pytest.importorskip("torch")
    from workers.kv_transfer.blocks import _by_rows

    words = torch.zeros(2, 2, 4, 4, 2, 8, dtype=torch.int64)
    assert not _by_rows(words, slice(None))


def test_rows_contiguous_from_strides_matches_asking_a_row():
    """rows_contiguous reads shapes and strides only; it must say what indexing a row out and asking would."""
    import torch

    from parallel.kernels.block_copy import rows_contiguous

    def asked(t: torch.Tensor) -> bool:
        return t[0, 0, 0].is_contiguous() if t.shape[0] and t.shape[2] else True

    c = torch.zeros(4, 2, 8, 16, 8, 128)
    views = [c, c[1:3], c[:, :, 2:5], c[..., 2:4, :], c[..., :64], c.transpose(3, 4), c[:, :, :, :1],
             c[:, :, :, :, :1], torch.zeros(2, 2, 3, 1, 1, 5)[..., ::2], torch.zeros(2, 2, 3, 4).transpose(2, 3)[:, :, :1],
             c[:0], c[:, :, :0], c.view(torch.int64), c.permute(1, 0, 2, 3, 4, 5)]
    assert [rows_contiguous(v) for v in views] == [asked(v) for v in views]
    assert not all(rows_contiguous(v) for v in views) and any(rows_contiguous(v) for v in views)
