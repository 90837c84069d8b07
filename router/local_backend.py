"""`LocalBackend`: the `Backend` over one in-process engine (colocated prefill and decode, no KV handoff).

All engine driving (the step loop, ordering, aborts on disconnect) is `engine.async_engine.AsyncEngine`;
this adapter maps it onto the front ends' contract (router/protocol.py).
"""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

from router.config import AppConfig
from router.metrics import PoolGauges
from router.protocol import BackendUnavailable, GenerateRequest
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.llm_engine import LLMEngine, RequestOutput


class LocalBackend:
    def __init__(self, engine: LLMEngine, model_name: str):
        self.llm_engine = engine
        self.async_engine = AsyncEngine(engine, on_step=PoolGauges("colocated", model_name))
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.model_name = model_name

    @classmethod
    def from_config(cls, config: AppConfig) -> "LocalBackend":
        """Colocated mode runs one engine per replica with the decode pool's layout."""
        return cls(LLMEngine(config.engine_config("decode"), show_progress=False), config.served_model_name)

    async def ready(self) -> bool:
        return self.async_engine.alive

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        try:
            stream = self.async_engine.generate(req.request_id, req.prompt_token_ids, req.sampling_params, req.priority)
            async for out in stream:
                yield out
        except EngineDeadError as e:
            raise BackendUnavailable(str(e)) from e

    async def generate_batch(self, reqs: list[GenerateRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Several requests (a client's prompts and `n` choices) added to the engine together; outputs as
        (index into `reqs`, output). Choices of one prompt share its KV (AsyncEngine.generate_many)."""
        try:
            items = [(r.request_id, r.prompt_token_ids, r.sampling_params, r.priority) for r in reqs]
            async with contextlib.aclosing(self.async_engine.generate_many(items)) as stream:  # closed: aborts all
                async for i, out in stream:
                    yield i, out
        except EngineDeadError as e:
            raise BackendUnavailable(str(e)) from e

    async def abort(self, request_id: str) -> None:
        await self.async_engine.abort(request_id)

    async def stats(self) -> dict:
        return await self.async_engine.stats()

    async def close(self) -> None:
        await self.async_engine.close()
