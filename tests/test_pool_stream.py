"""What a decode pool replica streams to the router across the Serve hop."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from engine.llm_engine import RequestOutput
from router.pools import DecodePool
from router.protocol import GenerateRequest
from router.stream_wire import StreamDecoder, StreamEncoder
from workers.sampling_params import SamplingParams


class _Replica:
    def __init__(self, outputs: list[RequestOutput]):
        self.outputs = outputs

    async def generate(self, request_id, prompt_token_ids, params, priority):
        for out in self.outputs:
            yield out


def _pool(outputs: list[RequestOutput]) -> DecodePool:
    pool = DecodePool.__new__(DecodePool)  # no engine: only the streaming wrapper is under test
    pool.replica = _Replica(outputs)
    return pool


def _streamed(pool: DecodePool, req: GenerateRequest) -> list[bytes]:
    async def collect() -> list[bytes]:
        return [item async for item in pool.generate(req)]

    return asyncio.run(collect())


def test_streamed_items_leave_the_prompt_behind():
    prompt = list(range(2048))
    engine_side = [RequestOutput("r", prompt, token_ids=[7], new_token_ids=[7]),
                   RequestOutput("r", prompt, token_ids=[7, 8], new_token_ids=[8], finish_reason="length")]
    req = GenerateRequest(request_id="r", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=2))
    items = _streamed(_pool(engine_side), req)
    assert all(isinstance(item, bytes) and len(item) < 200 for item in items)  # no 2K-token prompt in them
    decoder = StreamDecoder()
    got = [decoder.decode(item)[1] for item in items]
    assert [o.prompt_token_ids for o in got] == [[], []]
    assert [o.new_token_ids for o in got] == [[7], [8]] and got[-1].finish_reason == "length"


def _engine_outputs(n: int, prompt_lps: list | None = None) -> list[RequestOutput]:
    """An engine's cumulative outputs of n tokens with logprobs; the last cut a stop string off its text."""
    outs, text = [], ""
    for k in range(1, n + 1):
        text += f" t{k}"
        last = k == n
        outs.append(RequestOutput("r", [1, 2, 3], token_ids=list(range(100, 100 + k)),
                                  text=text[:-8] if last else text, new_token_ids=[99 + k], new_text=f" t{k}",
                                  logprobs=[{100 + i: -0.5 - i, 5: -3.0} for i in range(k)],
                                  finish_reason="stop" if last else None, stop_reason="t" if last else None,
                                  num_cached_tokens=2, prompt_logprobs=prompt_lps,
                                  timeline={"first_token": 1.0} if k in (1, n) else None))
    return outs


def test_items_carry_only_news_and_the_router_rebuilds_the_engines_outputs():
    """Each item is the output's new tail (not every token, logprob and character so far), the prompt's
    logprobs go once, and the router gets back what the engine had, item by item."""
    prompt_lps = [None] + [{i: -1.0, 0: -2.0} for i in range(1, 400)]
    engine_side = _engine_outputs(200, prompt_lps)
    req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=200))
    items = _streamed(_pool(engine_side), req)
    assert max(len(item) for item in items[1:-1]) < 300  # constant, not growing with the output
    assert len(items[0]) > 4000  # the prompt's logprobs, once
    decoder = StreamDecoder()
    got = [decoder.decode(item) for item in items]
    assert [i for i, _ in got] == [0] * 200
    for want, (_, have) in zip(engine_side, got):
        assert have == RequestOutput(want.request_id, [], want.token_ids, want.text, want.logprobs, want.finish_reason,
                                     want.stop_reason, want.new_token_ids, want.new_text, want.num_cached_tokens,
                                     want.prompt_logprobs, want.timeline)
    assert len(got[-1][1].text) < len(got[-2][1].text)  # the stop string cut off the end: the text came whole
    assert got[0][1].token_ids is not got[1][1].token_ids  # a queued earlier item does not change under the reader


def test_batched_items_name_their_request_and_streams_stay_apart():
    a, b = _engine_outputs(3), [replace(o, request_id="s", text=o.text.upper()) for o in _engine_outputs(4)]
    encoder, decoder = StreamEncoder(), StreamDecoder()
    order = [(0, a[0]), (1, b[0]), (1, b[1]), (0, a[1]), (1, b[2]), (0, a[2]), (1, b[3])]
    got = [decoder.decode(encoder.encode(i, out)) for i, out in order]
    assert [(i, o.request_id, o.text, o.token_ids) for i, o in got] == [
        (i, out.request_id, out.text, out.token_ids) for i, out in order]


def test_outputs_as_objects_pass_through():
    """A replica of the previous version (a rolling update) or an in-process stand-in streams objects."""
    out = _engine_outputs(1)[0]
    assert StreamDecoder().decode(out) == (0, out) and StreamDecoder().decode((3, out)) == (3, out)
    with pytest.raises(TypeError):
        StreamDecoder().decode("text")


def test_a_one_rank_decode_replica_takes_its_rank_resources_itself():
    from router.colocated import in_process_rank_options
    from router.config import AppConfig

    def options(**decode):
        config = AppConfig(model="models/tandem-tiny", device="cpu", decode={"num_replicas": 1, **decode})
        return in_process_rank_options(config, "decode")

    assert options(rank_resources={"tandem_decode": 1}) == {"num_gpus": 0, "resources": {"tandem_decode": 1}}
    assert options(tensor_parallel_size=2) is None  # its ranks are Ray actors that take them
    assert options(distributed_executor_backend="ray") is None


def test_a_gpu_decode_pool_of_one_rank_runs_it_in_a_rank_actor_unless_told_otherwise():
    from router.colocated import in_process_rank_options
    from router.config import AppConfig
    from router.disaggregated import decode_ranks_as_actors

    def config(device: str, **decode) -> AppConfig:
        return AppConfig(model="models/tandem-tiny", device=device, max_num_seqs=8, decode={"num_replicas": 2, **decode})

    gpu = decode_ranks_as_actors(config("cuda", gpus_per_rank=0.5))
    assert gpu.engine_args("decode").distributed_executor_backend == "ray"
    assert in_process_rank_options(gpu, "decode") is None  # the rank actor takes the GPU share, not the replica
    # Everything else given survives, and the replicas' args carry the choice.
    assert gpu.engine_args("decode").gpus_per_rank == 0.5 and gpu.decode.num_replicas == 2
    assert gpu.engine_args("decode").max_num_seqs == 8 and gpu.to_args()["decode"]["distributed_executor_backend"] == "ray"
    assert gpu.engine_args("prefill").distributed_executor_backend == "auto"  # router/pools.py sets the prefill's
    for kept in (config("cpu"), config("cuda", distributed_executor_backend="uni"), config("cuda", tensor_parallel_size=2)):
        assert decode_ranks_as_actors(kept) is kept


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
        {"label": "c1", "request_throughput": 0.5, "goodput": None, "ttft_p50": 2.0, "tpot_p50": None}]
