"""SlurmExecutor against the real dev cluster (2 virtual nodes): `bash slurm/devcluster.sh up`.

One cluster for the whole session; the tests fail (not skip) when it is not running.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from milepost.slurm.checkpointable import CheckpointableStage, restart_count
from milepost.slurm.executor import Executor, JobError
from milepost.slurm.options import Resources, SlurmOptions
from milepost.slurm.slurm_executor import SlurmExecutor, SlurmJobHandle
from milepost.slurm.state import Outcome, SlurmStatePoller

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GUARD_S = 180  # a guard against hanging forever, not a timing assertion


@pytest.fixture(scope="module")
def executor(dev_cluster, tmp_path_factory) -> SlurmExecutor:
    return SlurmExecutor(tmp_path_factory.mktemp("submitit"), SlurmOptions(time_min=10, mem_gb=1))


def where_am_i(tag: str) -> dict:
    return {"tag": tag, "node": os.environ["SLURMD_NODENAME"], "job": os.environ["SLURM_JOB_ID"]}


def fail(message: str) -> None:
    raise ValueError(message)


def wait_for_file(path: Path, job: SlurmJobHandle) -> None:
    deadline = time.monotonic() + GUARD_S
    while not path.exists():
        state = job.state()
        assert not state.outcome.terminal, f"job ended {state}: {job.stderr_path.read_text()}"
        assert time.monotonic() < deadline, f"{path} never appeared; job {state}"
        time.sleep(0.2)


def sacct_rows(job_id: str, *flags: str) -> list[list[str]]:
    out = subprocess.run(["sacct", "-n", "-P", "-o", "JobIDRaw,State,JobName,NNodes", "-j", job_id, *flags],
                         capture_output=True, text=True, check=True).stdout
    return [line.split("|") for line in out.splitlines()]


def sacct_eventually(job_id: str, row: list[str], *flags: str) -> list[list[str]]:
    """Accounting is written asynchronously: wait until sacct lists `row` (its first fields)."""
    deadline = time.monotonic() + GUARD_S
    while True:
        rows = sacct_rows(job_id, *flags)
        if row in [r[:len(row)] for r in rows]:
            return rows
        assert time.monotonic() < deadline, f"sacct never listed {row}: {rows}"
        time.sleep(0.5)


def test_callable_returns_its_result_and_sacct_shows_the_job(executor):
    assert isinstance(executor, Executor)
    job = executor.submit(where_am_i, "hello", name="mp-hello")
    result = job.result(timeout_s=GUARD_S)
    assert result["tag"] == "hello" and result["job"] == job.job_id
    assert job.state().outcome is Outcome.DONE
    # As another process would, from the recorded folder and job id:
    assert SlurmExecutor.attach(str(executor.folder), job.job_id).result() == result
    sacct_eventually(job.job_id, [job.job_id, "COMPLETED", "mp-hello"], "-X")
    # The async poller (the Airflow trigger's core) reads the same state.
    assert asyncio.run(SlurmStatePoller(job.job_id, interval_s=0.5).wait()).outcome is Outcome.DONE


def test_command_returns_its_stdout(executor):
    assert executor.submit(["bash", "-c", "echo $SLURM_JOB_ID"]).result(timeout_s=GUARD_S).isdigit()


def test_failing_task_is_failed_with_its_error(executor):
    job = executor.submit(fail, "the reward file is missing")
    with pytest.raises(JobError, match="the reward file is missing") as err:
        job.result(timeout_s=GUARD_S)
    assert err.value.state.outcome is Outcome.FAILED


def sleep_until_removed(flag: str) -> None:
    Path(flag).touch()
    while Path(flag).exists():
        time.sleep(0.1)


def test_cancel_maps_to_cancelled(executor, tmp_path):
    flag = tmp_path / "running"
    job = executor.submit(sleep_until_removed, str(flag))
    wait_for_file(flag, job)
    job.cancel()
    state = job.wait(timeout_s=GUARD_S)
    assert state.outcome is Outcome.CANCELLED and state.slurm_state.startswith("CANCELLED")
    with pytest.raises(JobError, match="cancelled"):
        job.result()


def test_two_node_job_runs_on_both_nodes(executor):
    job = executor.submit(where_am_i, "spmd", resources=Resources(nodes=2))
    results = job.results(timeout_s=GUARD_S)
    assert sorted(r["node"] for r in results) == ["n1", "n2"]
    # submitit's `srun` step spans both nodes.
    sacct_eventually(job.job_id, [job.job_id + ".0", "COMPLETED", "python", "2"])


class ResumableCounter(CheckpointableStage):
    """Counts in a state file until released; a requeued run resumes from the file."""

    def __call__(self, state_file: str, release_file: str) -> dict:
        path = Path(state_file)
        state = json.loads(path.read_text()) if path.exists() else {"step": 0, "runs": []}
        state["runs"].append({"restart_count": restart_count(), "start_step": state["step"]})
        while True:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(path)
            if Path(release_file).exists():
                return state
            state["step"] += 1
            time.sleep(0.1)


def wait_for_runs(state_file: Path, num_runs: int, min_step: int, job: SlurmJobHandle) -> dict:
    deadline = time.monotonic() + GUARD_S
    while True:
        if state_file.exists():
            state = json.loads(state_file.read_text())
            if len(state["runs"]) >= num_runs and state["step"] >= min_step:
                return state
        assert not job.state().outcome.terminal, job.stderr_path.read_text()
        assert time.monotonic() < deadline, f"run {num_runs} never reached step {min_step}"
        time.sleep(0.2)


def test_preempted_checkpointable_stage_is_requeued_and_resumes(executor, tmp_path):
    state_file, release = tmp_path / "state.json", tmp_path / "release"
    job = executor.submit(ResumableCounter(), str(state_file), str(release))
    before = wait_for_runs(state_file, 1, 3, job)
    job.submitit_job._interrupt()  # what Slurm does on preemption: TERM, then USR2
    resumed = wait_for_runs(state_file, 2, before["step"] + 1, job)
    release.touch()
    result = job.result(timeout_s=GUARD_S)
    assert [run["restart_count"] for run in result["runs"]] == [0, 1]
    assert result["runs"][1]["start_step"] >= before["step"]  # resumed, not restarted
    assert result["step"] >= resumed["step"]
    rows = sacct_eventually(job.job_id, [job.job_id, "COMPLETED"], "-X", "--duplicates")
    assert [job.job_id, "REQUEUED"] in [row[:2] for row in rows]
