"""The campaign's vocabulary, each fact defined once: the block's stages (in order), a stage
record, where a block's files live, the campaign id, the environment variables that pass
between processes, and DAG ids.

Standard library only: the Airflow DAG files import it at parse time, the triggerer and the
`milepost run` process before any heavy module is loaded. Not Airflow-specific either: a DAG id
is a name derived from the recipe, nothing more.

Stages are named by what they do, and apart from the loop's phases (`rollout`, `train`,
`weight_sync` inside `run_steps`, which metric keys keep as prefixes):

    start_ray → start_engines → run_steps → publish → evaluate, then teardown whatever happened

A campaign started before these names (issue 19) stored `launch_ray`, `rollout`, `train` and
`sync` records; `parse_stage` reads those names as the new ones, and the store reads a
block's old-name record file when no new-name one exists yet (`legacy_stage_name`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from milepost.core.errors import UserError


# --- stages ---------------------------------------------------------------------------------
class Stage(StrEnum):
    """A block's stages, in the order they run (teardown last, whatever happened before it)."""

    START_RAY = "start_ray"          # the block's Ray cluster: a local head, or a Slurm allocation
    START_ENGINES = "start_engines"  # the rollout fleet (engines + router), health-checked; block 0: base eval
    RUN_STEPS = "run_steps"          # the RL loop for the block's steps (rollout, train, weight sync, checkpoints)
    PUBLISH = "publish"              # the block's final checkpoint exported (HF format), the fleet verified on it
    EVALUATE = "evaluate"            # held-out eval on the fleet; the regression gate follows
    TEARDOWN = "teardown"            # releases what the block's records say it owns


# The stages that do the block's work, in order; teardown runs after them whatever happened.
BLOCK_STAGES: tuple[Stage, ...] = tuple(s for s in Stage if s is not Stage.TEARDOWN)

# The names stages had before issue 19 renamed them: records of campaigns started earlier
# carry them. The one place an old name is translated.
_LEGACY_NAMES: Mapping[str, Stage] = {"launch_ray": Stage.START_RAY, "rollout": Stage.START_ENGINES,
                                      "train": Stage.RUN_STEPS, "sync": Stage.PUBLISH}


def parse_stage(name: str) -> Stage:
    """The stage called `name`, or called so before the rename. ValueError naming the stages."""
    if name in _LEGACY_NAMES:
        return _LEGACY_NAMES[name]
    try:
        return Stage(name)
    except ValueError:
        raise ValueError(f"unknown stage {name!r}; the stages are: {', '.join(Stage)}") from None


def legacy_stage_name(stage: Stage) -> str | None:
    """The name `stage` was stored under before the rename (None: it kept its name)."""
    return next((old for old, new in _LEGACY_NAMES.items() if new is stage), None)


# --- stage records ----------------------------------------------------------------------------
class StageState(StrEnum):
    RUNNING = "running"    # a process works on it (its pid / Slurm job id are in the record)
    DONE = "done"          # finished; its outputs stand, a rerun returns them
    FAILED = "failed"      # raised: `error`, `error_kind`, `log` say why
    ABORTED = "aborted"    # left running by a killed run and stopped by teardown
    RELEASED = "released"  # start_ray/start_engines once teardown released what they started


@dataclass(frozen=True)
class StageRecord:
    """`blocks/<N>/<stage>.json`. The fields every stage writes are typed; what a stage records
    of its own (a Ray address, engine URLs, steps, the eval) is in `outputs`, as stored."""

    state: StageState
    started_at: float | None = None
    finished_at: float | None = None
    failed_at: float | None = None
    error: str | None = None          # the root error on one line: `Type: message`
    error_kind: str | None = None     # "user" (the input is wrong: no retry helps) | "runtime"
    log: str | None = None            # the stage job's stderr file
    pid: int | None = None
    pid_created_at: float | None = None
    host: str | None = None
    slurm_job_id: str | None = None
    outputs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> StageRecord:
        """The stored form read back; ValueError when it names no known state."""
        state = doc.get("state")
        if state not in tuple(StageState):
            raise ValueError(f"a stage record's state must be one of {', '.join(StageState)}, got {state!r}; "
                             "the file was not written by milepost: remove it to let the stage run again")
        typed = {f.name for f in fields(cls)} - {"outputs"}
        return cls(**{k: v for k, v in doc.items() if k in typed and k != "state"}, state=StageState(state),
                   outputs={k: v for k, v in doc.items() if k not in typed})

    def to_dict(self) -> dict[str, Any]:
        """The stored form (typed fields that are None are left out)."""
        typed = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "outputs"}
        return {**self.outputs, **{k: v for k, v in typed.items() if v is not None}, "state": str(self.state)}

    def merged(self, **changes: Any) -> StageRecord:
        """This record with `changes` (typed fields or outputs) written over it."""
        return StageRecord.from_dict({**self.to_dict(), **changes})

    @property
    def done(self) -> bool:
        return self.state is StageState.DONE

    @property
    def user_error(self) -> bool:
        """Failed on the user's input: a retry would fail the same way."""
        return self.state is StageState.FAILED and self.error_kind == "user"

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return float(self.finished_at) - float(self.started_at)


# --- where things are in the store --------------------------------------------------------------
RECIPE_DOC = "campaign.yaml"  # the resolved recipe, written once by the first run
TIMINGS_DOC = "timings.json"  # per block: each stage's submission, start, end, return (driver side)
GATE_DOC = "gate.json"        # per block: the regression gate's verdict
# Per block: when each try of run_steps began and from which committed step (a plot marks
# restarts). Its name predates the stage rename and stays: campaigns hold it.
STEPS_STARTS_DOC = "train_starts.json"


def block_label(block: int) -> str:
    """`block_000003`: how a block names its folder's siblings (its log, its DAG runs)."""
    return f"block_{block:06d}"


def block_path(block: int, *parts: str) -> str:
    """`blocks/000003/<parts>`, relative to the campaign's root."""
    return "/".join(["blocks", f"{block:06d}", *parts])


def stage_record_path(block: int, stage: str) -> str:
    return block_path(block, f"{stage}.json")


def campaign_id(url: str) -> str:
    """The campaign's stable id: its store URL, or a local folder made absolute (workers,
    stage jobs and the triggerer do not share a working directory)."""
    return url if "://" in url else os.path.abspath(url)


def check_campaign_url(url: str) -> None:
    """Refuse a `--campaign` that names an existing file (a campaign is a folder or a store URL)."""
    if "://" not in url and os.path.exists(url) and not os.path.isdir(url):
        raise UserError(f"--campaign {url} is a file; a campaign is a folder (or a store URL): pass a new "
                        "folder name, or the folder of an existing campaign")


# --- between processes ----------------------------------------------------------------------------
# Set by `milepost run` for the DAG it runs in-process (embedded mode): local stage jobs die with
# that process (their `--driver-pid`), and the run writes under that process's lease.
EMBEDDED_DRIVER_PID_ENV = "MILEPOST_EMBEDDED_DRIVER_PID"
LEASE_OWNER_ENV = "MILEPOST_LEASE_OWNER"
# The DAG file's inputs: which recipes become DAGs, and where their campaigns live by default.
CAMPAIGNS_FILE_ENV = "MILEPOST_CAMPAIGNS_FILE"
CAMPAIGNS_ROOT_ENV = "MILEPOST_CAMPAIGNS_ROOT"


# --- DAG ids ---------------------------------------------------------------------------------------
def dag_id_for(campaign_name: str) -> str:
    """The DAG of a campaign: `milepost_<name>`, with what Airflow refuses in an id replaced."""
    return "milepost_" + re.sub(r"[^A-Za-z0-9_]+", "_", campaign_name).strip("_")
