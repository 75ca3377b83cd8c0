"""The `progress` task of a block: after evaluate, apply the campaign's regression gate and
start the next block (the DAG triggers its own next run; `max_active_runs=1` queues it until
this run's teardown is done), until `campaign.num_blocks`, a stop request or a regression.

The decision and the report are the block driver's (tasks/block_driver.finish_evaluate,
imported at run time), shared with the embedded runner of `milepost run`, which runs its
blocks one `dag.test()` after the other instead of triggering runs.

Its log ends with the block's summary table (`tasks.block_summary`), and the same table
becomes the DAG run's note (dags/run_note.py), which the Airflow UI shows on the run: steps,
held-out accuracy against the block before, reward, the gate's verdict, checkpoint, wall time,
the plot. The next block's run is named `block_<NNNNNN>__…` after its block.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator

from milepost.core.records import block_label
from milepost.dags.operators import embedded


def next_run_id(block: int, after_run_id: str) -> str:
    """Named after its block, and deterministic: a retried `progress` task finds the run it
    already triggered. The hash of the run before keeps two campaigns of one DAG apart
    without nesting run ids (`block_2__after__block_1__after__…`)."""
    import hashlib

    return f"{block_label(block)}__{hashlib.sha256(after_run_id.encode()).hexdigest()[:12]}"


def publish_note(context: Any, note: str, log: Any) -> None:
    """The note of this task's DAG run; under `dag.test()` the embedded driver sets it after
    the run (there is no API server to ask)."""
    if embedded():
        return
    from milepost.dags.run_note import set_run_note

    problem = set_run_note(context["dag"].dag_id, context["run_id"], note)
    if problem:
        log.warning("the DAG run's note was not set: %s", problem)


class ProgressOperator(BaseOperator):
    ui_color = "#e3f1df"

    def execute(self, context: Any) -> dict[str, Any]:
        from milepost.core.store import CampaignStore
        from milepost.tasks.block_driver import BlockDriver
        from milepost.tasks.progression import as_dict

        params = context["params"]
        url, block = str(params["campaign_url"]), int(params["block"])
        # evaluate wrote the block's report; a cleared evaluate task may not have
        decision, table = BlockDriver(CampaignStore(url)).finish_evaluate(block, rewrite=False)
        publish_note(context, table, self.log)
        self.log.info("block %d: %s (%s)\n%s", block, decision.action, decision.message, table)
        if decision.action == "next" and not embedded():
            from airflow.sdk.exceptions import DagRunTriggerException

            # Succeeds this task once the next run exists (the task runner creates it).
            raise DagRunTriggerException(
                trigger_dag_id=context["dag"].dag_id, dag_run_id=next_run_id(decision.next_block, context["run_id"]),
                conf={"campaign_url": url, "block": decision.next_block, "overrides": [], "resume": False},
                logical_date=None, run_after=None, reset_dag_run=False, skip_when_already_exists=True,
                wait_for_completion=False, allowed_states=["success"], failed_states=["failed"], poke_interval=60,
                deferrable=False, note=f"block {decision.next_block}, started by block {block}'s progress task")
        return as_dict(decision)
