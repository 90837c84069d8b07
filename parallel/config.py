"""The shape of one replica's rank grid. Lives here so `parallel/` depends on nothing in `workers/`."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ParallelConfig(BaseModel):
    """world_size = pp * sp * tp. Experts are spread (EP) over the TP x SP ranks of a pipeline stage."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    sequence_parallel_size: int = Field(default=1, ge=1)
    expert_parallel_size: int = Field(default=1, ge=1)

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.sequence_parallel_size * self.tensor_parallel_size
