"""The `progress` task of a block: after evaluate, apply the campaign's regression gate and
start the next block (the DAG triggers its own next run; `max_active_runs=1` queues it until
this run's teardown is done), until `campaign.num_blocks`, a stop request or a regression.

The decision itself is `milepost.tasks.progression.after_evaluate` (imported at run time),
shared with the embedded driver of `milepost run`, which runs its blocks one `dag.test()`
after the other instead of triggering runs.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator
from milepost.dags.operators import embedded


def next_run_id(block: int, after_run_id: str) -> str:
    """Deterministic: a retried `progress` task finds the run it already triggered."""
    return f"block_{block:06d}__after__{after_run_id}"[:250]


class ProgressOperator(BaseOperator):
    ui_color = "#e3f1df"

    def execute(self, context: Any) -> dict[str, Any]:
        import yaml
        from milepost.core.recipe_io import recipe_from_dict
        from milepost.core.store import CampaignStore
        from milepost.tasks.progression import after_evaluate, as_dict

        params = context["params"]
        url, block = str(params["campaign_url"]), int(params["block"])
        store = CampaignStore(url)
        recipe = recipe_from_dict(yaml.safe_load(store.read_text("campaign.yaml")), "campaign.yaml")
        decision = after_evaluate(store, recipe, block)
        self.log.info("block %d: %s (%s)", block, decision.action, decision.message)
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
