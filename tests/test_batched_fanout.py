"""Issue 19 item 1: `n` > 1 and prompt lists reach the backend as ONE batched call (not one stream per
choice), whose choices of one prompt share its KV through the prefix cache; per-choice seeds, client
disconnects and the engine at rest afterwards. Colocated here (a LocalBackend under the OpenAI app); the
disaggregated path is in tests/test_replica_death.py (shared Ray app) and tests/test_serve_fanout.py."""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from router.fanout import Fanout
from router.openai_api import create_openai_app
from router.protocol import GenerateRequest
from tests.serving import build_chat_model, make_backend, slow_engine, wait_idle
from workers.sampling_params import SamplingParams

# 40 tokens or more under the tiny tokenizer: two full 16-token blocks to share.
LONG = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


class _Calls:
    """The backend, recording how the front end called it."""

    def __init__(self, inner):
        self._inner = inner
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, req):
        self.calls.append(("generate", 1))
        return self._inner.generate(req)

    def generate_batch(self, reqs):
        self.calls.append(("generate_batch", len(reqs)))
        return self._inner.generate_batch(reqs)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    b = make_backend(build_chat_model(tmp_path_factory.mktemp("models") / "batch-llama"))
    yield b
    asyncio.run(b.close())


@pytest.fixture
def client(backend):
    calls = _Calls(backend)
    with TestClient(create_openai_app(calls)) as c:
        c.calls = calls.calls
        yield c
        wait_idle(lambda: c.portal.call(backend.stats))


def _finished(r, stream: bool) -> dict[int, str]:
    """index -> text of every finished choice."""
    if not stream:
        return {c["index"]: c["text"] for c in r.json()["choices"] if c["finish_reason"]}
    frames = [json.loads(f[6:]) for f in r.text.split("\n\n") if f.startswith("data: {")]
    texts: dict[int, str] = {}
    done = set()
    for f in frames:
        for c in f["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                done.add(c["index"])
    return {i: texts[i] for i in done}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_n16_is_one_call_and_the_choices_share_the_prompt_kv(client, backend, stream):
    before = client.portal.call(backend.stats)
    ids = client.post("/tokenize", json={"prompt": LONG}).json()["tokens"]
    r = client.post("/v1/completions", json={"prompt": LONG, "n": 16, "max_tokens": 3, "ignore_eos": True,
                                             "temperature": 1.0, "seed": 11, "stream": stream})
    assert r.status_code == 200, r.text
    assert len(_finished(r, stream)) == 16
    assert client.calls == [("generate_batch", 16)]
    after = client.portal.call(backend.stats)
    # The first choice computes the prompt; the other 15 find its full blocks cached (before: each of the
    # 16 separate requests was admitted in the same step, and none found anything).
    full_blocks_tokens = (len(ids) - 1) // 16 * 16
    assert full_blocks_tokens >= 32
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] >= 15 * full_blocks_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_list_of_32_prompts_is_one_call(client, stream):
    prompts = [f"prompt number {i}: " + "x" * (i % 7) for i in range(32)]
    r = client.post("/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 2, "ignore_eos": True,
                                             "stream": stream})
    assert r.status_code == 200, r.text
    assert sorted(_finished(r, stream)) == list(range(64))
    assert client.calls == [("generate_batch", 64)]


def test_choices_keep_their_seeds(client):
    """Choice j of a seeded request samples as a request of its own with seed + j would."""
    body = {"prompt": LONG, "max_tokens": 6, "ignore_eos": True, "temperature": 1.0}
    together = client.post("/v1/completions", json={**body, "n": 4, "seed": 100}).json()["choices"]
    alone = [client.post("/v1/completions", json={**body, "seed": 100 + j}).json()["choices"][0]["text"] for j in range(4)]
    assert [c["text"] for c in sorted(together, key=lambda c: c["index"])] == alone
    assert len(set(alone)) > 1  # the seeds differ, so do the choices


def test_closing_the_batch_aborts_every_choice(backend):
    async def body():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        reqs = [GenerateRequest(f"close-{i}", [5 + i, 6, 7, 8], params) for i in range(4) for _ in range(2)]
        reqs = [GenerateRequest(f"close-{k}", r.prompt_token_ids, params) for k, r in enumerate(reqs)]
        calls = _Calls(backend)
        fanout = Fanout(calls, reqs)
        await fanout.started()  # every choice runs
        assert (await backend.stats())["running"] == 8
        await fanout.aclose()
        assert calls.calls == [("generate_batch", 8)]

    with slow_engine(backend):
        asyncio.run(body())
    wait_idle(lambda: asyncio.run(backend.stats()))


def test_bench_fanout_dry_run(backend, tmp_path):
    """scripts/bench_fanout.py in a tiny run: the batched case computes the shared prompt once."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_fanout

    out = tmp_path / "fanout.json"
    res = bench_fanout.main(["--model", backend.llm_engine.config.model.model, "--n", "4", "--prompt-tokens", "48",
                             "--max-tokens", "2", "--repeat", "1", "--out", str(out)])
    assert json.loads(out.read_text())["batched"] == res["batched"]
    assert res["batched"]["prefill_tokens_computed"] == 48 + 3 * 16  # the other 3 choices: the last partial block only
    assert res["separate"]["prefill_tokens_computed"] >= res["batched"]["prefill_tokens_computed"]


def test_closing_right_after_the_choices_were_added_aborts_them(backend):
    """The other choices of a prompt are added when their leader's first output arrives, just before that
    output is handed on: a consumer that stops there must abort them too, though their streams never ran."""
    async def body():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        items = [(f"race-{j}", list(range(5, 45)), params, 0) for j in range(4)]
        stream = backend.async_engine.generate_many(items)
        i, first = await anext(stream)
        assert i == 0 and first.new_token_ids
        await stream.aclose()
        await asyncio.sleep(0.3)  # the aborts are queued on the engine thread
        return await backend.stats()

    with slow_engine(backend, 0.02):
        stats = asyncio.run(body())
    assert stats["running"] == stats["waiting"] == stats["blocks_used"] == 0, stats


def test_admission_counts_every_choice_of_the_batch(tmp_path):
    """One batched call still meets the engine's queue bound per choice: n=4 on an engine that runs one
    request and lets one wait is refused (429), whole, and leaves nothing behind."""
    small = make_backend(build_chat_model(tmp_path / "adm-llama"), max_num_seqs=1, max_waiting_requests=1)
    calls = _Calls(small)
    with TestClient(create_openai_app(calls)) as c:
        try:
            r = c.post("/v1/completions", json={"prompt": LONG, "n": 4, "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            assert calls.calls == [("generate_batch", 4)]
            wait_idle(lambda: c.portal.call(small.stats))
            r = c.post("/v1/completions", json={"prompt": LONG, "n": 2, "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text  # one runs, one waits: within the bound
        finally:
            c.portal.call(small.close)
