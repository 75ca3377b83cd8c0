"""LocalExecutor: the embedded default. Each task is a local process tree started by
submitit's local controller (`python -m submitit.local._local`), which runs the pickled
task exactly as a Slurm job would, relays the preemption signal and restarts a
`CheckpointableStage` that asked to be requeued.

The job id is the controller's pid. Handles cannot be re-attached from another process:
the controller is a child of the submitting process, which is the only one that can
reap it and read its exit status.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, cast

import psutil
import submitit
from submitit.core.utils import pickle_load
from submitit.local.local import LocalJob

from milepost.slurm.executor import SubmititJobHandle, Task, as_function
from milepost.slurm.options import Resources
from milepost.slurm.state import JobState, Outcome

CANCEL_KILL_WAIT_S = 10.0  # Slurm's KillWait is 30 s; a local task has less to flush


class LocalJobHandle(SubmititJobHandle):
    def __init__(self, job: submitit.Job, time_limit_s: float) -> None:
        super().__init__(job)
        self._started = time.monotonic()
        self._time_limit_s = time_limit_s
        self._cancelled = False

    @property
    def _process(self) -> subprocess.Popen | None:
        """The controller process (a LocalExecutor's job is a LocalJob)."""
        return cast(LocalJob[Any], self._job)._process

    def state(self) -> JobState:
        process = self._process
        assert process is not None, "a local job handle only lives in the process that submitted it"
        if process.poll() is None:
            return JobState(self.job_id, Outcome.RUNNING, "RUNNING")
        return JobState(self.job_id, self._ended_outcome(), "", str(process.returncode))

    def _ended_outcome(self) -> Outcome:
        result = self._job.paths.result_pickle
        if result.exists():
            return Outcome.DONE if pickle_load(result)[0] == "success" else Outcome.FAILED
        if self._cancelled:
            return Outcome.CANCELLED
        # The controller stops the task at the time limit without writing a result.
        if time.monotonic() - self._started >= self._time_limit_s:
            return Outcome.TIMEOUT
        return Outcome.FAILED

    def cancel(self) -> None:
        # Recorded first: a cancelled task leaves no result, like a crashed one.
        self._cancelled = True
        self._job.cancel()  # SIGINT to the controller, which stops its tasks
        # As scancel does (SIGKILL after KillWait): a controller or task that outlives the
        # interrupt (busy, or a task that catches it) is killed, with every process it started.
        timer = threading.Timer(CANCEL_KILL_WAIT_S, self._kill_if_alive)
        timer.daemon = True
        timer.start()

    def _kill_if_alive(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        try:
            tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in tree:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def wait(self, timeout_s: float | None = None, interval_s: float = 0.1) -> JobState:
        return super().wait(timeout_s, interval_s)


def machine_gpu_view() -> dict[str, Any]:
    """submitit's parameters for a job that sees the GPUs this process sees. submitit's local
    executor sets a job's CUDA_VISIBLE_DEVICES to its `gpus_per_node` first devices, '' for
    none, and a stage that asked for none (the block's stages do not: they share the machine)
    then hid every GPU from the Ray head it started, so engines and ranks ran on the CPU
    (found on the lent H100, 2026-12-05). Integer device lists are passed as `visible_gpus`;
    any other form (GPU UUIDs, MIG) is exported as is by a setup line before the job."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return {"gpus_per_node": nvidia_smi_gpu_count()}
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if all(d.isdigit() for d in devices):
        return {"gpus_per_node": len(devices), "visible_gpus": tuple(int(d) for d in devices)}
    return {"gpus_per_node": 0, "setup": [f"export CUDA_VISIBLE_DEVICES={shlex.quote(visible)}"]}


@functools.cache
def nvidia_smi_gpu_count() -> int:
    """GPUs `nvidia-smi -L` lists; 0 without a driver. Asked once per process: the machine's
    GPUs do not change, and every local stage job's submission asks."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


class LocalExecutor:
    """Runs tasks as local processes, one machine, through the same interface as Slurm."""

    name = "local"

    def __init__(self, root: str | Path, default_time_min: int = 7 * 24 * 60,
                 max_num_requeues: int = 3) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.folder = Path(root).resolve() / f"{stamp}-{uuid.uuid4().hex[:8]}"
        self.folder.mkdir(parents=True)
        self.default_time_min = default_time_min
        self._executor = submitit.LocalExecutor(folder=self.folder / "%j", max_num_timeout=max_num_requeues)

    def submit(self, task: Task, *args: Any, resources: Resources | None = None,
               name: str | None = None, **kwargs: Any) -> LocalJobHandle:
        resources = resources or Resources()
        if (resources.nodes or 1) > 1:
            raise ValueError(f"the local executor runs on one machine; nodes={resources.nodes} "
                             "needs `cluster.executor: slurm`")
        fn = as_function(task, args)
        time_min = resources.time_min or self.default_time_min
        # `name` is Slurm's job name; local processes are found by the job id (pid).
        del name
        gpus = ({"gpus_per_node": resources.gpus_per_node} if resources.gpus_per_node is not None
                else machine_gpu_view())
        self._executor.update_parameters(
            timeout_min=time_min, tasks_per_node=resources.tasks_per_node or 1, **gpus)
        return LocalJobHandle(self._executor.submit(fn, *args, **kwargs), time_min * 60.0)
