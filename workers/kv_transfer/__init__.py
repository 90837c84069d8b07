"""Moving a prompt's KV blocks from a prefill replica to a decode replica.

- `plan`: which prefill rank sends which layers x heads x blocks to which decode rank (resharding).
- `blocks`: gathering blocks into one contiguous buffer per message (a few layers), and scattering them back.
- `transport`: point-to-point groups between the two replicas' ranks (NCCL on GPU, gloo on CPU).
"""
from workers.kv_transfer.plan import RankShard, Transfer, plan_transfers

__all__ = ["RankShard", "Transfer", "plan_transfers"]
