"""Which executor drives an engine's ranks: in this process for one rank, Ray rank actors for more.

The choice lives in the engine layer because the Ray executor (cluster/) sits above the per-rank
code (workers/) that defines the Executor contract; workers never import cluster.
"""
from __future__ import annotations

from workers.config import EngineConfig
from workers.executor import Executor, UniprocExecutor


def make_executor(config: EngineConfig, hf_config, max_model_len: int, eos_token_ids: list[int],
                  show_progress: bool = True) -> Executor:
    """A single-process executor for one rank, Ray actors for more."""
    backend = config.parallel.distributed_executor_backend
    if backend == "uni" and config.parallel.world_size > 1:
        raise ValueError("distributed_executor_backend='uni' runs one rank; this layout needs 'ray'")
    if backend == "uni" or (backend == "auto" and config.parallel.world_size == 1):
        return UniprocExecutor(config, hf_config, max_model_len, eos_token_ids, show_progress)
    # Imported here so the single-process path never imports Ray.
    from cluster.ray_executor import RayExecutor

    return RayExecutor(config, hf_config, max_model_len, eos_token_ids, show_progress)
