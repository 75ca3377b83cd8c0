"""A stage job's own output lands in the job's log files, which the Airflow task log points to:
on success too (it used to be captured in memory and dropped, leaving a 0-byte `*_log.err`)."""

from __future__ import annotations

from milepost.slurm.local import LocalExecutor


def test_a_successful_commands_output_is_in_the_jobs_log_files(tmp_path) -> None:
    executor = LocalExecutor(tmp_path)
    job = executor.submit(["bash", "-c", "echo 'step 1: reward 0.5'; echo 'block 0 train done' >&2"])
    assert job.result(timeout_s=60) == "step 1: reward 0.5"  # the command's stdout is still its result
    assert "block 0 train done" in job.stderr_path.read_text()
    assert "step 1: reward 0.5" in job.stdout_path.read_text()


def test_a_failing_commands_error_is_in_the_jobs_error_log(tmp_path) -> None:
    executor = LocalExecutor(tmp_path)
    job = executor.submit(["bash", "-c", "echo 'RuntimeError: the disk went away' >&2; exit 3"])
    job.wait(timeout_s=60)
    assert job.stderr_path.read_text().count("RuntimeError: the disk went away") >= 1
