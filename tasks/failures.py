"""Why a block failed, in one line, from its stage records: what `milepost run`, `milepost
status` and the Airflow task log show. Standard library only (imported by the DAG's operator).

A stage that raises records `state: failed` with `error` (the root error: `Type: message`),
`error_kind` (`user`: the input is wrong, retrying cannot help; `runtime`: anything else)
and `log` (its job's stderr). A stage killed from outside records nothing: its job's end
(the executor's state, Slurm's state and reason) is then the best account there is.
"""

from __future__ import annotations

from typing import Any, Callable

BLOCK_STAGES = ("launch_ray", "rollout", "train", "sync", "evaluate", "teardown")


def stage_failure(record: dict[str, Any], job_detail: str, stderr_path: str = "") -> str:
    """The root error the stage recorded, else what its job's end says, and the log to read."""
    cause = record.get("error") if record.get("state") == "failed" else None
    log_path = record.get("log") or stderr_path or "the job folder under <campaign>/jobs"
    return f"{cause or job_detail} (stage log: {log_path})"


def is_user_error(record: dict[str, Any]) -> bool:
    return record.get("state") == "failed" and record.get("error_kind") == "user"


def block_failure(read_record: Callable[[str], dict[str, Any] | None],
                  since: float = 0.0) -> tuple[str, dict[str, Any]] | None:
    """The first stage of the block recorded `failed` at or after `since`: (stage, record)."""
    for stage in BLOCK_STAGES:
        record = read_record(stage) or {}
        if record.get("state") == "failed" and float(record.get("failed_at") or 0.0) >= since:
            return stage, record
    return None
