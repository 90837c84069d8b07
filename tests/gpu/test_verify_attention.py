"""The split-context attention for a few query tokens per sequence (parallel/kernels/verify_attention.py) on
a GPU: bf16 against the torch reference in fp32 (Llama-3.1-8B heads: 32 query, 8 KV, D = 128), the FP8 cache
through the Triton backend against the torch backend's FP8 path, replay inside a CUDA graph with new
lengths, and its time against the prefill kernel it replaces for these steps (printed; it must be faster at
a 2,048-token context, where the prefill kernel runs 32 programs)."""
from __future__ import annotations

import pytest
import torch

from parallel.kernels import verify_attention as va
from parallel.kernels.paged_attention import decode_attention, prefill_attention, write_kv
from tests.gpu.test_triton_attention import make_batch, reference, rel_err
from workers.attention.torch_backend import TorchAttention
from workers.attention.triton_backend import TritonAttention

HQ, HKV, D, PAGE = 32, 8, 128, 16
SCALE = D ** -0.5


def run_kernel(q, k, v, cache, meta, fuse):
    """fuse: the kernel writes the step's k/v (the backend's call); else write_kv first."""
    c = cache.clone()
    args = (q, c, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, meta.max_seq_len, SCALE)
    if fuse:
        return va.verify_attention(*args, k_new=k, v_new=v, slot_mapping=meta.slot_mapping), c
    write_kv(c, k, v, meta.slot_mapping)
    return va.verify_attention(*args), c


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("q_lens,ctx_lens", [([5], [1024]), ([9, 2, 6], [2000, 3, 700]), ([16, 4], [64, 4000]),
                                             ([6] * 32, [1024] * 32)])
def test_bf16_matches_the_reference(q_lens, ctx_lens, fuse):
    q, k, v, cache, meta = make_batch(q_lens, ctx_lens, HQ, HKV, D, PAGE, torch.bfloat16)
    ref, ref_cache = reference(q, k, v, cache, meta, SCALE)
    out, c = run_kernel(q, k, v, cache, meta, fuse)
    assert rel_err(out, ref) < 1e-2
    assert torch.equal(c.float(), ref_cache), "K/V written to the wrong slots"


def test_fp8_cache_through_the_backend_matches_the_torch_backend():
    q, k, v, cache, meta = make_batch([6, 3], [900, 130], HQ, HKV, D, PAGE, torch.bfloat16)
    assert va.applies(meta.max_query_len, HQ, HKV)
    c8 = (cache.float() / 8).clamp(-448, 448).to(torch.float8_e4m3fn)  # any e4m3 content
    ref = TorchAttention().forward(q, k, v, c8.clone(), meta, SCALE)
    out = TritonAttention().forward(q, k, v, c8.clone(), meta, SCALE)
    assert rel_err(out, ref) < 3e-2


def test_replays_in_a_cuda_graph_with_new_lengths():
    q, k, v, cache, meta = make_batch([6, 6], [500, 1500], HQ, HKV, D, PAGE, torch.bfloat16)
    meta.max_seq_len = 4096  # as the graphs pass max_model_len: the split count is fixed by it
    c = cache.clone()
    out = torch.empty_like(q)
    backend = TritonAttention()
    backend.forward(q, k, v, c, meta, SCALE, out=out)  # compiles
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        backend.forward(q, k, v, c, meta, SCALE, out=out)
    meta.seq_lens.copy_(torch.tensor([300, 1200], dtype=torch.int32))  # shorter contexts, same tables
    g.replay()
    meta.seq_lens_cpu = [300, 1200]
    meta.max_seq_len = 1200
    want = TritonAttention().forward(q, k, v, cache.clone(), meta, SCALE)
    assert rel_err(out, want) < 1e-2  # other split counts (max_seq_len): bf16 rounding apart


def _ms(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@pytest.mark.parametrize("ctx", [1024, 2048])
def test_faster_than_the_prefill_kernel_at_batch_1(ctx):
    q, k, v, cache, meta = make_batch([6], [ctx], HQ, HKV, D, PAGE, torch.bfloat16, holes=False)
    write_kv(cache, k, v, meta.slot_mapping)
    args = (meta.block_tables, meta.seq_lens)
    slots = meta.slot_mapping
    # each as the backend runs it: the verify kernel writes the step's k/v itself, the prefill kernel after write_kv
    t_verify = _ms(lambda: va.verify_attention(q, cache, *args, meta.query_start_loc, 6, 4096, SCALE, k_new=k, v_new=v,
                                               slot_mapping=slots))
    t_prefill = _ms(lambda: (write_kv(cache, k, v, slots),
                             prefill_attention(q, k, v, cache, *args, meta.query_start_loc, 6, SCALE)))
    q1 = q[:1]
    t_decode = _ms(lambda: decode_attention(q1, cache, meta.block_tables, meta.seq_lens, SCALE, 4096))
    print(f"\nbatch 1, 6 queries, context {ctx}: verify kernel {1e3 * t_verify:.1f} us, prefill kernel "
          f"{1e3 * t_prefill:.1f} us, decode kernel (1 query) {1e3 * t_decode:.1f} us per layer")
    if ctx >= 2048:
        assert t_verify < t_prefill
