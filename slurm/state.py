"""Slurm job state: parse `sacct`/`squeue` output into outcomes, and poll it asynchronously.

The parsing functions are pure (text in, `JobState` out) so they are tested without a
cluster. `SlurmStatePoller` is plain asyncio with no Airflow import: an Airflow trigger's
`run()` can `await poller.wait()` or iterate `poller.changes()` and yield its events, and
the poller's constructor arguments are plain values that a trigger can serialize.

`sacct` (accounting) is asked first because it remembers finished jobs; when it fails
(no slurmdbd) `squeue` is used, which only knows jobs that are queued, running or just
finished (MinJobAge).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    REQUEUED = "requeued"
    DONE = "done"
    FAILED = "failed"
    TIMEOUT = "timeout"
    PREEMPTED = "preempted"
    NODE_FAIL = "node_fail"
    CANCELLED = "cancelled"
    OOM = "oom"
    UNKNOWN = "unknown"  # not (yet) known to Slurm, e.g. sacct lags the submission

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({Outcome.DONE, Outcome.FAILED, Outcome.TIMEOUT, Outcome.PREEMPTED,
                      Outcome.NODE_FAIL, Outcome.CANCELLED, Outcome.OOM})

# Slurm 22.05 job states (long names, as sacct and `squeue -o %T` print them).
# A requeued job passes through REQUEUED back to PENDING: not terminal. PREEMPTED is
# terminal: with PreemptMode=REQUEUE Slurm shows REQUEUED instead.
SLURM_STATES: dict[str, Outcome] = {
    "PENDING": Outcome.PENDING,
    "CONFIGURING": Outcome.PENDING,
    "REQUEUE_HOLD": Outcome.REQUEUED,
    "REQUEUE_FED": Outcome.REQUEUED,
    "REQUEUED": Outcome.REQUEUED,
    "RUNNING": Outcome.RUNNING,
    "COMPLETING": Outcome.RUNNING,
    "RESIZING": Outcome.RUNNING,
    "SIGNALING": Outcome.RUNNING,
    "STAGE_OUT": Outcome.RUNNING,
    "SUSPENDED": Outcome.RUNNING,
    "STOPPED": Outcome.RUNNING,
    "COMPLETED": Outcome.DONE,
    "FAILED": Outcome.FAILED,
    "BOOT_FAIL": Outcome.FAILED,
    "SPECIAL_EXIT": Outcome.FAILED,
    "TIMEOUT": Outcome.TIMEOUT,
    "DEADLINE": Outcome.TIMEOUT,
    "PREEMPTED": Outcome.PREEMPTED,
    "NODE_FAIL": Outcome.NODE_FAIL,
    "CANCELLED": Outcome.CANCELLED,
    "REVOKED": Outcome.CANCELLED,
    "OUT_OF_MEMORY": Outcome.OOM,
}

SACCT_FIELDS = ("JobIDRaw", "State", "ExitCode", "NodeList")


@dataclass(frozen=True)
class JobState:
    job_id: str
    outcome: Outcome
    slurm_state: str = ""  # as Slurm printed it, e.g. "CANCELLED by 0"
    exit_code: str = ""  # "code:signal" from sacct; empty from squeue
    nodes: str = ""  # Slurm's compressed node list, e.g. "n[1-2]"


def outcome_of(slurm_state: str) -> Outcome:
    """Map one Slurm state string ("CANCELLED by 1000", "RUNNING", "CANCELLED+") to an outcome."""
    words = slurm_state.strip().split()
    if not words:
        return Outcome.UNKNOWN
    # sacct truncates long states with "+" in fixed-width output; parsable output has none.
    return SLURM_STATES.get(words[0].rstrip("+"), Outcome.UNKNOWN)


def sacct_command(job_ids: Sequence[str]) -> list[str]:
    # -D (duplicates) is left out: for a requeued job sacct then shows its latest run.
    return ["sacct", "--noheader", "--parsable2", "--format", ",".join(SACCT_FIELDS),
            "--jobs", ",".join(job_ids)]


def squeue_command(job_ids: Sequence[str]) -> list[str]:
    return ["squeue", "--noheader", "--states=all", "--format=%i|%T|%N", "--jobs", ",".join(job_ids)]


def parse_sacct(text: str) -> dict[str, JobState]:
    """Parse `sacct --noheader --parsable2 --format JobIDRaw,State,ExitCode,NodeList`.

    Lines of job steps (`12.batch`, `12.0`) only refine their job: a job whose step ran out
    of memory is `oom` even where the job line itself says FAILED.
    """
    jobs: dict[str, JobState] = {}
    oom_jobs: set[str] = set()
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) < len(SACCT_FIELDS):
            continue
        job_id, state, exit_code, nodes = (f.strip() for f in fields[:4])
        main_id, _, step = job_id.partition(".")
        if step:
            if outcome_of(state) is Outcome.OOM:
                oom_jobs.add(main_id)
            continue
        jobs[job_id] = JobState(job_id, outcome_of(state), state, exit_code, nodes)
    for job_id in oom_jobs & jobs.keys():
        if jobs[job_id].outcome is Outcome.FAILED:
            old = jobs[job_id]
            jobs[job_id] = JobState(job_id, Outcome.OOM, old.slurm_state, old.exit_code, old.nodes)
    return jobs


def parse_squeue(text: str) -> dict[str, JobState]:
    """Parse `squeue --noheader --format=%i|%T|%N`."""
    jobs: dict[str, JobState] = {}
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) < 3:
            continue
        job_id, state, nodes = (f.strip() for f in fields[:3])
        jobs[job_id] = JobState(job_id, outcome_of(state), state, "", nodes)
    return jobs


# (argv) -> (returncode, stdout). Injected so tests and other event loops can replace it.
CommandRunner = Callable[[list[str]], Awaitable[tuple[int, str]]]


async def run_command(argv: list[str], timeout_s: float = 30.0) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, ""
    return proc.returncode or 0, out.decode(errors="replace")


def merge_states(job_ids: Sequence[str], sacct: dict[str, JobState],
                 squeue: dict[str, JobState]) -> dict[str, JobState]:
    """sacct's answer where it has one, else squeue's, else `unknown`."""
    merged = {**{k: v for k, v in squeue.items() if k in job_ids}, **sacct}
    return {j: merged.get(j, JobState(j, Outcome.UNKNOWN)) for j in job_ids}


async def query_states(job_ids: Sequence[str], runner: CommandRunner = run_command) -> dict[str, JobState]:
    """Current state of each job; a job neither command knows is `unknown`."""
    rc, out = await runner(sacct_command(job_ids))
    sacct = parse_sacct(out) if rc == 0 else {}
    missing = [j for j in job_ids if j not in sacct]
    # squeue exits non-zero for ids it has forgotten; what it printed still counts.
    squeue = parse_squeue((await runner(squeue_command(missing)))[1]) if missing else {}
    return merge_states(job_ids, sacct, squeue)


def query_states_blocking(job_ids: Sequence[str], timeout_s: float = 30.0) -> dict[str, JobState]:
    """`query_states` for synchronous callers (an event loop may already be running there)."""
    def run(argv: list[str]) -> tuple[int, str]:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return 124, ""
        return done.returncode, done.stdout

    rc, out = run(sacct_command(job_ids))
    sacct = parse_sacct(out) if rc == 0 else {}
    missing = [j for j in job_ids if j not in sacct]
    squeue = parse_squeue(run(squeue_command(missing))[1]) if missing else {}
    return merge_states(job_ids, sacct, squeue)


class SlurmStatePoller:
    """Polls one Slurm job until it reaches a terminal outcome.

    Args are plain values (job id, seconds) so an Airflow trigger can serialize them.
    """

    def __init__(self, job_id: str, interval_s: float = 2.0, timeout_s: float | None = None,
                 runner: CommandRunner = run_command) -> None:
        self.job_id = job_id
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._runner = runner

    async def poll(self) -> JobState:
        return (await query_states([self.job_id], self._runner))[self.job_id]

    async def changes(self) -> AsyncIterator[JobState]:
        """Yield the job's state each time its outcome changes; stop after a terminal one.

        Raises TimeoutError after `timeout_s` without a terminal outcome.
        """
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        last: Outcome | None = None
        while True:
            state = await self.poll()
            if state.outcome is not last:
                last = state.outcome
                yield state
            if state.outcome.terminal:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"Slurm job {self.job_id} still {state.outcome.value} "
                                   f"after {self.timeout_s}s; check `squeue -j {self.job_id}`")
            await asyncio.sleep(self.interval_s)

    async def wait(self) -> JobState:
        states = [state async for state in self.changes()]
        return states[-1]
