"""`block_failed`: runs only when a stage of the block failed (trigger rule one_failed), and
fails the run saying which stage failed, its root error, and what to do about it:

- an error in the run's input (`error_kind: user`: the recipe, an override, a dataset row, a
  plugin) fails the same way every time: trigger the DAG again with corrected overrides;
- a runtime error (a lost node, a killed job, a full disk): clear the failed task to retry
  it; the stage resumes from the store.

The failed stage comes from the run's task states; its error from the XCom `failure` the
stage operator pushed before it raised, else from the stage's record in the store. The same
text becomes the DAG run's note.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator

from milepost.core.records import BLOCK_STAGES, StageState
from milepost.dags.progress import publish_note


def failed_stage(task_states: dict[str, Any]) -> str | None:
    """The first stage task (in block order; the task ids are the stage names) whose state is `failed`."""
    return next((stage.value for stage in BLOCK_STAGES if str(task_states.get(stage.value) or "") == "failed"), None)


class BlockFailedOperator(BaseOperator):
    """Fails the run when a stage failed, naming it, with advice that fits the failure."""

    ui_color = "#f6dbdb"

    def _failure(self, context: Any, stage: str | None) -> dict[str, Any]:
        if stage is None:
            return {}
        pushed = context["ti"].xcom_pull(task_ids=stage, key="failure")
        if pushed:
            return pushed
        from milepost.core.store import CampaignStore

        params = context["params"]
        record = CampaignStore(str(params["campaign_url"])).stage_record(int(params["block"]), stage)
        if record is None or record.state is not StageState.FAILED:
            return {}
        return {"error": record.error, "error_kind": record.error_kind, "log": record.log}

    def execute(self, context: Any) -> None:
        from airflow.sdk.exceptions import AirflowFailException

        from milepost.tasks.block_summary import failure_advice, failure_note

        block, dag_id, run_id = int(context["params"]["block"]), context["dag"].dag_id, context["run_id"]
        states = context["ti"].get_task_states(dag_id=dag_id, run_ids=[run_id]).get(run_id, {})
        stage = failed_stage(states)
        failure = self._failure(context, stage)
        error = failure.get("error") or "no error was recorded (the task log of that stage says what Airflow saw)"
        kind = failure.get("error_kind")
        publish_note(context, failure_note(block, stage, error, kind, failure.get("log")), self.log)
        where = f"stage {stage}" if stage else "a stage"
        raise AirflowFailException(
            f"block {block}: {where} failed ({kind or 'unclassified'} error): {error}\n"
            f"{failure_advice(stage, kind)}" + (f"\nStage log: {failure['log']}" if failure.get("log") else ""))
