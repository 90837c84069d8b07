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


def test_prefill_gpu0_to_decode_gpu1_matches_single_gpu():
    import ray

    from engine import LLM, LLMEngine, SamplingParams
    from workers.config import EngineConfig
    from engine.disagg import DecodeReplica, PrefillReplica

    ray.init(num_gpus=2, num_cpus=8, include_dashboard=False, ignore_reinit_error=True)
    try:
        kwargs = dict(model=MODEL, device="cuda", dtype="bfloat16", block_size=16, num_gpu_blocks_override=256,
                      distributed_executor_backend="ray")
        prefill = PrefillReplica(LLMEngine(EngineConfig.from_kwargs(**kwargs), show_progress=False))
        decode_engine = LLMEngine(EngineConfig.from_kwargs(**kwargs), show_progress=False)

        async def client(rid, prompt, params, priority, reservation):
            async for ready in prefill.prefill(rid, prompt, params, priority, reservation):
                yield ready

        decode = DecodeReplica(decode_engine, client)
        tok = decode_engine.tokenizer
        prompts = [tok.encode(p) for p in ("def fibonacci(n):", "import os\nimport sys\n", "class Tree:\n    def __init__(self, root):\n" * 4)]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

        async def run_all():
            async def one(i, p):
                return [t async for out in decode.generate(f"g{i}", p, params) for t in out.new_token_ids]
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        got = asyncio.run(run_all())
        ranks = {ray.get(w.kv.remote("get_shard")).rank: None for w in prefill.executor.workers}
        assert ranks  # the prefill ranks answered over Ray
        assert len(decode.transfers) == len(prompts) and all(s.bytes > 0 for s in decode.transfers)
        assert decode.llm_engine.block_manager.num_used_blocks == 0
        assert prefill.llm_engine.block_manager.num_used_blocks == 0
        for executor in (prefill.executor, decode.executor):
            executor.shutdown()
    finally:
        ray.shutdown()
    want = LLM(MODEL, device="cuda", dtype="bfloat16", block_size=16, num_gpu_blocks_override=256, show_progress=False).generate(prompts, params)
    assert got == [o.token_ids for o in want]
