"""Typed sbatch options (the recipe's `cluster.slurm` section) and per-job resources.

`SlurmOptions` holds what a cluster site needs (partition, account, …) and the default
resources of a job; `Resources` overrides the resources of one submission. Both forbid
unknown keys. Free-form `extra` directives are checked against the sbatch options of
Slurm 22.05, so a typo fails at the door with the list of valid names.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

# sbatch long options (Slurm 22.05) that may be passed through `extra`.
EXTRA_DIRECTIVES = frozenset("""
acctg-freq bb bbf begin chdir cluster-constraint clusters comment container contiguous
core-spec cores-per-socket cpu-freq cpus-per-gpu deadline delay-boot dependency
distribution exclude exclusive export export-file extra-node-info get-user-env gid gpu-bind
gpu-freq gpus gpus-per-socket gpus-per-task gres gres-flags hint hold ignore-pbs
kill-on-invalid-dep licenses mail-type mail-user mcs-label mem-bind mem-per-cpu mem-per-gpu
mincpus network nice no-kill no-requeue nodefile nodelist ntasks ntasks-per-core
ntasks-per-socket overcommit oversubscribe power prefer priority profile propagate reboot
requeue reservation sockets-per-node spread-job switches thread-spec threads-per-core
time-min tmp uid use-min-nodes wckey
""".split())

# Options with a typed field: `extra` may not set them a second way.
TYPED_DIRECTIVES = {
    "partition": "partition", "account": "account", "qos": "qos", "time": "time_min",
    "nodes": "nodes", "ntasks-per-node": "tasks_per_node", "gpus-per-node": "gpus_per_node",
    "cpus-per-task": "cpus_per_task", "mem": "mem_gb", "constraint": "constraint",
}
# Options the executors set themselves (log paths, job name, the preemption signal).
RESERVED_DIRECTIVES = frozenset({"output", "error", "job-name", "signal", "open-mode", "array",
                                 "input", "wrap", "parsable", "wait", "test-only"})

DirectiveValue = bool | int | float | str


def check_directive_value(name: str, value: object) -> None:
    """A value that would end the `#SBATCH` line early would inject shell code."""
    if isinstance(value, str) and any(c in value for c in "\n\r\0"):
        raise ValueError(f"sbatch option {name!r} contains a newline or NUL character: {value!r}")


class Resources(BaseModel):
    """Resources of one submission; None keeps the executor's default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int | None = Field(None, ge=1)
    tasks_per_node: int | None = Field(None, ge=1)
    cpus_per_task: int | None = Field(None, ge=1)
    gpus_per_node: int | None = Field(None, ge=0)
    mem_gb: float | None = Field(None, gt=0)
    time_min: int | None = Field(None, ge=1)


class SlurmOptions(BaseModel):
    """sbatch options for every job of a campaign (`cluster.slurm` in a recipe)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = Field(None, description="Node features, e.g. `h200&ib`.")
    time_min: int = Field(60, ge=1, description="Wall-clock limit of each job in minutes.")
    nodes: int = Field(1, ge=1)
    tasks_per_node: int = Field(1, ge=1)
    cpus_per_task: int | None = Field(None, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    mem_gb: float | None = Field(None, gt=0, description="Memory per node; None: the partition default.")
    extra: dict[str, DirectiveValue] = Field(
        default_factory=dict,
        description="Other sbatch long options without the leading `--`, e.g. "
                    "`{reservation: demo, exclusive: true}`.")

    @field_validator("partition", "account", "qos", "constraint")
    @classmethod
    def _one_line(cls, value: str | None, info) -> str | None:
        check_directive_value(info.field_name, value)
        return value

    @field_validator("extra")
    @classmethod
    def _known_directives(cls, extra: dict[str, DirectiveValue]) -> dict[str, DirectiveValue]:
        for name, value in extra.items():
            if name in TYPED_DIRECTIVES:
                raise ValueError(f"sbatch option {name!r} has its own field: set "
                                 f"`{TYPED_DIRECTIVES[name]}` instead of `extra.{name}`")
            if name in RESERVED_DIRECTIVES:
                raise ValueError(f"sbatch option {name!r} is set by milepost itself and cannot be overridden")
            if name not in EXTRA_DIRECTIVES:
                raise ValueError(f"unknown sbatch option {name!r} in `extra`; valid options: "
                                 f"{', '.join(sorted(EXTRA_DIRECTIVES))}")
            if value is False:
                raise ValueError(f"sbatch option {name!r}: false is not a value; leave the option out")
            check_directive_value(name, value)
        return extra

    def with_resources(self, resources: Resources | None) -> SlurmOptions:
        """These options with the resources that `resources` sets replacing the defaults."""
        if resources is None:
            return self
        return self.model_copy(update=resources.model_dump(exclude_none=True))
