"""Slurm state parsing and the async poller, without a cluster (fake command runner)."""

from __future__ import annotations

import asyncio

import pytest

from milepost.slurm.state import (
    JobState,
    Outcome,
    SlurmStatePoller,
    outcome_of,
    parse_sacct,
    parse_squeue,
    query_states,
)


@pytest.mark.parametrize("slurm_state, outcome", [
    ("COMPLETED", Outcome.DONE),
    ("FAILED", Outcome.FAILED),
    ("TIMEOUT", Outcome.TIMEOUT),
    ("PREEMPTED", Outcome.PREEMPTED),
    ("NODE_FAIL", Outcome.NODE_FAIL),
    ("CANCELLED", Outcome.CANCELLED),
    ("CANCELLED by 0", Outcome.CANCELLED),
    ("CANCELLED by 1000", Outcome.CANCELLED),
    ("CANCELLED+", Outcome.CANCELLED),
    ("OUT_OF_MEMORY", Outcome.OOM),
    ("REQUEUED", Outcome.REQUEUED),
    ("PENDING", Outcome.PENDING),
    ("RUNNING", Outcome.RUNNING),
    ("COMPLETING", Outcome.RUNNING),
    ("", Outcome.UNKNOWN),
    ("SOMETHING_NEW", Outcome.UNKNOWN),
])
def test_outcome_of_maps_every_slurm_state(slurm_state, outcome):
    assert outcome_of(slurm_state) is outcome


def test_terminal_outcomes_are_the_ended_ones():
    assert {o for o in Outcome if o.terminal} == {
        Outcome.DONE, Outcome.FAILED, Outcome.TIMEOUT, Outcome.PREEMPTED, Outcome.NODE_FAIL,
        Outcome.CANCELLED, Outcome.OOM}


def test_parse_sacct_reads_jobs_and_skips_steps():
    text = ("12|COMPLETED|0:0|n[1-2]\n12.batch|COMPLETED|0:0|n1\n12.0|COMPLETED|0:0|n[1-2]\n"
            "13|CANCELLED by 0|0:15|n1\n13.batch|CANCELLED|0:15|n1\n14|PENDING|0:0|None assigned\n")
    jobs = parse_sacct(text)
    assert jobs == {
        "12": JobState("12", Outcome.DONE, "COMPLETED", "0:0", "n[1-2]"),
        "13": JobState("13", Outcome.CANCELLED, "CANCELLED by 0", "0:15", "n1"),
        "14": JobState("14", Outcome.PENDING, "PENDING", "0:0", "None assigned"),
    }


def test_parse_sacct_job_failed_with_a_step_out_of_memory_is_oom():
    text = "20|FAILED|0:125|n1\n20.batch|OUT_OF_MEMORY|0:125|n1\n21|FAILED|1:0|n1\n21.0|FAILED|1:0|n1\n"
    jobs = parse_sacct(text)
    assert jobs["20"].outcome is Outcome.OOM
    assert jobs["21"].outcome is Outcome.FAILED


def test_parse_sacct_ignores_blank_and_short_lines():
    assert parse_sacct("\n\nsacct: error: something\n") == {}


def test_parse_squeue():
    jobs = parse_squeue("7|RUNNING|n1\n8|PENDING|\n")
    assert jobs["7"] == JobState("7", Outcome.RUNNING, "RUNNING", "", "n1")
    assert jobs["8"].outcome is Outcome.PENDING


class FakeSlurm:
    """Answers sacct/squeue from scripted outputs, one per call."""

    def __init__(self, sacct: list[tuple[int, str]], squeue: list[tuple[int, str]] = ()) -> None:
        self.sacct, self.squeue, self.calls = list(sacct), list(squeue), []

    async def __call__(self, argv: list[str]) -> tuple[int, str]:
        self.calls.append(argv[0])
        queue = self.sacct if argv[0] == "sacct" else self.squeue
        return queue.pop(0) if len(queue) > 1 else queue[0]


def test_query_falls_back_to_squeue_when_sacct_fails():
    fake = FakeSlurm(sacct=[(1, "")], squeue=[(0, "5|RUNNING|n2\n")])
    states = asyncio.run(query_states(["5", "6"], fake))
    assert states["5"].outcome is Outcome.RUNNING
    assert states["6"].outcome is Outcome.UNKNOWN
    assert fake.calls == ["sacct", "squeue"]


def test_query_does_not_ask_squeue_when_sacct_knows_every_job():
    fake = FakeSlurm(sacct=[(0, "5|RUNNING|0:0|n2\n")])
    asyncio.run(query_states(["5"], fake))
    assert fake.calls == ["sacct"]


def test_poller_yields_each_change_until_terminal():
    fake = FakeSlurm(sacct=[(0, ""), (0, "9|PENDING|0:0|\n"), (0, "9|PENDING|0:0|\n"),
                            (0, "9|RUNNING|0:0|n1\n"), (0, "9|REQUEUED|0:0|n1\n"),
                            (0, "9|RUNNING|0:0|n2\n"), (0, "9|COMPLETED|0:0|n2\n")],
                     squeue=[(1, "")])
    poller = SlurmStatePoller("9", interval_s=0, runner=fake)

    async def collect():
        return [s.outcome async for s in poller.changes()]

    assert asyncio.run(collect()) == [Outcome.UNKNOWN, Outcome.PENDING, Outcome.RUNNING,
                                      Outcome.REQUEUED, Outcome.RUNNING, Outcome.DONE]


def test_poller_wait_returns_the_terminal_state():
    fake = FakeSlurm(sacct=[(0, "3|RUNNING|0:0|n1\n"), (0, "3|CANCELLED by 0|0:15|n1\n")])
    state = asyncio.run(SlurmStatePoller("3", interval_s=0, runner=fake).wait())
    assert state.outcome is Outcome.CANCELLED and state.slurm_state == "CANCELLED by 0"


def test_poller_times_out_with_the_job_id_in_the_message():
    fake = FakeSlurm(sacct=[(0, "4|PENDING|0:0|\n")])
    poller = SlurmStatePoller("4", interval_s=0, timeout_s=0, runner=fake)
    with pytest.raises(TimeoutError, match="Slurm job 4 still pending"):
        asyncio.run(poller.wait())
