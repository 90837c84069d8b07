"""Disaggregated prefill -> decode on two GPUs: the KV moves over an NCCL pair group between Ray rank
actors on different devices, and the tokens equal the single-GPU engine's. Skipped without 2 GPUs."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs")

MODEL = str(Path(__file__).resolve().parents[2] / "models" / "tandem-tiny")


# (pieces, transfers in flight per pair (the decode replica's kv_transfers_in_flight; None: its default), dtype)
CASES = {"whole": (False, None, "bfloat16"), "pieces": (True, None, "bfloat16"), "in-flight-4-fp32": (False, 4, "float32")}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_gpu0_to_decode_gpu1_matches_single_gpu(case: str):
    """pieces: the prefill engine takes 32 tokens a step, and the decode replica asks for each step's full blocks as
    they are computed (`kv_push_pieces`, issue 24): the long prompt moves in several transfers, on GPUs its pieces'
    gathers ordered after the engine's stream.
    in-flight-4-fp32: the four prompts' transfers up to 4 at once on the pair (issue 24, item 2), in float32. The tokens
    must equal the reference's, which decodes the four together; in bf16 a request decoded in another batch (alone: the
    fused batch-1 GEMVs; or padded to a graph's size) rounds differently and may flip a near-tie (on CPU in bf16 the
    same scenario departed at a 0.03-nat tie with 1 and with 4 in flight alike, scripts/diagnose_pd_in_flight.py), so
    bf16 tests the handoff only as far as the batches happen to match: a request may part from the reference only at
    a near-tie (`_same_but_for_a_near_tie`); float32 moves the same blocks with no near-ties beyond TF32's."""
    import ray

    from engine import LLM, LLMEngine, SamplingParams
    from workers.config import EngineConfig
    from engine.disagg import DecodeReplica, PrefillPiece, PrefillReplica

    pieces, in_flight, dtype = CASES[case]
    ray.init(num_gpus=2, num_cpus=8, include_dashboard=False, ignore_reinit_error=True)
    try:
        kwargs = dict(model=MODEL, device="cuda", dtype=dtype, block_size=16, num_gpu_blocks_override=256,
                      distributed_executor_backend="ray")
        chunk = dict(max_num_batched_tokens=32) if pieces else {}
        prefill = PrefillReplica(LLMEngine(EngineConfig.from_kwargs(**kwargs, **chunk), show_progress=False))
        decode_engine = LLMEngine(EngineConfig.from_kwargs(**kwargs), show_progress=False)
        told = []

        async def client(rid, prompt, params, priority, reservation):
            async for ready in prefill.prefill(rid, prompt, params, priority, reservation):
                if isinstance(ready, PrefillPiece):
                    told.append((rid, len(ready.block_ids)))
                yield ready

        decode = DecodeReplica(decode_engine, client, kv_pieces=pieces,
                               **({} if in_flight is None else {"kv_transfers_in_flight": in_flight}))
        tok = decode_engine.tokenizer
        prompts = [tok.encode(p) for p in ("def fibonacci(n):", "import os\nimport sys\n", "class Tree:\n    def __init__(self, root):\n" * 4,
                                           "def walk(tree):\n    for node in tree:\n        yield node\n" * 12)]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

        async def run_all():
            async def one(i, p):
                return [t async for out in decode.generate(f"g{i}", p, params) for t in out.new_token_ids]
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        got = asyncio.run(run_all())
        ranks = {ray.get(w.kv.remote("get_shard")).rank: None for w in prefill.executor.workers}
        assert ranks  # the prefill ranks answered over Ray
        assert len(decode.transfers) == len(prompts) and all(s.bytes > 0 for s in decode.transfers)
        assert bool(told) == pieces and len({rid for rid, _ in told}) <= len(prompts)
        assert decode.llm_engine.block_manager.num_used_blocks == 0
        assert prefill.llm_engine.block_manager.num_used_blocks == 0
        for executor in (prefill.executor, decode.executor):
            executor.shutdown()
    finally:
        ray.shutdown()
    # The reference prefills in the same chunks: chunked attention may round differently in bf16.
    # With each position's two best log-probs: where a request parts from it, that must be a near-tie.
    want = LLM(MODEL, device="cuda", dtype=dtype, block_size=16, num_gpu_blocks_override=256, show_progress=False,
               **({"max_num_batched_tokens": 32} if pieces else {})).generate(
                   prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2))
    for tokens, ref in zip(got, want):
        _same_but_for_a_near_tie(tokens, ref, NEAR_TIE[dtype])


# The widest gap (nats) between the reference's two best tokens at which a handed-off request may part from it. bf16:
# the decode batch differs from the reference's (requests join one by one; batch 1 runs the fused GEMVs), and a
# different batch rounds differently, as in tests/gpu/test_hf_greedy.py. float32: the kernels' TF32 dots.
NEAR_TIE = {"bfloat16": 0.1, "float32": 1e-3}


def _same_but_for_a_near_tie(got: list[int], want, tie: float) -> None:
    """Token-identical, or parted where the reference's two best tokens were within `tie` nats, and at that position
    the request took one of those two (a wrong KV block parts at a wide gap, or picks a token far down the list)."""
    i = next((j for j, (a, b) in enumerate(zip(got, want.token_ids)) if a != b), None)
    if i is None:
        assert len(got) == len(want.token_ids)
        return
    top = sorted(want.logprobs[i].items(), key=lambda kv: kv[1], reverse=True)
    gap = top[0][1] - top[1][1]
    assert got[i] in (top[0][0], top[1][0]) and gap < tie, \
        f"parted at token {i}: got {got[i]}, reference {want.token_ids[i]}, its best two {top[:2]} ({gap:.4f} nats apart)"
