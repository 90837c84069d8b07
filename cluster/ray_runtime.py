"""Starting (or joining) Ray, and the environment every rank process gets."""
from __future__ import annotations

import logging
import os

import ray

# The rank processes must import this repository's packages wherever Ray starts them.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# NVLink multicast (NVLS) and symmetric-memory multicast hang or fail on some hosts; the ranks only
# need plain NCCL collectives and p2p. A value already set in the driver's environment wins.
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def ensure_ray(num_cpus: int) -> None:
    """Use the Ray this process is already connected to; else join $RAY_ADDRESS; else start a
    private local instance with at least `num_cpus` CPUs (no dashboard).

    A private instance (address="local") is deliberate: `ray.init()` alone would attach to any
    cluster someone else started on this machine.
    """
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return
    ray.init(address="local", num_cpus=max(num_cpus, os.cpu_count() or 1), include_dashboard=False,
             logging_level=logging.WARNING)


def rank_runtime_env() -> dict:
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = {k: os.environ.get(k, v) for k, v in _NCCL_ENV.items()}
    env["PYTHONPATH"] = pythonpath
    return {"env_vars": env}
