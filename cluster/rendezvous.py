"""How a replica's ranks find each other: rank 0 picks a free port on its own node, the driver hands
(address, port) to every rank, and they all join one torch.distributed process group.

No fixed ports: two replicas (or two test runs) on one machine never collide.
"""
from __future__ import annotations

import datetime

import ray
import torch.distributed as dist


def node_address() -> str:
    """This node's IP as Ray knows it (reachable from the other nodes of the cluster)."""
    return ray.util.get_node_ip_address()


def join_process_group(address: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    dist.init_process_group(backend=backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
