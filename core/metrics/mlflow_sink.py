"""MLflow sink: one MLflow run per campaign, through MLflow's own client.

Offline by default: the tracking store is an SQLite file under the campaign store
(MLflow 3.18 refuses its plain-file store unless opted in, and names SQLite as the local
replacement). The run is found again by a tag holding a hash of the campaign URL, so every
stage, restart and requeue writes into the same run; a run created by a killed stage before
anything else happened is found the same way. Credentials for a tracking server come from
MLflow's own environment variables only (the recipe refuses a URI holding them)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from milepost.core.metrics.sinks import Held

log = logging.getLogger(__name__)

CAMPAIGN_TAG = "milepost.campaign_id"
BATCH_LIMIT = 1000  # MLflow's maximum metrics per log_batch


def campaign_id(campaign_url: str) -> str:
    return hashlib.sha1(campaign_url.encode()).hexdigest()[:20]


def default_tracking_uri(mlflow_dir: str) -> str:
    Path(mlflow_dir).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(mlflow_dir).resolve() / 'mlflow.db'}"


class MlflowSink:
    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, campaign_url: str, run_name: str,
                 artifact_location: str | None, params: Mapping[str, str]) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.run_id = self._find_or_create_run(experiment, campaign_url, run_name, artifact_location)
        self._log_params_once(params)
        self._queue: list[Any] = []

    def _find_or_create_run(self, experiment: str, campaign_url: str, run_name: str,
                            artifact_location: str | None) -> str:
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(
            experiment, artifact_location=artifact_location)
        key = campaign_id(campaign_url)
        runs = self.client.search_runs([exp_id], filter_string=f"tags.`{CAMPAIGN_TAG}` = '{key}'",
                                       order_by=["attributes.start_time ASC"], max_results=10)
        if runs:
            if len(runs) > 1:  # two stages raced to create it (not possible under the lease)
                log.warning("MLflow experiment %s holds %d runs of campaign %s; writing to the first, %s",
                            experiment, len(runs), campaign_url, runs[0].info.run_id)
            return runs[0].info.run_id
        run = self.client.create_run(exp_id, run_name=run_name,
                                     tags={CAMPAIGN_TAG: key, "milepost.campaign_url": campaign_url})
        return run.info.run_id

    def _log_params_once(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params
        todo = [Param(k, v) for k, v in params.items() if k not in have]
        for i in range(0, len(todo), 100):  # MLflow's maximum params per log_batch
            self.client.log_batch(self.run_id, params=todo[i:i + 100])

    def held(self) -> Held:
        held: Held = {}
        for key in self.client.get_run(self.run_id).data.metrics:
            for m in self.client.get_metric_history(self.run_id, key):
                held.setdefault(m.step, set()).add(key)
        return held

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._queue.extend(Metric(k, v, now_ms, step) for k, v in scalars.items())

    def flush(self) -> None:
        queue, self._queue = self._queue, []
        for i in range(0, len(queue), BATCH_LIMIT):
            self.client.log_batch(self.run_id, metrics=queue[i:i + BATCH_LIMIT])

    def close(self) -> None:
        self._queue = []
