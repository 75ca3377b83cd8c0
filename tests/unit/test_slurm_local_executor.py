"""LocalExecutor: the embedded default runs tasks as local processes, same interface as Slurm."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from milepost.slurm.checkpointable import requeueable
from milepost.slurm.executor import Executor, JobError, JobHandle
from milepost.slurm.local import LocalExecutor
from milepost.slurm.options import Resources
from milepost.slurm.state import Outcome

# Test modules are not importable in the job's process: ship their functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def add(a: int, b: int) -> dict:
    return {"sum": a + b, "pid": os.getpid()}


def fail(message: str) -> None:
    raise ValueError(message)


def sleep_until_removed(path: str) -> str:
    Path(path).touch()
    while Path(path).exists():
        time.sleep(0.05)
    return "released"


@pytest.fixture
def executor(tmp_path) -> LocalExecutor:
    return LocalExecutor(tmp_path)


def test_local_executor_implements_the_interface(executor):
    assert isinstance(executor, Executor)
    assert isinstance(executor.submit(add, 1, 2), JobHandle)


def test_callable_runs_in_another_process_and_returns_its_result(executor):
    job = executor.submit(add, 2, b=40)
    result = job.result(timeout_s=60)
    assert result["sum"] == 42 and result["pid"] != os.getpid()
    assert job.state().outcome is Outcome.DONE
    assert job.stdout_path.exists() and job.stdout_path.parent.parent == executor.folder


def test_requeueable_wrapper_runs_the_function(executor):
    assert executor.submit(requeueable(add), 1, 1).result(timeout_s=60)["sum"] == 2


def test_command_returns_its_stdout(executor):
    assert executor.submit(["echo", "hello world"]).result(timeout_s=60) == "hello world"


def test_failing_task_is_failed_with_its_traceback(executor):
    job = executor.submit(fail, "bad input 123")
    with pytest.raises(JobError, match="bad input 123") as err:
        job.result(timeout_s=60)
    assert err.value.state.outcome is Outcome.FAILED


def test_failing_command_is_failed(executor):
    job = executor.submit(["bash", "-c", "echo oops >&2; exit 3"])
    with pytest.raises(JobError):
        job.result(timeout_s=60)
    assert job.state().outcome is Outcome.FAILED


def test_cancel_stops_the_task_and_maps_to_cancelled(executor, tmp_path):
    flag = tmp_path / "running"
    job = executor.submit(sleep_until_removed, str(flag))
    while not flag.exists():
        assert not job.state().outcome.terminal, job.stderr_path.read_text()
        time.sleep(0.05)
    assert job.state().outcome is Outcome.RUNNING
    job.cancel()
    assert job.wait(timeout_s=60).outcome is Outcome.CANCELLED
    with pytest.raises(JobError, match="cancelled"):
        job.result()


def test_more_than_one_node_needs_slurm(executor):
    with pytest.raises(ValueError, match="cluster.executor: slurm"):
        executor.submit(add, 1, 2, resources=Resources(nodes=2))


def test_a_task_must_be_a_callable_or_a_command(executor):
    with pytest.raises(TypeError, match="callable or a non-empty list of strings"):
        executor.submit("echo hi")
    with pytest.raises(ValueError, match="no extra arguments"):
        executor.submit(["echo"], "hi")


def test_each_executor_gets_a_fresh_folder(tmp_path):
    assert LocalExecutor(tmp_path).folder != LocalExecutor(tmp_path).folder
