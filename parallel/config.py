"""The shape of one replica's rank grid. Lives here so `parallel/` depends on nothing in `workers/`."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StrictModel(BaseModel):
    """Every config model: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ParallelConfig(StrictModel):
    """world_size = pp * sp * tp. Experts are spread (EP) over the TP x SP ranks of a pipeline stage.

    EP adds no ranks: expert_parallel_size is 1 or tp * sp. Given alone, expert_parallel_size=N means
    tensor_parallel_size=N (attention tensor-parallel over the N ranks, whole experts spread over them).
    """

    tensor_parallel_size: int = Field(default=1, ge=1, description="Ranks each layer's weights are split over "
                                      "(attention heads, MLP columns/rows).")
    pipeline_parallel_size: int = Field(default=1, ge=1, description="Stages the layers are split into, one "
                                        "group of ranks each.")
    sequence_parallel_size: int = Field(default=1, ge=1, description="Ranks a long prompt's tokens are split "
                                        "over (ring or Ulysses attention); prefill pools and colocated replicas.")
    sequence_parallel_attention: Literal["auto", "ring", "ulysses"] = Field(
        default="auto", description="SP prefill attention: ring (K/V blocks travel the ring, overlapped with "
        "compute), ulysses (all-to-all to head shards, full attention per head slice; needs the rank's query and "
        "KV heads divisible by the SP size) or auto (the ring: faster than Ulysses at every length measured, "
        "docs/benchmarks.md).")
    expert_parallel_size: int = Field(default=1, ge=1, description="MoE: ranks the experts are spread over: 1, "
                                      "or all the TP x SP ranks of a stage (alone, it sets the TP size too).")
    disable_p2p_all_reduce: bool = Field(default=False, description="CUDA, TP: sum tensor-parallel partial results "
                                         "with NCCL only, not the one-shot and two-shot all-reduces over NVLink P2P "
                                         "(parallel/p2p_allreduce.py) that otherwise take messages up to 32 MiB at "
                                         "TP=2, nor batch-1 decode's partial sums pushed over NVLink.")
    distributed_executor_backend: Literal["auto", "ray", "uni"] = Field(
        default="auto", description="auto: in-process (uni) for one rank, Ray actors for more. Served: the prefill "
        "pool always uses ray, a disaggregated decode pool on GPUs does at auto, a colocated replica does not.")
    gpus_per_rank: float = Field(
        default=1.0, gt=0.0, le=1.0, description="Ray GPUs each rank takes: below 1, pools share GPUs (e.g. an SP=2 "
        "prefill pool at 0.75 and a TP=1 decode pool at 0.25 on two GPUs). Ray packs fractional GPUs, so a replica of "
        "several ranks needs more than 0.5, which keeps its ranks on distinct GPUs; set each pool's "
        "gpu_memory_utilization so the sharers' shares fit.")
    rank_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources every rank also takes besides its GPU, e.g. "
        '{"tandem_decode_gpu": 1} keeps a pool on the node group that provides them.')

    @field_validator("rank_resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: n for k, n in v.items() if n <= 0 or k in ("CPU", "GPU", "memory")}
        if bad:
            raise ValueError(f"rank_resources must be positive custom resources (not CPU/GPU/memory): {bad}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _ep_alone_implies_tp(cls, data: Any) -> Any:
        if isinstance(data, dict) and (data.get("expert_parallel_size") or 1) > 1 \
                and data.get("tensor_parallel_size") is None and data.get("sequence_parallel_size") is None:
            data = {**data, "tensor_parallel_size": data["expert_parallel_size"]}
        return data

    @model_validator(mode="after")
    def _ep_spans_a_stage(self) -> "ParallelConfig":
        ep, stage = self.expert_parallel_size, self.tensor_parallel_size * self.sequence_parallel_size
        if ep not in (1, stage):
            raise ValueError(
                f"expert_parallel_size ({ep}) must be 1 or tensor_parallel_size * sequence_parallel_size ({stage}): "
                "experts are spread over all the ranks of a pipeline stage"
            )
        return self

    @model_validator(mode="after")
    def _ranks_on_distinct_gpus(self) -> "ParallelConfig":
        if self.world_size > 1 and self.gpus_per_rank <= 0.5:
            raise ValueError(
                f"gpus_per_rank={self.gpus_per_rank:g} with {self.world_size} ranks: Ray packs fractional GPUs, so two "
                "ranks of the replica could land on one GPU; use more than 0.5 per rank when a replica has several ranks")
        return self

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.sequence_parallel_size * self.tensor_parallel_size
