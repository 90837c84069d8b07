"""The README's flows in a new user's order, on CPU: `tandem demo`, then the cluster flow
(`ray start --head --include-dashboard=true`, `serve deploy` of the shipped deploy/serve_config.yaml
pointed at models/tandem-tiny), one OpenAI and one gRPC request, then everything stopped.

The two flows share one HOME, as they do for a user: Ray 2.60's `ray.init()` writes
`~/.ray/auth_token` unless told otherwise, and a later `ray start` turns token authentication on
when that file exists, while `serve deploy` (RAY_AUTH_MODE unset) sends no token. HOME and Ray's
temp dir are the test's own, and the cluster's ports are free ones on loopback, so a developer's Ray
is neither read nor stopped.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from parallel.net import free_port
from tandem import cli
from tandem.serving import use_private_ray_token, wait_ready

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "tandem-tiny"
BUDGET_S = 420.0  # the whole test (~2 min alone on 2 cores): a stuck step fails it instead of hanging CI
# Ray's and Tandem's environment knobs a developer may have set: the test must not inherit them.
INHERITED = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR", "TANDEM_API_KEYS")
LOG_LINE = re.compile(r"\b(INFO|DEBUG)\b")


class Deadline:
    """One time budget shared by every step; each subprocess gets what is left (at most its own cap)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self, cap: float) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the test ran past its {BUDGET_S:.0f}s budget")
        return min(cap, remaining)


def _run(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _must(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, f"{' '.join(done.args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture
def user_env(tmp_path):
    """A new user's environment: an empty HOME, Ray's temp dir short (unix socket paths must fit 107
    characters) and private to the test."""
    home = tmp_path / "home"
    home.mkdir()
    ray_tmp = Path(tempfile.mkdtemp(prefix="tfh-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in INHERITED}
    env.update(HOME=str(home), RAY_TMPDIR=str(ray_tmp), RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    try:
        yield env, home, ray_tmp
    finally:
        _kill_by_temp_dir(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _kill_by_temp_dir(ray_tmp: Path) -> None:
    """Last resort for this test's Ray processes only (`ray stop` would stop every Ray on the machine):
    each of them names the private temp dir on its command line."""
    for sig in ("-TERM", "-KILL"):
        subprocess.run(["pkill", sig, "-f", str(ray_tmp)], capture_output=True)
        deadline = time.monotonic() + 15
        while subprocess.run(["pgrep", "-f", str(ray_tmp)], capture_output=True).returncode == 0 \
                and time.monotonic() < deadline:
            time.sleep(0.5)


def _serve_config(tmp: Path, http_port: int, grpc_port: int) -> Path:
    """The shipped config with only what a one-machine CPU run must change: model, device, ports on
    loopback."""
    config = yaml.safe_load((REPO / "deploy" / "serve_config.yaml").read_text())
    config["http_options"].update(host="127.0.0.1", port=http_port)
    config["grpc_options"]["port"] = grpc_port
    config["applications"][0]["args"].update(model=str(MODEL), device="cpu")
    path = tmp / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start_head(env: dict, ray_tmp: Path, dashboard_port: int) -> subprocess.Popen:
    """`ray start --head --block` as the README has it, plus ports of its own: with --block the
    process owns the node, and stopping it stops exactly this cluster."""
    ports = {flag: free_port() for flag in ("port", "node-manager-port", "object-manager-port", "metrics-export-port",
                                            "ray-client-server-port", "dashboard-agent-listen-port",
                                            "dashboard-agent-grpc-port", "runtime-env-agent-port")}
    cmd = ["ray", "start", "--head", "--block", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dashboard_port}", "--node-ip-address=127.0.0.1", "--num-cpus=4",
           f"--temp-dir={ray_tmp}", "--disable-usage-stats", *(f"--{flag}={port}" for flag, port in ports.items())]
    # Ray 2.60's SIGTERM handler of `ray start --block` first drains the node for up to 30 s and then
    # (on this CPU-only node, with Serve already shut down) still has not exited: _stop_head would wait
    # its 30 s and SIGKILL. The test stops the node only after `serve shutdown`, so there is nothing to drain.
    env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=REPO)


def _dashboard_answers(dashboard: str) -> bool:
    """The dashboard answers the route `serve status` checks first: any HTTP answer but 404 (a refusal for
    want of a token included, which `serve status` then reports)."""
    try:
        urllib.request.urlopen(f"{dashboard}/api/ray/version", timeout=5).close()
        return True
    except urllib.error.HTTPError as e:
        return e.code != 404
    except OSError:  # refused, reset, timed out: the node is still starting
        return False


def _wait_dashboard(env: dict, dashboard: str, head: subprocess.Popen, deadline: Deadline) -> None:
    """Until `serve status` answers; an authentication error is final, not a reason to keep polling.
    While the node is still starting, a plain HTTP request (milliseconds) rather than `serve status` (a new
    Python process importing Ray: 3-10 s on 2 cores) asks whether the dashboard is up yet."""
    while not _dashboard_answers(dashboard):
        assert head.poll() is None, f"ray start exited ({head.returncode}):\n{head.stdout.read()[-3000:]}"
        deadline.left(1)  # raises once the test's budget is spent
        time.sleep(0.2)
    last = ""
    while True:
        assert head.poll() is None, f"ray start exited ({head.returncode}):\n{head.stdout.read()[-3000:]}"
        try:
            done = _run(["serve", "status", "--address", dashboard], env, deadline.left(30))
        except subprocess.TimeoutExpired:
            continue
        if done.returncode == 0:
            return
        last = done.stdout[-2000:] + done.stderr[-2000:]
        token = Path(env["HOME"], ".ray", "auth_token")
        assert "Authentication" not in last, f"serve status against the new cluster ({token} exists: {token.exists()}):\n{last}"
        time.sleep(1)


def _grpc_generate(grpc_port: int, prompt: str, timeout: float):
    import grpc

    from router.proto import inference_pb2, inference_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(model="tandem-tiny", prompt=prompt, max_tokens=8, temperature=0.0)
        return stub.Generate(request, metadata=(("application", "tandem"),), timeout=timeout)


def _run_demo(env: dict, deadline: Deadline) -> None:
    """`tandem demo` answers both requests and prints no INFO log lines."""
    done = _run(["tandem", "demo", "--max-tokens", "16"], env, deadline.left(300))
    out = _must(done) + done.stderr  # what the user's terminal shows: both streams
    assert "--- OpenAI /v1/completions, streamed" in out and "--- gRPC tandem.v1.Inference/Generate" in out, out
    assert "finish_reason" in out, out
    logs = [line for line in out.splitlines() if LOG_LINE.search(line)]
    assert not logs, "the demo's output holds log lines:\n" + "\n".join(logs[:10])


@pytest.mark.slow
def test_demo_then_cluster_flow_in_one_home(user_env, tmp_path):
    from openai import OpenAI

    env, home, ray_tmp = user_env
    deadline = Deadline(BUDGET_S)
    _run_demo(env, deadline)

    dashboard_port, http_port, grpc_port = free_port(), free_port(), free_port()
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    config = _serve_config(tmp_path, http_port, grpc_port)
    head = _start_head(env, ray_tmp, dashboard_port)
    try:
        _wait_dashboard(env, dashboard, head, deadline)
        _must(_run(["serve", "deploy", str(config), "--address", dashboard], env, deadline.left(60)))
        base_url = f"http://127.0.0.1:{http_port}"
        wait_ready(base_url, "tandem-tiny", timeout_s=deadline.left(300))
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=deadline.left(60))
        out = client.completions.create(model="tandem-tiny", prompt="def f():", max_tokens=8, temperature=0.0)
        assert out.choices[0].text and out.usage.completion_tokens >= 1
        reply = _grpc_generate(grpc_port, "def f():", deadline.left(60))
        assert reply.text == out.choices[0].text and reply.usage.completion_tokens == out.usage.completion_tokens
        _must(_run(["serve", "shutdown", "-y", "--address", dashboard], env, deadline.left(60)))
    finally:
        _stop_head(head)
    # Only the user's own `ray start`/`ray get-auth-token --generate` may create the file that turns on
    # token auth in every later `ray start` of this user; the demo's private Ray must not.
    assert not (home / ".ray" / "auth_token").exists(), "tandem demo left ~/.ray/auth_token behind"


def _stop_head(head: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block` stops the node's processes; SIGKILL the group if it lingers."""
    if head.poll() is None:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=10)


def test_private_ray_token_is_fresh_and_yields_to_the_users_settings():
    env: dict[str, str] = {}
    assert use_private_ray_token(env) and len(env["RAY_AUTH_TOKEN"]) == 64
    other: dict[str, str] = {}
    use_private_ray_token(other)
    assert other["RAY_AUTH_TOKEN"] != env["RAY_AUTH_TOKEN"]
    for given in ({"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_MODE": "token"}, {"RAY_AUTH_TOKEN": "mine"},
                  {"RAY_AUTH_TOKEN_PATH": "/secrets/t"}):
        env = dict(given)
        assert not use_private_ray_token(env) and env == given


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_serve_on_a_taken_port_is_one_error_line(flag, capsys, monkeypatch):
    import socket

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1" if flag == "--port" else "0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = "--grpc-port" if flag == "--port" else "--port"
        argv = ["serve", "--device", "cpu", "--host", "127.0.0.1", flag, str(port), other, str(free_port())]
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"port {port} is already in use" in err and f"pick another with {flag}" in err, err
