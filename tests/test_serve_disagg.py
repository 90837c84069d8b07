"""The disaggregated app as users run it: `ray start --head`, `serve deploy` of a config derived from
deploy/serve_config.yaml, then the OpenAI SDK and a gRPC client against Serve's proxies.

Prefill runs TP=2 and decode TP=1, so every request's KV is resharded on its way between the pools.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from parallel.net import free_port
from tests.models import hf_greedy
from tests.serving import build_chat_model

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NAME = "tiny-disagg"
PROMPTS = ["def add(a, b):", "import os\n", "x", "class Node:\n    def __init__(self):"]


def _run(*cmd: str, env: dict, timeout: float = 300) -> str:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def _wait(predicate, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - not there yet
            last = e
        time.sleep(interval)
    raise TimeoutError(f"{what} within {timeout:.0f}s (last error: {last})")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    model = build_chat_model(tmp / NAME)
    ports = {name: free_port() for name in ("gcs", "dashboard", "http", "grpc", "metrics")}
    token = tmp / "ray_auth_token"
    token.write_text(secrets.token_hex(32))
    # Token authentication on, with the test's own token: the dashboard (serve deploy's endpoint) then
    # behaves the same whether or not this machine has a ~/.ray/auth_token from elsewhere.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    config = yaml.safe_load((REPO / "deploy" / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": ports["http"]}
    config["grpc_options"]["port"] = ports["grpc"]
    config["proxy_location"] = "HeadOnly"
    args = config["applications"][0]["args"]
    args.update(model=model, served_model_name=NAME, device="cpu", dtype="float32", num_gpu_blocks_override=64, block_size=8,
                max_num_batched_tokens=128, max_num_seqs=16, max_waiting_requests=32, api_keys_env=None,
                local_prefill_max_tokens=0, local_prefill_when_idle=False,  # every request hands its KV over
                stream_items_per_s=50)  # paced streams: a stream's item every 20 ms, so items carry several tokens
    args["prefill"] = {"num_replicas": 1, "tensor_parallel_size": 2}
    args["decode"] = {"num_replicas": 1, "tensor_parallel_size": 1}
    config_path = tmp / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    ray_tmp = Path(tempfile.mkdtemp(prefix="tdm-ray-", dir="/tmp"))  # short: Ray's unix socket paths must fit 107 chars
    _run("ray", "start", "--head", f"--port={ports['gcs']}", "--num-cpus=4", "--include-dashboard=true",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}", f"--metrics-export-port={ports['metrics']}",
         f"--temp-dir={ray_tmp}", "--disable-usage-stats", env=env)
    try:
        dashboard = f"http://127.0.0.1:{ports['dashboard']}"
        _wait(lambda: subprocess.run(["serve", "status", "--address", dashboard], env=env, capture_output=True,
                                     timeout=60).returncode == 0, 180, "the Ray dashboard (serve deploy's endpoint) did not come up")
        _run("serve", "deploy", str(config_path), "--address", dashboard, env=env)
        http = f"http://127.0.0.1:{ports['http']}"
        _wait(lambda: urllib.request.urlopen(f"{http}/health", timeout=5).status == 200, 600, "the app did not become healthy")
        yield {"http": http, "grpc": f"127.0.0.1:{ports['grpc']}", "model": model, "gcs": f"127.0.0.1:{ports['gcs']}",
               "metrics": f"http://127.0.0.1:{ports['metrics']}/metrics", "env": env, "dashboard": dashboard}
    finally:
        _stop_cluster(ray_tmp)


def _stop_cluster(ray_tmp: Path) -> None:
    """Stop this test's cluster only: `ray stop` would also kill any other Ray on the machine. Every
    process of the cluster names its temp dir on its command line."""
    # The GCS, raylet and autoscaler monitor of a non-blocking `ray start` outlive SIGTERM by far more than
    # 20 s (Ray 2.60): a short grace for the processes that do exit on it, then SIGKILL.
    for sig, grace_s in (("-TERM", 3), ("-KILL", 20)):
        subprocess.run(["pkill", sig, "-f", str(ray_tmp)], capture_output=True)
        deadline = time.monotonic() + grace_s
        while subprocess.run(["pgrep", "-f", str(ray_tmp)], capture_output=True).returncode == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=f"{cluster['http']}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf_tokens(cluster) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cluster["model"])
    return {p: hf_greedy(cluster["model"], tok.encode(p), 12)[0] for p in PROMPTS}


@pytest.fixture(scope="module")
def reference(cluster, hf_tokens) -> dict[str, str]:
    """HF's greedy tokens as text, detokenized as a stream is (a trailing partial character is withheld)."""
    from transformers import AutoTokenizer

    from engine.detokenizer import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(cluster["model"])
    texts = {}
    for prompt, tokens in hf_tokens.items():
        detok = IncrementalDetokenizer(tok, tok.encode(prompt))
        for t in tokens:
            detok.add_token(t)
        texts[prompt] = detok.text
    return texts


def _pool_stats(cluster) -> dict:
    """Each pool's engine stats, read through Serve handles from a driver attached to the cluster: by its GCS
    address, not 'auto', which would take the newest Ray on the machine (the session's shared one, say)."""
    code = (f"import json, ray; from ray import serve; ray.init(address={cluster['gcs']!r}, logging_level='ERROR');"
            "print(json.dumps({p: serve.get_deployment_handle(p, 'tandem').stats.remote().result(timeout_s=60)"
            " for p in ('PrefillPool', 'DecodePool')}))")
    out = _run(sys.executable, "-c", code, env=cluster["env"], timeout=120)
    return json.loads(out.strip().splitlines()[-1])


def test_greedy_completions_equal_hf_through_both_pools(client, reference):
    for prompt, want in reference.items():
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].text == want, prompt


def test_streamed_text_equals_non_streamed(client):
    for prompt in PROMPTS[:2]:
        full = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        pieces = [c.choices[0].text for c in client.completions.create(
            model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True})
            if c.choices]
        assert "".join(pieces) == full


def test_a_paced_decode_stream_sends_several_tokens_an_item_and_loses_none(client):
    """The decode replica paces its streams (the fixture's stream_items_per_s=50: one stream, an item every 20 ms
    at most; unpaced, this CPU streams a token every 1-3 ms): the chunks after the router's token 1 come at least
    ~20 ms apart, each with several tokens' text,
    and together they are the non-streamed text."""
    import statistics
    import time

    prompt = PROMPTS[0]
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=96, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    pieces, times = [], []
    for c in client.completions.create(model=NAME, prompt=prompt, max_tokens=96, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}):
        if c.choices and c.choices[0].text:
            pieces.append(c.choices[0].text)
            times.append(time.monotonic())
    assert "".join(pieces) == full
    # Chunk 0 is the router's token 1, chunk 1 the decode replica's first item (never held), the last is never
    # held either: the gaps between the others are the pace's.
    held = [b - a for a, b in zip(times[1:-1], times[2:-1])]
    # The replica's gaps are ≥ 20 ms; the client sees them through two more hops, whose jitter moves time from one
    # gap to the next (a late item shortens the ones after it: 17, 9.96 and once 52-7-2 ms gaps on the 2-core box),
    # so the typical gap, not the shortest: median ≥ 15 ms and mean ≥ 18 ms (unpaced, both 1-3 ms).
    shown = (held, [len(p) for p in pieces], [round(t - times[0], 3) for t in times])
    assert held and statistics.median(held) >= 0.015 and sum(held) / len(held) >= 0.018, shown
    assert len(pieces) < 48, len(pieces)


def test_concurrent_requests_all_correct(client, reference):
    prompts = [p for p in PROMPTS for _ in range(3)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: client.completions.create(
            model=NAME, prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}).choices[0].text, prompts))
    by_prompt = {}
    for p, t in zip(prompts, texts):
        by_prompt.setdefault(p, set()).add(t)
    assert all(v == {reference[p]} for p, v in by_prompt.items()), by_prompt


def test_grpc_token_ids_equal_hf(cluster, hf_tokens):
    from router.proto import inference_pb2 as pb
    from router.proto import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(cluster["grpc"]) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for prompt, want in hf_tokens.items():
            req = pb.GenerateRequest(model=NAME, prompt=prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
            reply = stub.Generate(req, metadata=(("application", "tandem"),), timeout=120)
            assert list(reply.token_ids) == want, prompt


def test_grpc_generate_matches_openai(cluster, client):
    from router.proto import inference_pb2 as pb
    from router.proto import inference_pb2_grpc as pb_grpc

    want = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    with grpc.insecure_channel(cluster["grpc"]) as channel:
        stub = pb_grpc.InferenceStub(channel)
        meta = (("application", "tandem"),)
        req = pb.GenerateRequest(model=NAME, prompt=PROMPTS[0], max_tokens=10, temperature=0.0, ignore_eos=True)
        unary = stub.Generate(req, metadata=meta, timeout=120)
        streamed = "".join(r.text for r in stub.GenerateStream(req, metadata=meta, timeout=120))
        with pytest.raises(grpc.RpcError) as bad:
            stub.Generate(pb.GenerateRequest(model=NAME, prompt="x", max_tokens=-1), metadata=meta, timeout=60)
    assert unary.text == want == streamed
    assert unary.usage.completion_tokens == 10
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("body,status", [
    ({"max_tokens": -1}, 400),
    ({"temperature": "hot"}, 400),
    ({"max_tokens": 10_000}, 400),  # prompt + max_tokens over max_model_len
    ({"prompt": [10**6]}, 400),  # token id outside the vocabulary
    ({"model": "no-such-model"}, 404),
])
def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(cluster, client, body, status):
    payload = {"model": NAME, "prompt": "x", "max_tokens": 4, **body}
    req = urllib.request.Request(f"{cluster['http']}/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == status
    assert "message" in json.loads(err.value.read())["error"]
    ok = client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_disconnect_mid_stream_frees_blocks_in_both_pools(cluster):
    import http.client

    host, port = cluster["http"].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": NAME, "prompt": PROMPTS[3], "max_tokens": 200, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data:")  # streaming has begun: the request runs in the decode pool
    conn.sock.close()  # the client goes away mid-stream
    conn.close()

    def idle():
        stats = _pool_stats(cluster)
        return all(s["blocks_used"] == 0 and s["running"] == 0 for s in stats.values())

    _wait(idle, 60, "the pools did not free the aborted request's blocks", interval=2.0)

    # With no traffic after the abort, no step follows the frees: the exported KV gauges of both pools
    # must still come down to 0 (they used to keep the blocks in use of the last step).
    def gauges_at_rest():
        text = urllib.request.urlopen(cluster["metrics"], timeout=10).read().decode()
        used = {pool: [float(v) for v in re.findall(
            r'^ray_tandem_kv_blocks_used\{[^}]*pool="' + pool + r'"[^}]*\} ([0-9.e+]+)$', text, re.M)]
            for pool in ("prefill", "decode")}
        return all(values and not any(values) for values in used.values())

    _wait(gauges_at_rest, 60, "tandem_kv_blocks_used did not return to 0 in both pools at rest", interval=2.0)


def test_kv_transfer_metric_shows_the_prompts_moving_between_pools(cluster):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(cluster["model"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = cfg.num_hidden_layers * 2 * 8 * cfg.num_key_value_heads * head_dim * 4  # fp32, block_size 8

    def exported() -> float:
        text = urllib.request.urlopen(cluster["metrics"], timeout=10).read().decode()
        values = [float(v) for v in re.findall(r"^ray_tandem_kv_transfer_bytes(?:_total)?(?:\{[^}]*\})? ([0-9.e+]+)$",
                                                text, re.M)]
        return sum(values)

    # More than 20 requests ran before this test, each sending at least one block; Ray exports metrics
    # periodically, so wait for the counter to catch up rather than reading its first export.
    moved = _wait(lambda: exported() >= 20 * block_bytes and exported(), 120,
                  "tandem_kv_transfer_bytes did not reach 20 blocks' worth", interval=3.0)
    assert moved % block_bytes == 0  # whole blocks move


def test_token_1_comes_over_the_prefill_lane(cluster, client):
    """Every request here is router-driven (local_prefill_max_tokens=0): its prefill starts on the prefill replica's
    lane (router/prefill_lane.py) and token 1 comes back on it, which the request's `lane_first` stage counts.
    The lane is announced in the replica's routing stats, polled every second: requests before that take Serve."""
    from prometheus_client.parser import text_string_to_metric_families

    def lane_firsts() -> float:
        client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=3, temperature=0)
        text = urllib.request.urlopen(f"{cluster['http']}/metrics", timeout=30).read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        return sum(s.value for s in families["tandem_request_stage_seconds"].samples
                   if s.name == "tandem_request_stage_seconds_count" and s.labels.get("stage") == "lane_first")

    assert _wait(lane_firsts, 60, "no request's token 1 came over the prefill lane", interval=2.0) > 0


def test_api_port_metrics_cover_every_replica(cluster, client):
    """GET /metrics on the app's own port (no Ray metrics port) shows the pools' engine metrics beside the
    Router's: every replica publishes its page to Ray's KV, the answering Router replica merges them
    (router/replica_metrics.py). One HELP/TYPE per family, every sample labelled with its replica."""
    from prometheus_client.parser import text_string_to_metric_families

    for prompt in PROMPTS[:2]:  # handoffs of its own, whatever ran before
        client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)

    def page() -> dict | None:
        text = urllib.request.urlopen(f"{cluster['http']}/metrics", timeout=30).read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        usage = {s.labels["pool"] for s in families["tandem_kv_cache_usage_perc"].samples if s.labels["model_name"] == NAME}
        moved = sum(s.value for s in families["tandem_kv_transfer_bytes"].samples
                    if s.name == "tandem_kv_transfer_bytes_total" and s.labels.get("pool") == "decode"
                    and s.labels.get("model_name") == NAME and s.labels.get("replica"))
        return {"text": text, "families": families} if usage == {"decode", "prefill"} and moved > 0 else None

    got = _wait(page, 60, "the API port's /metrics did not show both pools' engine metrics", interval=2.0)
    sites = [s for s in got["families"]["tandem_prefill_site"].samples if s.name == "tandem_prefill_site_total"]
    assert sites and all(s.labels["model_name"] == NAME and s.labels["pool"] == "decode" for s in sites)
    types = re.findall(r"^# TYPE (\S+) ", got["text"], re.M)
    assert len(types) == len(set(types)) and "tandem_kv_transfer_seconds" in types
    samples = [s for f in got["families"].values() for s in f.samples]
    assert all(s.labels.get("replica") for s in samples)
    series = [(s.name, tuple(sorted(s.labels.items()))) for s in samples]
    assert len(series) == len(set(series))
    running = {s.labels["pool"]: s.labels["replica"] for s in got["families"]["tandem_num_requests_running"].samples}
    assert running.keys() == {"decode", "prefill"} and running["decode"] != running["prefill"]
    ok = [s for s in got["families"]["tandem_requests"].samples
          if s.name == "tandem_requests_total" and s.labels["status"] == "ok" and s.value >= 2]
    assert ok and ok[0].labels["replica"] not in running.values()  # the Router's front-end counter, its own replica


def test_echo_and_prompt_logprobs_come_from_the_prefill_pool(cluster, client):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs, one token) on the disaggregated app:
    the prompt runs on the TP=2 prefill pool, whose prompt logprobs travel with the handoff and equal HF's
    log-softmax, in the non-streamed reply (the last output) and on a stream's first chunk (token 1)."""
    import math

    import torch
    from transformers import AutoTokenizer

    from tests.models import hf_model

    tok = AutoTokenizer.from_pretrained(cluster["model"])
    text = PROMPTS[3]
    ids = tok.encode(text)
    with torch.no_grad():
        ref = hf_model(cluster["model"])(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    r = client.completions.create(model=NAME, prompt=text, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(text) and lp.token_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[pos], ref[pos - 1, ids[pos]].item(), abs_tol=1e-4), pos
    stream = list(client.completions.create(model=NAME, prompt=ids, max_tokens=3, temperature=0, stream=True,
                                            extra_body={"prompt_logprobs": 0}))
    field = stream[0].choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    for pos in range(1, len(ids)):
        [(key, entry)] = field[pos].items()
        assert int(key) == ids[pos] and math.isclose(entry["logprob"], ref[pos - 1, ids[pos]].item(), abs_tol=1e-4)
