"""SlurmExecutor: every task is an sbatch job, submitted through submitit.

Each executor owns a fresh submitit folder (`<root>/<timestamp>-<random>/<job id>/`):
Slurm job ids restart at 1 when a cluster's state is wiped, and a reused `%j` folder
would hand back a stale result. The folder must be on a filesystem that every node sees.

State comes from `milepost.slurm.state` (sacct, then squeue), not from submitit's
watcher, which caches for up to a minute: one mapping of Slurm states to outcomes serves
the executor and the Airflow trigger alike.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import submitit

from milepost.slurm.executor import SubmititJobHandle, Task, as_function, default_job_name
from milepost.slurm.options import Resources, SlurmOptions
from milepost.slurm.state import JobState, query_states_blocking


def submitit_parameters(options: SlurmOptions, name: str) -> dict[str, Any]:
    """`submitit.SlurmExecutor.update_parameters` arguments for these options."""
    params: dict[str, Any] = {
        "job_name": name,
        "time": options.time_min,
        "nodes": options.nodes,
        "ntasks_per_node": options.tasks_per_node,
        # One pickled task per srun task; submitit relays preemption (USR2) to them.
        "use_srun": True,
        # submitit's default tags every job `--wckey=submitit`, which sites that
        # enforce wckeys reject; None leaves the directive out (`extra` may set one).
        "wckey": None,
    }
    optional = {"partition": options.partition, "account": options.account, "qos": options.qos,
                "constraint": options.constraint, "cpus_per_task": options.cpus_per_task,
                "mem": None if options.mem_gb is None else _mem(options.mem_gb),
                "gpus_per_node": options.gpus_per_node or None}
    params.update({k: v for k, v in optional.items() if v is not None})
    if options.extra:
        params["additional_parameters"] = dict(options.extra)
    return params


def _mem(mem_gb: float) -> str:
    return f"{int(mem_gb)}G" if mem_gb == int(mem_gb) else f"{int(mem_gb * 1024)}M"


class SlurmJobHandle(SubmititJobHandle):
    def state(self) -> JobState:
        return query_states_blocking([self.job_id])[self.job_id]

    def cancel(self) -> None:
        subprocess.run(["scancel", self.job_id], check=True, capture_output=True, timeout=60)


class SlurmExecutor:
    """Submits tasks as Slurm jobs; `options` are the defaults, `resources` override per job."""

    name = "slurm"

    def __init__(self, root: str | Path, options: SlurmOptions | None = None,
                 max_num_requeues: int = 3) -> None:
        if shutil.which("sbatch") is None or shutil.which("srun") is None:
            raise RuntimeError("the Slurm executor needs Slurm's commands (sbatch, srun) on PATH; "
                               "for a local dev cluster run `bash slurm/devcluster-install.sh && bash "
                               "slurm/devcluster.sh up`, or use `cluster.executor: local`")
        self.options = options or SlurmOptions()
        self.max_num_requeues = max_num_requeues
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.folder = Path(root).resolve() / f"{stamp}-{uuid.uuid4().hex[:8]}"
        self.folder.mkdir(parents=True)

    def submit(self, task: Task, *args: Any, resources: Resources | None = None,
               name: str | None = None, **kwargs: Any) -> SlurmJobHandle:
        options = self.options.with_resources(resources)
        fn = as_function(task, args)
        # A submitit executor per job (cheap): parameters differ per job, and submit
        # stays safe to call from several threads. All share this executor's folder.
        executor = submitit.SlurmExecutor(folder=self.folder / "%j", max_num_timeout=self.max_num_requeues)
        executor.update_parameters(**submitit_parameters(options, name or default_job_name(task)))
        return SlurmJobHandle(executor.submit(fn, *args, **kwargs))

    @staticmethod
    def attach(folder: str | Path, job_id: str) -> SlurmJobHandle:
        """A handle on a job submitted earlier, perhaps by another process: `folder` is the
        submitting executor's `folder` (record it next to the job id)."""
        return SlurmJobHandle(submitit.SlurmJob(folder=Path(folder) / "%j", job_id=job_id))
