"""What a decode pool replica streams to the router across the Serve hop."""
from __future__ import annotations

import asyncio

from engine.llm_engine import RequestOutput
from router.pools import DecodePool
from router.protocol import GenerateRequest
from workers.sampling_params import SamplingParams


class _Replica:
    def __init__(self, outputs: list[RequestOutput]):
        self.outputs = outputs

    async def generate(self, request_id, prompt_token_ids, params, priority):
        for out in self.outputs:
            yield out


def test_streamed_items_leave_the_prompt_behind():
    prompt = list(range(2048))
    engine_side = [RequestOutput("r", prompt, token_ids=[7], new_token_ids=[7]),
                   RequestOutput("r", prompt, token_ids=[7, 8], new_token_ids=[8], finish_reason="length")]
    pool = DecodePool.__new__(DecodePool)  # no engine: only the streaming wrapper is under test
    pool.replica = _Replica(engine_side)
    req = GenerateRequest(request_id="r", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=2))

    async def collect() -> list[RequestOutput]:
        return [out async for out in pool.generate(req)]

    got = asyncio.run(collect())
    assert [o.prompt_token_ids for o in got] == [[], []]
    assert [o.new_token_ids for o in got] == [[7], [8]] and got[-1].finish_reason == "length"
