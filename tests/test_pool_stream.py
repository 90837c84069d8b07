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


def test_a_one_rank_decode_replica_takes_its_rank_resources_itself():
    from router.colocated import in_process_rank_options
    from router.config import AppConfig

    def options(**decode):
        config = AppConfig(model="models/tandem-tiny", device="cpu", decode={"num_replicas": 1, **decode})
        return in_process_rank_options(config, "decode")

    assert options(rank_resources={"tandem_decode": 1}) == {"num_gpus": 0, "resources": {"tandem_decode": 1}}
    assert options(tensor_parallel_size=2) is None  # its ranks are Ray actors that take them
    assert options(distributed_executor_backend="ray") is None


def test_pd_vs_colocated_script_reads_deployments_and_ratios():
    import sys
    from pathlib import Path

    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from bench_pd_vs_colocated import DEFAULT_DEPLOYMENTS, parse_deployments, ratios

    assert [name for name, _ in parse_deployments(DEFAULT_DEPLOYMENTS)] == ["colocated", "pd", "pd-handoff"]
    assert parse_deployments("a=--x 1;b=")[0] == ("a", ["--x", "1"])
    for bad in ("nameless", "a=;a="):
        with pytest.raises(SystemExit):
            parse_deployments(bad)
    point = lambda rps, ttft, tpot: {"label": "c1", "summary": {"request_throughput": rps, "ttft_s": {"p50": ttft},  # noqa: E731
                                                                  "tpot_s": {"p50": tpot}}}
    assert ratios([point(5.0, 0.2, None)], [point(10.0, 0.1, 0.01)]) == [
        {"label": "c1", "request_throughput": 0.5, "ttft_p50": 2.0, "tpot_p50": None}]
