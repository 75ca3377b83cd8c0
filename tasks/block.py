"""One block: launch_ray → rollout → train → sync → evaluate, then teardown whatever happened.

Each stage reads its record first: done → skipped. Stages that own live resources (the Ray
cluster, the fleet) are recreated by a new `milepost run`, because on the embedded default
those resources die with the process; their records say what was served, for the operator.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import ray

from milepost.core.checkpoint import CheckpointManager
from milepost.core.config import Recipe
from milepost.core.store import CampaignStore

log = logging.getLogger(__name__)


def _now() -> float:
    return round(time.time(), 3)


class BlockRunner:
    def __init__(self, recipe: Recipe, store: CampaignStore, show_progress: bool = True) -> None:
        self.recipe, self.store, self.show_progress = recipe, store, show_progress
        self.checkpoints = CheckpointManager(store.local_path("checkpoints"), recipe.checkpoint.keep_last)
        self.fleet: Any = None
        self.model_path: str | None = None

    # --- the block ------------------------------------------------------------------------
    def run_block(self, block: int) -> None:
        if (self.store.stage_record(block, "evaluate") or {}).get("state") == "done":
            log.info("block %d already done", block)
            return
        try:
            for stage in ("launch_ray", "rollout", "train", "sync", "evaluate"):
                record = self.store.stage_record(block, stage)
                if record and record.get("state") == "done" and stage in ("sync", "evaluate", "train"):
                    continue
                started = _now()
                outputs = getattr(self, f"stage_{stage}")(block)
                self.store.write_stage_record(block, stage, {
                    "state": "done", "started_at": started, "finished_at": _now(), **outputs})
            self._report_eval(block)
        finally:
            self.stage_teardown(block)

    def _report_eval(self, block: int) -> None:
        accuracy = self.store.stage_record(block, "evaluate")["eval"]["accuracy"]
        base = self.store.read_json("base_eval.json")["accuracy"] if self.store.exists("base_eval.json") else None
        versus = f" (base policy {base:.3f}, {accuracy - base:+.3f})" if base is not None else ""
        log.info("block %d of %d: held-out accuracy %.3f%s", block + 1, self.recipe.campaign.num_blocks,
                 accuracy, versus)

    def _last_step(self, block: int) -> int:
        return (block + 1) * self.recipe.campaign.steps_per_block

    # --- stages ---------------------------------------------------------------------------
    def stage_launch_ray(self, block: int) -> dict[str, Any]:
        if not ray.is_initialized():
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        return {"ray_address": ray.get_runtime_context().gcs_address}

    def stage_rollout(self, block: int) -> dict[str, Any]:
        from milepost.core.engine.fleet import Fleet
        from milepost.core.evaluate import record_base_eval
        from milepost.core.model.loading import resolve_model_path

        latest = self.checkpoints.latest_valid()
        self.model_path = resolve_model_path(self.recipe.model, self.recipe.seed)
        serve_path = str(latest.path / "hf") if latest else self.model_path
        version = str(latest.state["policy_version"]) if latest else "0"
        self.fleet = Fleet.start(serve_path, self.recipe.rollout.num_engines, self.recipe.rollout, version)
        unhealthy = [url for url, ok in self.fleet.health_check().items() if not ok]
        if unhealthy:
            raise RuntimeError(f"engines failed their health check: {unhealthy}")
        if version == "0" and not self.store.exists("base_eval.json"):
            self.store.write_json("base_eval.json", record_base_eval(self.recipe, self.fleet, self.model_path))
        return {"engine_urls": self.fleet.engine_urls, "router_url": self.fleet.router_url,
                "policy_version": version}

    def stage_train(self, block: int) -> dict[str, Any]:
        from milepost.tasks.train import run_train_stage

        return run_train_stage(self, block)

    def stage_sync(self, block: int) -> dict[str, Any]:
        latest = self.checkpoints.latest_valid()
        assert latest and latest.step == self._last_step(block), "train must commit the block's checkpoint"
        import shutil
        export = Path(self.store.local_path("exports", f"{latest.step:08d}"))
        if not export.exists():
            shutil.copytree(latest.path / "hf", export)
        version = str(latest.state["policy_version"])
        for client in self.fleet.clients:
            served = str(client.model_info().get("weight_version"))
            if served != version:
                raise RuntimeError(f"{client.base_url} serves policy {served}, expected {version}")
        return {"step": latest.step, "policy_version": version, "export_path": str(export)}

    def stage_evaluate(self, block: int) -> dict[str, Any]:
        from milepost.core.evaluate import evaluate_fleet

        return {"eval": evaluate_fleet(self.recipe, self.fleet, self.model_path)}

    def stage_teardown(self, block: int) -> None:
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None
        if ray.is_initialized():
            ray.shutdown()
        self.store.write_stage_record(block, "teardown", {"state": "done", "finished_at": _now()})
