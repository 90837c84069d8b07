"""Colocated serving: one ingress deployment whose replicas each run a whole engine (`LocalBackend`)
behind the OpenAI HTTP routes and the gRPC methods. No KV moves between processes."""
from __future__ import annotations

from typing import Any

import ray
from ray import serve
from ray.serve import Application

from router.config import AppConfig
from router.grpc_api import InferenceServicer
from router.guards import RequestLimits
from router.local_backend import LocalBackend
from router.openai_api import create_openai_app
from router.replica_metrics import start_publishing


@serve.ingress()
class ColocatedServer(InferenceServicer):
    """One replica: an in-process engine, the OpenAI routes (built per replica by
    `__serve_build_asgi_app__`) and the gRPC methods Generate / GenerateStream (inherited)."""

    def __init__(self, args: dict[str, Any]):
        self.config = AppConfig.model_validate(args)
        start_publishing()  # this replica's metrics on every replica's GET /metrics
        InferenceServicer.__init__(self, LocalBackend.from_config(self.config), self.config.resolved_api_keys(),
                                   self.config.request_timeout_s, RequestLimits.from_config(self.config),
                                   self.config.trace_requests)

    def __serve_build_asgi_app__(self):
        return create_openai_app(self.backend, self.config.resolved_api_keys(), self.config.request_timeout_s,
                                 RequestLimits.from_config(self.config), self.config.trace_requests,
                                 self.config.sse_keepalive_s, self.config.tool_call_parser)

    async def engine_stats(self) -> dict:
        """KV blocks, running/waiting counts, prefix-cache hits of this replica (via a handle)."""
        return await self.backend.stats()

    async def check_health(self) -> None:
        """Serve restarts a replica whose engine has failed."""
        if not await self.backend.ready():
            raise RuntimeError("the engine of this replica has stopped")


def gpus_per_replica(config: AppConfig) -> float:
    """GPUs a replica that runs its one rank in-process takes."""
    if config.device == "cpu":
        return 0
    if config.device == "cuda":
        return 1
    # "auto": use a GPU when the cluster has any (the head node building the app may have none itself).
    return 1 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else 0


def in_process_rank_options(config: AppConfig, pool: str) -> dict | None:
    """Actor options of a replica of `pool` whose engine runs its one rank in the replica's own process
    (the uni executor): it then takes that rank's devices and custom resources. None where the ranks
    are Ray actors of their own, which take them (cluster/placement.py)."""
    args = config.engine_args(pool)
    if args.parallel_config().world_size != 1 or args.distributed_executor_backend == "ray":
        return None
    return {"num_gpus": gpus_per_replica(config) * args.gpus_per_rank, "resources": dict(args.rank_resources)}


def build_colocated_app(config: AppConfig) -> Application:
    deployment = serve.deployment(ColocatedServer, name="TandemColocated").options(
        max_ongoing_requests=config.max_ongoing_requests("decode"),
        ray_actor_options=in_process_rank_options(config, "decode") or {"num_gpus": 0, "resources": {}},
        **config.decode.serve_options(), **config.backpressure_options("decode"),
    )
    return deployment.bind(config.to_args())
