"""The deferrable wait on one stage job: no Airflow worker slot is held while a stage runs.

`StageJobTrigger` runs in the triggerer (one asyncio loop shared by many triggers), so it
never blocks: Slurm state comes from `slurm.state.SlurmStatePoller` (asyncio subprocesses of
sacct/squeue) and store reads go through `asyncio.to_thread`.

How a job is known to have ended:
- slurm: sacct/squeue says the job reached a terminal state; the stage's record in the
  store then says whether the stage finished (`done`) or not.
- local: the job id is the pid of submitit's local controller, and a local handle cannot be
  re-attached from another process. The trigger therefore watches the store and the pid:
  the stage's record `done` (written after the submission) means success; the controller gone
  (or its pid reused: the creation time differs) without a `done` record means failure.
  Only meaningful where the triggerer runs on the machine that ran the job (embedded mode).

Its serialized kwargs are identifiers and numbers only, so a triggerer restart resumes the
wait from the same point.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from milepost.core.records import StageRecord

# Clock slack between the worker that submitted a job and the process that recorded its end.
_CLOCK_SLACK_S = 2.0
# How often a waiting trigger renews its run's lease (the lease lasts tasks.lease.DEFAULT_TTL_S).
_LEASE_RENEW_S = 60.0


def iso_time(epoch_s: float) -> str:
    """A timestamp as a person and `epoch_of` read it: `2026-12-04T12:31:29.673+00:00`."""
    import datetime as dt

    return dt.datetime.fromtimestamp(epoch_s, dt.UTC).isoformat(timespec="milliseconds")


def epoch_of(value: float | str) -> float:
    """The inverse of `iso_time` (a number passes through: events of an older trigger)."""
    import datetime as dt

    return float(value) if isinstance(value, (int, float)) else dt.datetime.fromisoformat(value).timestamp()


class StageJobTrigger(BaseTrigger):
    """Waits until one stage job of one block ends; fires one event:
    `{"status": "done" | "failed", "job_id", "stage", "detail", …}`."""

    def __init__(self, campaign_url: str, block: int, stage: str, executor: str, job_id: str,
                 submitted_at: float, pid_created_at: float | None = None,
                 poll_interval_s: float = 5.0, lease_owner: str | None = None, stderr_path: str = "",
                 **kwargs: Any) -> None:
        kwargs.pop("min_wait_s", None)  # serialized by an older milepost (a floor since removed)
        super().__init__(**kwargs)
        if executor not in ("local", "slurm"):
            raise ValueError(f"executor must be `local` or `slurm`, got {executor!r}")
        self.campaign_url = campaign_url
        self.block = int(block)
        self.stage = stage
        self.executor = executor
        self.job_id = str(job_id)
        self.submitted_at = float(submitted_at)
        self.pid_created_at = pid_created_at
        self.poll_interval_s = float(poll_interval_s)
        self.lease_owner = lease_owner
        self.stderr_path = stderr_path  # echoed in the event: dag.test() drops the deferral's own kwargs
        self._renewed_at = time.monotonic()

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "campaign_url": self.campaign_url, "block": self.block, "stage": self.stage,
            "executor": self.executor, "job_id": self.job_id, "submitted_at": self.submitted_at,
            "pid_created_at": self.pid_created_at, "poll_interval_s": self.poll_interval_s,
            "lease_owner": self.lease_owner, "stderr_path": self.stderr_path})

    # --- the store (blocking: called through asyncio.to_thread) ------------------------------
    def _record(self) -> StageRecord | None:
        from milepost.core.store import CampaignStore  # fsspec only

        return CampaignStore(self.campaign_url).stage_record(self.block, self.stage)

    def _finished_now(self, record: StageRecord | None) -> bool:
        """Done by this submission (teardown reruns and rewrites an older `done`)."""
        return record is not None and record.done and float(record.finished_at or 0.0) >= \
            self.submitted_at - _CLOCK_SLACK_S

    def _event(self, status: str, detail: str, record: StageRecord | None, **extra: Any) -> TriggerEvent:
        return TriggerEvent({"status": status, "campaign_url": self.campaign_url, "block": self.block,
                             "stage": self.stage, "executor": self.executor, "job_id": self.job_id,
                             "record_state": record.state.value if record else None, "detail": detail,
                             # ISO 8601: Airflow logs the event into the task log ("Trigger fired event")
                             "submitted_at": iso_time(self.submitted_at), "stderr_path": self.stderr_path,
                             **extra})

    def _renew_lease(self) -> str | None:
        """Keep the run's campaign lease while its stage runs (a stage may run for hours); the
        reason when it was lost to another run."""
        if not self.lease_owner or time.monotonic() - self._renewed_at < _LEASE_RENEW_S:
            return None
        from milepost.core.store import CampaignStore
        from milepost.tasks.lease import LeaseHeldError, renew

        try:
            renew(CampaignStore(self.campaign_url), self.lease_owner)
        except LeaseHeldError as e:
            return str(e)
        self._renewed_at = time.monotonic()
        return None

    # --- waiting -------------------------------------------------------------------------
    def _controller_alive(self) -> bool:
        import psutil

        try:
            process = psutil.Process(int(self.job_id))
            if self.pid_created_at is not None and abs(process.create_time() - self.pid_created_at) > 0.05:
                return False  # the pid was reused by another process
            return process.status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, ValueError):
            return False

    async def _wait_local(self) -> TriggerEvent:
        while True:
            lost = await asyncio.to_thread(self._renew_lease)
            if lost:
                return self._event("failed", lost, None)
            record = await asyncio.to_thread(self._record)
            if self._finished_now(record):
                return self._event("done", "stage recorded done", record)
            if not await asyncio.to_thread(self._controller_alive):
                record = await asyncio.to_thread(self._record)  # it may have finished meanwhile
                if self._finished_now(record):
                    return self._event("done", "stage recorded done", record)
                return self._event("failed", f"local job {self.job_id} ended without recording the stage done "
                                             f"(record: {record.state if record else 'none'})", record)
            await asyncio.sleep(self.poll_interval_s)

    async def _wait_slurm(self) -> TriggerEvent:
        from milepost.slurm.state import Outcome, SlurmStatePoller

        waiting = asyncio.ensure_future(SlurmStatePoller(self.job_id, interval_s=self.poll_interval_s).wait())
        while not waiting.done():
            lost = await asyncio.to_thread(self._renew_lease)
            if lost:
                waiting.cancel()
                return self._event("failed", lost, None)
            await asyncio.wait({waiting}, timeout=max(self.poll_interval_s, 1.0))
        state = waiting.result()
        record = await asyncio.to_thread(self._record)
        extra = {"outcome": state.outcome.value, "slurm_state": state.slurm_state, "exit_code": state.exit_code}
        if state.outcome is Outcome.DONE and record is not None and record.done:
            return self._event("done", f"Slurm job {self.job_id} completed", record, **extra)
        exit_code = f", exit code:signal {state.exit_code}" if state.exit_code else ""
        return self._event("failed", f"Slurm job {self.job_id} ended {state.outcome.value} "
                                     f"({state.slurm_state or 'no Slurm state'}{exit_code}) on "
                                     f"{state.nodes or 'no node'}; stage record: "
                                     f"{record.state if record else 'none'}", record, **extra)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        started = time.monotonic()
        self.log.info("waiting for %s job %s (block %d, %s)", self.executor, self.job_id, self.block, self.stage)
        event = await (self._wait_slurm() if self.executor == "slurm" else self._wait_local())
        from milepost.tasks.block_summary import human_duration

        self.log.info("%s job %s (block %d, %s): %s after waiting %s; the stage's own output: %s", self.executor,
                      self.job_id, self.block, self.stage, event.payload["status"],
                      human_duration(time.monotonic() - started), self.stderr_path or "see its job folder")
        yield event
