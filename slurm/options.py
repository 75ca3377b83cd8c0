"""Typed sbatch options (the recipe's `cluster.slurm` section) and per-job resources.

`SlurmOptions` holds what a cluster site needs (partition, account, …) and the default
resources of a job; `Resources` overrides the resources of one submission. Both forbid
unknown keys. Free-form `extra` directives are checked against the sbatch options of
Slurm 22.05, so a typo fails at the door with the list of valid names.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from milepost.core.config import (  # noqa: F401 - re-exported: the recipe owns these
    EXTRA_DIRECTIVES,
    RESERVED_DIRECTIVES,
    TYPED_DIRECTIVES,
    DirectiveValue,
    SlurmOptions,
    check_directive_value,
)


class Resources(BaseModel):
    """Resources of one submission; None keeps the executor's default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int | None = Field(None, ge=1)
    tasks_per_node: int | None = Field(None, ge=1)
    cpus_per_task: int | None = Field(None, ge=1)
    gpus_per_node: int | None = Field(None, ge=0)
    mem_gb: float | None = Field(None, gt=0)
    time_min: int | None = Field(None, ge=1)
