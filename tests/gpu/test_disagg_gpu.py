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
    bf16 tests the handoff only as far as the batches happen to match; float32 moves the same blocks with no near-ties."""
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
    want = LLM(MODEL, device="cuda", dtype=dtype, block_size=16, num_gpu_blocks_override=256, show_progress=False,
               **({"max_num_batched_tokens": 32} if pieces else {})).generate(prompts, params)
    assert got == [o.token_ids for o in want]
