"""Running the served app in the foreground: from a full Serve config file or from bare app args.

`ServeSpec` is what `serve deploy` would read (http/gRPC options and every application), so
`tandem serve --config deploy/serve_config.yaml` honours the same file a cluster runs. `start`
brings up local Ray and Serve and deploys each application; `wait_ready` returns only once a real
one-token completion succeeds, so "ready" means the first request of a client will too.
"""
from __future__ import annotations

import importlib
import json
import errno
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from cluster.ray_runtime import AUTH_TOKEN_SOURCES, use_private_ray_token  # re-exported: the CLI and tests use them

TANDEM_IMPORT_PATH = "router.app:build_app"
GRPC_SERVICER = "router.proto.inference_pb2_grpc.add_InferenceServicer_to_server"


@dataclass
class ServeSpec:
    """Serve's http_options, grpc_options and applications (each: name, route_prefix, import_path, args)."""

    applications: list[dict[str, Any]]
    http_options: dict[str, Any] = field(default_factory=dict)
    grpc_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_file_content(cls, loaded: dict[str, Any]) -> "ServeSpec":
        """A Serve config (with `applications`) or a bare mapping of app args."""
        if "applications" not in loaded:
            return cls.from_args(loaded)
        apps = [dict(app) for app in loaded["applications"]]
        if not apps:
            raise ValueError("the Serve config has no applications")
        for app in apps:
            app.setdefault("name", "default")
            app.setdefault("route_prefix", "/")
            app.setdefault("args", {})
            if "import_path" not in app:
                raise ValueError(f"application {app['name']!r} has no import_path")
        return cls(apps, dict(loaded.get("http_options") or {}), dict(loaded.get("grpc_options") or {}))

    @classmethod
    def from_args(cls, args: dict[str, Any], name: str = "tandem") -> "ServeSpec":
        app = {"name": name, "route_prefix": "/", "import_path": TANDEM_IMPORT_PATH, "args": dict(args)}
        return cls([app], {"host": "0.0.0.0", "port": 8000}, {"port": 9000})

    def tandem_app(self) -> dict[str, Any]:
        """The application Tandem serves (the first one built by router.app)."""
        for app in self.applications:
            if app["import_path"] == TANDEM_IMPORT_PATH:
                return app
        raise ValueError(f"no application with import_path {TANDEM_IMPORT_PATH!r} in the Serve config")

    def override(self, host: str | None = None, port: int | None = None, grpc_port: int | None = None,
                 args: dict[str, Any] | None = None) -> None:
        """Command-line values win over the file's."""
        if host is not None:
            self.http_options["host"] = host
        if port is not None:
            self.http_options["port"] = port
        if grpc_port is not None:
            self.grpc_options["port"] = grpc_port
        if args:
            self.tandem_app()["args"].update(args)

    @property
    def http_host(self) -> str:
        return self.http_options.get("host", "127.0.0.1")

    @property
    def http_port(self) -> int:
        return int(self.http_options.get("port", 8000))

    @property
    def grpc_port(self) -> int:
        return int(self.grpc_options.get("port", 9000))

    def local_url(self) -> str:
        """Where this machine reaches the HTTP proxy."""
        host = self.http_host
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{self.http_port}"


LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Ray Serve 2.60 starts its gRPC proxy on `[::]:<port>` (ray/serve/_private/grpc_util.py) and its
# gRPCOptions has no host: the gRPC API listens on every interface whatever http_options.host says.
GRPC_BIND = "*"
GRPC_BIND_NOTE = "every interface: Ray Serve's gRPC proxy cannot bind one host"


def bound_addresses(spec: ServeSpec) -> dict[str, str]:
    """Where each API really listens, as `host:port` (`*` = every interface)."""
    return {"http": f"{spec.http_host}:{spec.http_port}", "grpc": f"{GRPC_BIND}:{spec.grpc_port}"}


def exposure_warnings(spec: ServeSpec, api_keys: frozenset[str] | list[str]) -> list[str]:
    """One line per API that anyone reaching this machine can use: no key, and not on loopback only."""
    if api_keys:
        return []
    fix = "(set --api-keys, or --api-keys-env NAME)"
    warnings = []
    if spec.http_host not in LOOPBACK:
        warnings.append(f"warning: the OpenAI API listens on {spec.http_host}:{spec.http_port} with no API key: "
                        f"anyone who reaches this port can use it {fix}")
    warnings.append(f"warning: gRPC listens on {GRPC_BIND}:{spec.grpc_port} ({GRPC_BIND_NOTE}) with no API key: "
                    f"anyone who reaches this port can use it {fix}")
    return warnings


def ready_line(spec: ServeSpec, seconds: float) -> str:
    """What `tandem serve` prints once ready: the addresses really bound, not the ones asked for."""
    bound = bound_addresses(spec)
    return (f"Tandem ready after {seconds:.1f}s: OpenAI API at http://{bound['http']}/v1 (metrics at /metrics), "
            f"gRPC tandem.v1.Inference at {bound['grpc']} ({GRPC_BIND_NOTE}). Ctrl-C stops.")


def _build(app: dict[str, Any]):
    """Serve's rule for import_path: an application builder is called with the args, a bound
    application is used as is."""
    from ray.serve import Application

    module, _, attr = app["import_path"].partition(":")
    if not attr:
        module, _, attr = app["import_path"].rpartition(".")
    target = getattr(importlib.import_module(module), attr)
    return target if isinstance(target, Application) else target(app["args"])


def start_ray(verbose: bool = False) -> None:
    """Join the Ray this process is connected to, else the cluster $RAY_ADDRESS names, else start a
    private local one (address="local": a `ray start` cluster running here is not joined by accident)."""
    import logging

    import ray

    level = logging.INFO if verbose else logging.ERROR
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=level)  # the cluster $RAY_ADDRESS names, with its own resources and auth
        return
    use_private_ray_token()
    # Ray's own notice that token auth is on (with RAY_AUTH_MODE unset) speaks of the user's cluster
    # settings; this instance is private, so it stays out of the demo's output unless --verbose.
    logging.getLogger("ray._private.authentication").setLevel(level)
    # Pool ranks are Ray actors taking one CPU each; ask for enough slots even on a 2-core machine.
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, logging_level=level,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})


def check_gpus_suffice(config: Any, cluster_gpus: float, own_cluster: bool) -> str | None:
    """An app whose pools need more GPUs than the cluster has would wait for them without a word (each
    pool replica's placement waits minutes, and Serve then retries it). On a Ray this command started
    itself nothing will add GPUs, so that is a ValueError with the breakdown; on a cluster (an
    autoscaler may add nodes) it is a warning, returned as a line to print. None where they suffice."""
    if config.device == "cpu" or (config.device == "auto" and cluster_gpus == 0):
        return None
    needed = config.gpus_needed()
    total = sum(needed.values())
    if total <= cluster_gpus + 1e-9:
        return None
    parts = ", ".join(f"{pool} {n:g}" for pool, n in needed.items())
    message = (f"the app needs {total:g} GPUs at its starting size ({parts}: replicas x ranks x gpus_per_rank) and "
               f"the Ray cluster has {cluster_gpus:g}; lower the replicas or parallel sizes, or let pools share GPUs "
               "with gpus_per_rank below 1 (and gpu_memory_utilization to match)")
    if own_cluster:
        raise ValueError(message)
    return f"warning: {message}; waiting for the cluster to grow"


def start(spec: ServeSpec, verbose: bool = False) -> None:
    """Ray (see start_ray) and Serve with the spec's proxies, then every application."""
    import logging

    from ray import serve
    from ray.serve.schema import LoggingConfig

    logging.getLogger("ray.serve").setLevel(logging.INFO if verbose else logging.WARNING)  # this process's Serve client
    start_ray(verbose)
    import ray

    from router.config import AppConfig

    app = next((a for a in spec.applications if a["import_path"] == TANDEM_IMPORT_PATH), None)
    if app is not None:
        warning = check_gpus_suffice(AppConfig.model_validate(app["args"]), ray.cluster_resources().get("GPU", 0),
                                     own_cluster=not os.environ.get("RAY_ADDRESS"))
        if warning:
            print(warning, file=sys.stderr, flush=True)
    grpc = dict(spec.grpc_options)
    grpc["grpc_servicer_functions"] = list(dict.fromkeys([*grpc.get("grpc_servicer_functions", []), GRPC_SERVICER]))
    logging_config = LoggingConfig(log_level="INFO" if verbose else "WARNING")
    serve.start(http_options=spec.http_options, grpc_options=grpc, logging_config=logging_config)
    for app in spec.applications:
        serve.run(_build(app), name=app["name"], route_prefix=app["route_prefix"], blocking=False,
                  logging_config=logging_config)


def stop(timeout_s: float = 60.0) -> None:
    """Shut Serve down, every application deleted first. Serve's own shutdown stops an application's
    deployments one after another, and a replica's graceful stop takes at least one
    graceful_shutdown_wait_loop_s (2 s) even when it is idle: 7 s for the disaggregated app's Router,
    DecodePool and PrefillPool on 2 cores. Deleting the applications stops all their replicas at once, each
    with the same graceful stop (requests in flight still drain); the shutdown then finds only Serve's own
    actors: about 3 s in all. Nothing is started where Ray is not running (Serve's calls would ray.init)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        names = list(serve.status().applications)
        for name in names:
            serve.delete(name, _blocking=False)
        deadline = time.monotonic() + timeout_s  # past it, serve.shutdown stops what is left its own way
        while names and time.monotonic() < deadline:
            time.sleep(0.05)
            names = [n for n in names if n in serve.status().applications]
    except Exception:  # noqa: BLE001 - Serve half started or unreachable: its own shutdown copes with that
        pass
    serve.shutdown()


def check_ports_free(spec: ServeSpec) -> None:
    """Serve's HTTP and gRPC proxies bind these ports on this machine. One already taken (an earlier
    `tandem serve`, a `ray start` cluster's Serve app, vLLM) would otherwise surface only as a proxy
    that never answers; raised as ValueError naming the port and the flag that moves it."""
    for what, host, port, flag in (("HTTP", spec.http_host, spec.http_port, "--port"),
                                   ("gRPC", "0.0.0.0", spec.grpc_port, "--grpc-port")):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the proxies bind: TIME_WAIT is no conflict
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise ValueError(f"{what} port {port} on {host}: {e.strerror}") from None
                raise ValueError(f"{what} port {port} is already in use on this machine (see `ss -ltnp "
                                 f"'sport = :{port}'`): stop what holds it, or pick another with {flag}") from None


def wait_ready(base_url: str, model: str, timeout_s: float, api_key: str | None = None) -> float:
    """Poll with a one-token completion until one succeeds; the seconds it took. A 4xx other than 404
    (routes not up yet) or 429/503 (replicas starting) means a bad configuration: raised at once."""
    body = json.dumps({"model": model, "prompt": "ready?", "max_tokens": 1, "temperature": 0.0}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    t0 = time.monotonic()
    last = "no answer"
    while time.monotonic() - t0 < timeout_s:
        request = urllib.request.Request(f"{base_url}/v1/completions", data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                json.load(r)
                return time.monotonic() - t0
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
            if 400 <= e.code < 500 and e.code not in (404, 408, 429):
                raise RuntimeError(f"the app refused a test request: {last}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as e:
            last = str(e)
        time.sleep(0.5)
    raise TimeoutError(f"the app at {base_url} did not answer a request within {timeout_s:.0f}s (last: {last})")
