"""Moving a prompt's KV blocks from a prefill replica to a decode replica.

- `handoff`: the request metadata that travels with the KV (`KVHandoff`).
- `plan`: which prefill rank sends which layers x heads x blocks to which decode rank (resharding).
- `blocks`: gathering blocks into one contiguous buffer per transfer, and scattering them back.
- `transport`: point-to-point groups between the two replicas' ranks (NCCL on GPU, gloo on CPU).
"""
from workers.kv_transfer.handoff import KVHandoff
from workers.kv_transfer.plan import RankShard, Transfer, plan_transfers

__all__ = ["KVHandoff", "RankShard", "Transfer", "plan_transfers"]
