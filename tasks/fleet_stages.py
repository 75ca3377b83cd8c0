"""start_engines, publish, evaluate: the stages that start or use the block's fleet.

start_engines starts the fleet as detached named actors on the block's Ray cluster (it
outlives this stage and dies with the cluster) and records it in blocks/N/fleet.json;
publish and evaluate re-attach to it from that record.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from milepost.core.records import Stage
from milepost.tasks.context import StageContext
from milepost.tasks.startup_timer import StartupTimer


def start_engines(ctx: StageContext) -> dict[str, Any]:
    """The rollout fleet (engines behind a router) serving the latest committed policy, every
    engine health-checked. At the campaign's start (policy version 0) it also measures the base
    policy on the eval set (base_eval.json, once): the fleet is up here, and the base policy
    must be measured before run_steps changes it."""
    from milepost.core.evaluate import record_base_eval
    from milepost.core.fleet.fleet import Fleet, stop_fleet_actors
    from milepost.core.placement import placement_for
    from milepost.core.quant.modes import int4_dtype
    from milepost.core.train.torch_backend import RANK_NUM_CPUS

    timer = StartupTimer("start_engines")
    ctx.connect()
    timer.mark("ray connected")
    leftovers = stop_fleet_actors()  # an earlier, killed attempt of this stage may have left some
    if leftovers:
        ctx.update(Stage.START_ENGINES, stopped_leftover_actors=leftovers)
    latest = ctx.checkpoints.latest_valid()
    model_path = ctx.model_path()
    timer.mark("model resolved")  # a builtin model is built here on first use
    lora = ctx.recipe.train.lora  # engines keep the base weights and load the checkpoint's adapter
    serve_path = str(latest.path / "hf") if latest and lora is None else model_path
    version = str(latest.state["policy_version"]) if latest else "0"
    log_dir = Path(ctx.block_path("logs"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # Locally every server binds 127.0.0.1; on a cluster, its node's IP (host=None).
    host = "127.0.0.1" if ctx.recipe.cluster.executor == "local" else None
    placement = placement_for(ctx.recipe, RANK_NUM_CPUS)
    fleet = Fleet.start(serve_path, ctx.recipe.rollout.num_engines, ctx.recipe.rollout, version, host,
                        log_dir=str(log_dir), detached=True, on_change=ctx.write_fleet, placement=placement,
                        admin_key_path=ctx.engine_admin_key_path(), lora=lora, precision=ctx.recipe.precision.rollout,
                        served_dir=ctx.store.local_path("served"),
                        int4_dtype=int4_dtype(ctx.recipe.train.backend, placement.gpus))
    timer.mark("engines and router started")
    try:
        if lora is not None and latest:
            from milepost.core.fleet.fleet import FleetTransport
            from milepost.core.weight_sync.lora_push import LoraTransport
            FleetTransport(fleet, LoraTransport(timeout_s=ctx.recipe.sync.timeout_s)).push(
                fleet.clients, str(latest.path / "hf"), version)
        unhealthy = [url for url, ok in fleet.health_check().items() if not ok]
        if unhealthy:
            raise RuntimeError(f"engines failed their health check: {unhealthy}")
        timer.mark("health check")
        if version == "0" and not ctx.store.exists("base_eval.json"):
            ctx.store.write_json("base_eval.json", record_base_eval(ctx.recipe, fleet, model_path))
            timer.mark("base policy eval")
        timer.report()
    except BaseException:
        fleet.stop()
        raise
    doc = fleet.describe()
    fleet.detach()
    return {"engine_urls": list(fleet.engine_urls), "router_url": fleet.router_url, "policy_version": version,
            "model_path": model_path, "engine_pids": [e["pid"] for e in doc["engines"]],
            "engine_names": [e["name"] for e in doc["engines"]], "router_name": doc["router"]["name"],
            "engine": ctx.recipe.rollout.engine, "engine_versions": [e["version"] for e in doc["engines"]],
            "router_pid": doc["router"]["pid"]}


def publish(ctx: StageContext) -> dict[str, Any]:
    """The block's final checkpoint exported in HF format (exports/<step>), and every engine
    checked to serve that policy version."""
    latest = ctx.checkpoints.latest_valid()
    assert latest and latest.step == ctx.last_step(), "run_steps must commit the block's checkpoint"
    export = Path(ctx.store.local_path("exports", f"{latest.step:08d}"))
    if not export.exists():
        shutil.copytree(latest.path / "hf", export)
    version = str(latest.state["policy_version"])
    fleet = ctx.attach_fleet()
    try:
        for client in fleet.clients:
            served = str(client.model_info().get("weight_version"))
            if served != version:
                raise RuntimeError(f"{client.base_url} serves policy {served}, expected {version}")
    finally:
        fleet.detach()
    return {"step": latest.step, "policy_version": version, "export_path": str(export)}


def evaluate(ctx: StageContext) -> dict[str, Any]:
    """Held-out accuracy of the policy the fleet serves, also sent to the metric sinks (the
    regression gate is applied after this stage, by tasks.progression.after_evaluate)."""
    from milepost.core.evaluate import evaluate_fleet
    from milepost.core.metrics.publish import publish_eval

    fleet = ctx.attach_fleet()
    try:
        result = {"eval": evaluate_fleet(ctx.recipe, fleet, ctx.model_path())}
    finally:
        fleet.detach()
    publish_eval(ctx.recipe, ctx.store, ctx.last_step(), result["eval"])
    return result
