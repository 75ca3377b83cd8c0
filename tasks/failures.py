"""Why a block failed, in one line, from its stage records: what `milepost run`, `milepost
status` and the Airflow task log show. Light imports only (the DAG's operator imports it).

A stage that raises records `state: failed` with `error` (the root error: `Type: message`),
`error_kind` (`user`: the input is wrong, retrying cannot help; `runtime`: anything else)
and `log` (its job's stderr). A stage killed from outside records nothing: its job's end
(the executor's state, Slurm's state and reason) is then the best account there is.
"""

from __future__ import annotations

from collections.abc import Callable

from milepost.core.records import Stage, StageRecord, StageState


def stage_failure(record: StageRecord | None, job_detail: str, stderr_path: str = "") -> str:
    """The root error the stage recorded, else what its job's end says, and the log to read."""
    cause = record.error if record and record.state is StageState.FAILED else None
    log_path = (record.log if record else None) or stderr_path or "the job folder under <campaign>/jobs"
    return f"{cause or job_detail} (stage log: {log_path})"


def is_user_error(record: StageRecord | None) -> bool:
    return record is not None and record.user_error


def block_failure(read_record: Callable[[Stage], StageRecord | None],
                  since: float = 0.0) -> tuple[Stage, StageRecord] | None:
    """The first stage of the block (teardown last) recorded `failed` at or after `since`."""
    for stage in Stage:
        record = read_record(stage)
        if record and record.state is StageState.FAILED and float(record.failed_at or 0.0) >= since:
            return stage, record
    return None
