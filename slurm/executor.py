"""The one interface through which every block stage reaches compute.

    executor = SlurmExecutor(folder, SlurmOptions(partition="gpu"))   # or LocalExecutor(folder)
    job = executor.submit(train_stage, campaign_url, block, resources=Resources(gpus_per_node=8))
    job.job_id; job.state(); job.wait(); job.result(); job.cancel(); job.stdout_path

A task is a picklable Python callable with its arguments, or a command (a list of
strings). Callables are pickled with cloudpickle into the executor's folder and run by
`python -m submitit.core._submit` there, both on Slurm and locally, so a stage behaves the
same under both. A task that must survive preemption or a timeout is a
`CheckpointableStage` (see checkpointable.py): it is requeued and called again. A command
always is: the command runs again from its start, so it must be idempotent (every
`python -m milepost.tasks.stage` command is: it resumes from the campaign store).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import submitit

from milepost.slurm.options import Resources
from milepost.slurm.state import JobState, Outcome

Task = Callable[..., Any] | Sequence[str]


class JobError(RuntimeError):
    """A job ended without a result (failed, cancelled, timed out, …)."""

    def __init__(self, state: JobState, message: str) -> None:
        super().__init__(message)
        self.state = state


@runtime_checkable
class JobHandle(Protocol):
    """A submitted job; `job_id` is what a stage records (Slurm id, or local pid)."""

    @property
    def job_id(self) -> str: ...

    @property
    def stdout_path(self) -> Path: ...

    @property
    def stderr_path(self) -> Path: ...

    def state(self) -> JobState: ...

    def wait(self, timeout_s: float | None = None, interval_s: float = 0.5) -> JobState: ...

    def result(self, timeout_s: float | None = None) -> Any: ...

    def cancel(self) -> None: ...


@runtime_checkable
class Executor(Protocol):
    name: str

    def submit(self, task: Task, *args: Any, resources: Resources | None = None,
               name: str | None = None, **kwargs: Any) -> JobHandle: ...


def as_function(task: Task, args: tuple[Any, ...]) -> Callable[..., Any]:
    """The callable to pickle: the task itself, or a command wrapped to run as a subprocess."""
    if callable(task):
        return task
    if isinstance(task, (list, tuple)) and task and all(isinstance(a, str) for a in task):
        if args:
            raise ValueError(f"a command task takes no extra arguments; put them in the list: {list(task)}")
        from milepost.slurm.checkpointable import requeueable
        # Returns the command's stdout; raises (job failed) on a non-zero exit status. verbose:
        # the command's stdout/stderr are also copied, as they come, into the job's own log
        # files (its stdout/stderr), which the task logs point to; without it they were kept
        # in memory only and dropped when the command succeeded (0-byte `*_log.err`).
        return requeueable(submitit.helpers.CommandFunction(list(task), verbose=True))
    raise TypeError(f"a task is a callable or a non-empty list of strings (a command); got {task!r}")


def default_job_name(task: Task) -> str:
    if callable(task):
        return getattr(task, "__name__", type(task).__name__)
    return Path(task[0]).name if task else "command"


def wait_until_terminal(poll: Callable[[], JobState], timeout_s: float | None,
                        interval_s: float) -> JobState:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        state = poll()
        if state.outcome.terminal:
            return state
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {state.job_id} still {state.outcome.value} after {timeout_s}s")
        time.sleep(interval_s)


class SubmititJobHandle:
    """Shared by both executors: they differ only in how the job's state is read."""

    def __init__(self, job: submitit.Job) -> None:
        self._job = job

    @property
    def job_id(self) -> str:
        return str(self._job.job_id)

    @property
    def stdout_path(self) -> Path:
        return Path(self._job.paths.stdout)

    @property
    def stderr_path(self) -> Path:
        return Path(self._job.paths.stderr)

    @property
    def submitit_job(self) -> submitit.Job:
        """For tests and tools (e.g. `_interrupt()` to simulate preemption)."""
        return self._job

    def state(self) -> JobState:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError

    def wait(self, timeout_s: float | None = None, interval_s: float = 0.5) -> JobState:
        return wait_until_terminal(self.state, timeout_s, interval_s)

    def result(self, timeout_s: float | None = None) -> Any:
        """The task's return value (task 0's for a multi-task job); raises JobError otherwise."""
        state = self.wait(timeout_s)
        job = self._job._sub_jobs[0] if self._job._sub_jobs else self._job
        if state.outcome is Outcome.DONE:
            return job.result()
        if job.paths.result_pickle.exists():
            error = job.exception()  # the task raised: its traceback is in the pickle
            raise JobError(state, f"job {self.job_id} {state.outcome.value}: {error}") from error
        raise JobError(state, f"job {self.job_id} ended {state.outcome.value} "
                              f"({state.slurm_state or 'no Slurm state'}) without a result; "
                              f"see {self.stderr_path}")

    def results(self, timeout_s: float | None = None) -> list[Any]:
        """Every task's return value, in rank order (nodes × tasks_per_node of them)."""
        state = self.wait(timeout_s)
        if state.outcome is not Outcome.DONE:
            self.result()  # raises the JobError with the reason
        return self._job.results()
