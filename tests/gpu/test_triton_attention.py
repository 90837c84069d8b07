"""Triton paged attention vs the torch reference backend: ragged lengths, block-table holes,
prefix-cached context, GQA ratios 1/4/8, head dims 64/128, padded (graph) rows."""
from __future__ import annotations

import pytest
import torch

from workers.attention.backend import AttentionMetadata
from workers.attention.torch_backend import TorchAttention

DEV = "cuda"


def make_batch(q_lens, ctx_lens, hq, hkv, d, page, dtype, seed=0, holes=True):
    """Random q/k/v and a random cache; block tables drawn from a shuffled pool with every other
    block skipped first (holes), so tables are neither contiguous nor ordered."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    need = sum(-(-s // page) for s in seq_lens)
    num_blocks = 2 * need + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    if holes:
        perm = perm[::2] + perm[1::2]
    tables, i = [], 0
    for s in seq_lens:
        nb = -(-s // page)
        tables.append(perm[i:i + nb])
        i += nb
    width = max(len(t) for t in tables) + 2  # padded rows, like the runner's
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = []
    for t, c, q in zip(tables, ctx_lens, q_lens):
        slots += [t[p // page] * page + p % page for p in range(c, c + q)]
    n = sum(q_lens)
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    k = torch.randn(n, hkv, d, generator=g).to(dtype)
    v = torch.randn(n, hkv, d, generator=g).to(dtype)
    cache = torch.randn(2, num_blocks, page, hkv, d, generator=g).to(dtype)
    qsl = [0]
    for x in q_lens:
        qsl.append(qsl[-1] + x)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_tables=bt.to(DEV), query_lens_cpu=list(q_lens), seq_lens_cpu=seq_lens,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return q.to(DEV), k.to(DEV), v.to(DEV), cache.to(DEV), meta


def reference(q, k, v, cache, meta, scale):
    """The torch backend on float32 copies (the reference in higher precision)."""
    c = cache.float().clone()
    out = TorchAttention().forward(q.float(), k.float(), v.float(), c, meta, scale)
    return out, c


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


GQA_DIMS = [(8, 8, 64), (8, 2, 128), (32, 8, 128), (16, 2, 64), (32, 4, 128)]  # (Hq, Hkv, D): ratios 1, 4, 4, 8, 8


@pytest.mark.parametrize("hq,hkv,d", GQA_DIMS)
@pytest.mark.parametrize("page", [16, 32])
def test_decode_matches_torch(hq, hkv, d, page):
    from workers.attention.triton_backend import TritonAttention

    ctx = [0, 1, 15, 16, 17, 100, 1000, 3000]
    q, k, v, cache, meta = make_batch([1] * len(ctx), ctx, hq, hkv, d, page, torch.bfloat16, seed=hq + d + page)
    ref, ref_cache = reference(q, k, v, cache, meta, d ** -0.5)
    c = cache.clone()
    out = TritonAttention().forward(q, k, v, c, meta, d ** -0.5)
    assert torch.equal(c.float(), ref_cache), "K/V written to the wrong slots"
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("splits", [1, 2, 8, 64])
def test_decode_split_counts_agree(splits):
    """Any split count (short sequences leave splits empty, which write nothing and which the merge does not read:
    stale partials there must not leak in)."""
    from parallel.kernels.paged_attention import decode_attention, write_kv

    q, k, v, cache, meta = make_batch([1] * 4, [5, 64, 700, 2049], 32, 8, 128, 16, torch.bfloat16, seed=7)
    ref, _ = reference(q, k, v, cache, meta, 128 ** -0.5)
    write_kv(cache, k, v, meta.slot_mapping)
    for _ in range(2):  # the second call's empty splits hold the first call's partials
        out = decode_attention(q, cache, meta.block_tables, meta.seq_lens, 128 ** -0.5, meta.max_seq_len,
                               num_splits=splits)
        assert rel_err(out, ref) < 1e-2


def test_decode_padding_rows_are_inert():
    """CUDA-graph padding: slot -1 writes nothing, seq_len 0 attends to nothing and gives no NaN."""
    from parallel.kernels.paged_attention import decode_attention, write_kv

    q, k, v, cache, meta = make_batch([1, 1], [30, 200], 8, 2, 64, 16, torch.bfloat16, seed=3)
    ref, ref_cache = reference(q, k, v, cache, meta, 0.125)
    pad = lambda t, val: torch.cat([t, torch.full((2,) + t.shape[1:], val, dtype=t.dtype, device=DEV)])  # noqa: E731
    c = cache.clone()
    write_kv(c, pad(k, 1.0), pad(v, 1.0), pad(meta.slot_mapping, -1))
    assert torch.equal(c.float(), ref_cache)
    bt = torch.cat([meta.block_tables, meta.block_tables])
    out = decode_attention(pad(q, 1.0), c, bt, pad(meta.seq_lens, 0), 0.125, 4096)
    assert rel_err(out[:2], ref) < 1e-2
    assert not out.isnan().any() and out[2:].abs().max().item() == 0
    # the same with the K/V write fused into the decode kernel (the CUDA-graph path)
    c = cache.clone()
    out = decode_attention(pad(q, 1.0), c, bt, pad(meta.seq_lens, 0), 0.125, 4096, k_new=pad(k, 1.0), v_new=pad(v, 1.0),
                           slot_mapping=pad(meta.slot_mapping, -1))
    assert torch.equal(c.float(), ref_cache)
    assert rel_err(out[:2], ref) < 1e-2
    assert not out.isnan().any() and out[2:].abs().max().item() == 0


@pytest.mark.parametrize("hq,hkv,d", GQA_DIMS)
def test_prefill_matches_torch(hq, hkv, d):
    """Ragged chunks with prefix-cached context (ctx > 0) and without, plus decode rows in the same step."""
    from workers.attention.triton_backend import TritonAttention

    q_lens = [1, 7, 64, 129, 300, 1, 16]
    ctx = [40, 0, 16, 33, 0, 511, 1000]
    q, k, v, cache, meta = make_batch(q_lens, ctx, hq, hkv, d, 16, torch.bfloat16, seed=hq * d)
    ref, ref_cache = reference(q, k, v, cache, meta, d ** -0.5)
    c = cache.clone()
    out = TritonAttention().forward(q, k, v, c, meta, d ** -0.5)
    assert torch.equal(c.float(), ref_cache)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2
    # per sequence too: a wrong sequence boundary would hide in the global norm
    for i in range(len(q_lens)):
        a, b = meta.query_start_loc[i].item(), meta.query_start_loc[i + 1].item()
        assert rel_err(out[a:b], ref[a:b]) < 2e-2, f"sequence {i}"


@pytest.mark.parametrize("hq,hkv,d", GQA_DIMS)
def test_mixed_step_with_decodes_first(hq, hkv, d):
    """The runner's mixed-step layout: decode rows first (`num_decodes`) run through the decode kernel,
    the prefill chunks after them through the prefill kernel; cache and output equal the reference."""
    from dataclasses import replace

    from workers.attention.triton_backend import TritonAttention

    q_lens = [1, 1, 1, 7, 64, 300, 16]
    ctx = [40, 511, 1000, 0, 16, 0, 33]
    q, k, v, cache, meta = make_batch(q_lens, ctx, hq, hkv, d, 16, torch.bfloat16, seed=hq + d)
    meta = replace(meta, num_decodes=3)
    ref, ref_cache = reference(q, k, v, cache, meta, d ** -0.5)
    c = cache.clone()
    out = TritonAttention().forward(q, k, v, c, meta, d ** -0.5)
    assert torch.equal(c.float(), ref_cache)
    assert not out.isnan().any()
    for i in range(len(q_lens)):
        a, b = meta.query_start_loc[i].item(), meta.query_start_loc[i + 1].item()
        assert rel_err(out[a:b], ref[a:b]) < 2e-2, f"sequence {i}"


@pytest.mark.parametrize("q_len", [1, 2048])
def test_prefill_long_single_sequence(q_len):
    from workers.attention.triton_backend import TritonAttention

    q, k, v, cache, meta = make_batch([q_len], [4096 - q_len], 32, 8, 128, 16, torch.bfloat16, seed=q_len)
    meta.max_query_len = q_len if q_len > 1 else 2  # force the prefill kernel for the single token too
    ref, _ = reference(q, k, v, cache, meta, 128 ** -0.5)
    out = TritonAttention().forward(q, k, v, cache.clone(), meta, 128 ** -0.5)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("tma", [False, True])
def test_prefill_new_keys_plain_and_tma_loads(tma):
    """The step's own keys come from k/v (here v is a strided view of a fused qkv buffer, as in the
    model), not from the cache: with plain loads and with TMA loads. A diagonal tile of one sequence
    over-reads the next sequence's rows (TMA) or past the end of the step: the mask must hide both."""
    from parallel.kernels.paged_attention import _tma_supported, prefill_attention, write_kv

    hq, hkv, d = 32, 8, 128
    q_lens, ctx = [130, 257, 1, 70], [0, 48, 1000, 0]
    q, k, v, cache, meta = make_batch(q_lens, ctx, hq, hkv, d, 16, torch.bfloat16, seed=7)
    if tma and not _tma_supported(k, v):
        pytest.skip("TMA needs Hopper or newer")
    ref, _ = reference(q, k, v, cache, meta, d ** -0.5)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    v_view = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
    c = cache.clone()
    write_kv(c, k, v, meta.slot_mapping)
    out = prefill_attention(q, k, v_view, c, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                            meta.max_query_len, d ** -0.5, tma=tma)
    assert not out.isnan().any()
    for i in range(len(q_lens)):
        a, b = meta.query_start_loc[i].item(), meta.query_start_loc[i + 1].item()
        assert rel_err(out[a:b], ref[a:b]) < 2e-2, f"sequence {i}"


def test_serving_compiles_no_attention_kernel():
    """The engine compiles every attention-kernel variant it will need at start-up (ModelRunner's
    warm-up), and no kernel specialises on per-step values (block-table width, slice alignment, split
    count): staggered prompts that chunk and mix with decodes add no compiled variant."""
    from tests.models import prompts_of_lengths, tiny_model
    from tandem import LLM, SamplingParams
    from parallel.kernels import paged_attention as pa
    from parallel.kernels import verify_attention as va

    def variants() -> dict[str, int]:
        kernels = {"prefill": pa._prefill_kernel, "decode": pa._decode_split_kernel, "write_kv": pa._write_kv_kernel,
                   "short queries": va._verify_split_kernel}  # the 5- and 17-token prompts' chunks, short tails
        return {name: sum(len(c[0]) for c in fn.device_caches.values()) for name, fn in kernels.items()}

    llm = LLM(tiny_model("llama"), device="cuda", dtype="bfloat16", attention_backend="triton", max_model_len=256,
              max_num_batched_tokens=64, max_num_seqs=8, show_progress=False)
    try:
        before = variants()
        prompts = prompts_of_lengths([5, 40, 17, 130, 200, 77, 1, 64], 200, seed=11)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        assert all(len(o.token_ids) == 12 for o in outs)
        assert variants() == before
    finally:
        llm.llm_engine.shutdown()
