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


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
def test_prefill_gpu0_to_decode_gpu1_matches_single_gpu(pieces: bool):
    """pieces: the prefill engine takes 32 tokens a step, and the decode replica asks for each step's full blocks as
    they are computed (`kv_push_pieces`, issue 24): the long prompt moves in several transfers, on GPUs its pieces'
    gathers ordered after the engine's stream."""
    import ray

    from engine import LLM, LLMEngine, SamplingParams
    from workers.config import EngineConfig
    from engine.disagg import DecodeReplica, PrefillPiece, PrefillReplica

    ray.init(num_gpus=2, num_cpus=8, include_dashboard=False, ignore_reinit_error=True)
    try:
        kwargs = dict(model=MODEL, device="cuda", dtype="bfloat16", block_size=16, num_gpu_blocks_override=256,
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

        decode = DecodeReplica(decode_engine, client, kv_pieces=pieces)
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
    want = LLM(MODEL, device="cuda", dtype="bfloat16", block_size=16, num_gpu_blocks_override=256, show_progress=False,
               **({"max_num_batched_tokens": 32} if pieces else {})).generate(prompts, params)
    assert got == [o.token_ids for o in want]
