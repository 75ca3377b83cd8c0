"""The run_steps stage: resume from the latest committed checkpoint, run the block's RL steps
(each one the loop's phases: rollout, reward, train, weight sync, checkpoint; core/loop.py).

It joins the block's Ray cluster (the trainer ranks are actors of this stage's driver, so
they die with it) and re-attaches to the fleet the start_engines stage started, with a
supervisor of its own that restarts dead engines for as long as the stage runs."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from milepost.core.config import Recipe
from milepost.core.data.source import DataCursor, PromptSource, load_rows
from milepost.core.extensions import resolve_extensions, trainer_algo
from milepost.core.fleet.direct import direct_client
from milepost.core.fleet.fleet import Fleet, FleetTransport
from milepost.core.hooks import BlockInfo
from milepost.core.loop import LoopState, RLLoop
from milepost.core.metrics.publish import eval_rows, open_sinks, publish_committed, record_train_start
from milepost.core.model.loading import load_tokenizer
from milepost.core.model.moe import is_moe_model
from milepost.core.records import Stage
from milepost.core.reward import RewardEvaluator
from milepost.core.train.backend import TrainBackend
from milepost.core.train.factory import create_backend
from milepost.core.weight_export import WeightExports
from milepost.core.weight_sync import build_transport
from milepost.core.weight_sync.lora_push import LoraTransport
from milepost.tasks.block_summary import step_line
from milepost.tasks.context import StageContext
from milepost.tasks.startup_timer import StartupTimer

log = logging.getLogger(__name__)


def _restore(ctx: StageContext, backend: TrainBackend) -> LoopState:
    latest = ctx.checkpoints.latest_valid()
    if latest is None:
        return LoopState()
    backend.load_state(str(latest.path / "trainer"))
    s = latest.state
    return LoopState(step=s["step"], policy_version=s["policy_version"], cursor=s["cursor"],
                     metrics=s["metrics"], model_sha256=s["model_sha256"],
                     rollout_chunks=s.get("rollout_chunks", []))


def run_steps(ctx: StageContext) -> dict[str, Any]:
    timer = StartupTimer("run_steps")
    recipe = ctx.recipe
    last_step = ctx.last_step()
    latest = ctx.checkpoints.latest_valid()
    if latest and latest.step >= last_step:  # trained already: only the sinks may lack the last steps
        publish_committed(recipe, ctx.store, latest.state["metrics"])
        return {"steps": [last_step - recipe.campaign.steps_per_block + 1, last_step], "resumed": True}
    model_path = ctx.model_path()
    tokenizer = load_tokenizer(model_path)
    # With train.lora the checkpoint holds an adapter: the trainer starts from the base weights
    start_path = str(latest.path / "hf") if latest and ctx.recipe.train.lora is None else model_path
    timer.mark("tokenizer")
    fleet = ctx.attach_fleet()  # connects to the block's Ray cluster first
    timer.mark("fleet attached")
    served = ctx.checkpoints.step_of(fleet.served[0])
    if served is not None:  # a restarted engine launches from it: retention must keep it
        ctx.checkpoints.protect(served)
    try:
        return _train(ctx, fleet, tokenizer, start_path, timer)
    finally:
        fleet.detach()


def _rank_gpus(recipe: Recipe) -> list[float]:
    """What each trainer rank asks of its bundle (core/placement.py: a GPU, a share, or none)."""
    from milepost.core.placement import placement_for
    from milepost.core.train.torch_backend import RANK_NUM_CPUS
    placement = placement_for(recipe, RANK_NUM_CPUS)
    return [placement.rank_gpus(r) for r in range(recipe.train.num_ranks)]


def _train(ctx: StageContext, fleet: Any, tokenizer: Any, start_path: str, timer: StartupTimer) -> dict[str, Any]:
    recipe, store, block, last_step = ctx.recipe, ctx.store, ctx.block, ctx.last_step()
    extensions = resolve_extensions(recipe)  # before the ranks start: a broken plugin costs nothing
    backend = create_backend(start_path, recipe.train, trainer_algo(recipe.algo),
                             temperature=recipe.rollout.temperature, seed=recipe.seed,
                             total_steps=recipe.campaign.num_blocks * recipe.campaign.steps_per_block,
                             placement_group=fleet.placement_group, precision=recipe.precision.train,
                             rank_gpus=_rank_gpus(recipe), rollout_precision=recipe.precision.rollout)
    timer.mark("trainer ranks")
    sinks = open_sinks(recipe, store)
    exports = WeightExports(Path(store.local_path("exports", "steps")), backend.export_hf)
    fleet.track_exports(exports)  # a restarted engine waits for a served folder still being written
    try:
        state = _restore(ctx, backend)
        timer.mark(f"checkpoint of step {state.step} restored" if state.step else "no checkpoint")
        record_train_start(store, block, state.step)
        rows = load_rows(recipe.data.train_path, recipe.data.prompt_key, recipe.data.label_key,
                         builtin_rows=recipe.data.num_train_rows, seed=recipe.seed)
        cursor = (DataCursor.from_dict(state.cursor) if state.cursor
                  else DataCursor(epoch=0, offset=0, shuffle_seed=recipe.seed, num_rows=len(rows)))
        source = PromptSource(rows, tokenizer, cursor, shuffle=recipe.data.shuffle,
                              prompt_key=recipe.data.prompt_key, label_key=recipe.data.label_key)
        block_first = last_step - recipe.campaign.steps_per_block + 1
        # Metrics after the checkpoint were never committed: rewrite the file from the checkpoint.
        store.write_metrics(block, [m for m in state.metrics if m["step"] >= block_first])
        # The sinks take committed steps only: what the checkpoint holds (a killed stage may
        # have committed steps it did not publish), then each step as its checkpoint commits.
        if sinks.sinks:
            sinks.publish(state.metrics + eval_rows(store, recipe.campaign.steps_per_block))
        first_done: list[float] = []

        def on_metrics(row: dict[str, Any]) -> None:
            if not first_done:  # for bench/results/slurm_overhead.txt: submission → first step
                first_done.append(time.time())
                ctx.update(Stage.RUN_STEPS, first_step_done_at=first_done[0])
            store.write_metrics(block, [m for m in loop.state.metrics if m["step"] >= block_first])
            log.info("block %d %s", block, step_line(row))  # the stage job's log: one line per step

        def on_commit(step: int) -> None:
            sinks.publish([m for m in loop.state.metrics if m["step"] <= step])

        transport = FleetTransport(fleet, LoraTransport(timeout_s=recipe.sync.timeout_s) if recipe.train.lora
                                   else build_transport(recipe.sync))
        colocated = recipe.cluster.placement == "colocated"
        moe = bool(is_moe_model(start_path))  # MoE: routes come back only from the engines themselves
        loop = RLLoop(recipe, backend=backend, router=direct_client(fleet) if moe else fleet.router_client,
                      engines=fleet.clients, source=source,
                      rollout_fn=extensions.rollout,
                      rewards=RewardEvaluator(extensions.reward, recipe.reward.num_workers),
                      transport=transport,
                      checkpoints=ctx.checkpoints,
                      exports=exports,
                      stop_token_ids=[tokenizer.eos_token_id],
                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                      state=state, on_metrics=on_metrics,
                      engines_asleep=transport.asleep if colocated else None, on_commit=on_commit,
                      filters=extensions.filters, hooks=extensions.hooks, routed_experts=moe)
        _serve_checkpoint(fleet, transport, _served_policy(ctx, backend, start_path), state.policy_version, backend)
        timer.mark("engines serving the policy")
        timer.report()
        loop.run_until(last_step)
        fleet.raise_if_failed()
        extensions.hooks.block_end(BlockInfo(block, block_first, last_step, loop.state.model_sha256),
                                   loop.context(last_step))
        return {"steps": [block_first, last_step], "model_sha256": loop.state.model_sha256,
                "policy_version": loop.state.policy_version,
                "engine_restarts": fleet.restart_events()}
    finally:
        sinks.close()
        exports.close()  # the trainer must outlive the export in flight
        backend.shutdown()


def _served_policy(ctx: StageContext, backend: TrainBackend, start_path: str) -> str:
    """What the engines must serve before the first rollout: the weights the trainer starts
    from, or with train.lora its adapter (the checkpoint's, or the fresh one exported)."""
    if ctx.recipe.train.lora is None:
        return start_path
    latest = ctx.checkpoints.latest_valid()
    if latest is not None:
        return str(latest.path / "hf")
    path = Path(ctx.store.local_path("exports", "steps")) / f"{0:08d}"
    backend.export_hf(str(path))
    return str(path)


def _serve_checkpoint(fleet: Fleet, transport: FleetTransport, path: str, version: int,
                      backend: TrainBackend) -> None:
    """Before this stage's first rollout, the engines serve exactly the weights it resumes from.
    A retried run_steps stage needs it (Airflow retries the task when its job dies; the fleet of
    the start_engines stage lives on): the killed attempt may have pushed weights newer than its
    last checkpoint, or died with the engines asleep (colocated). Resuming memory is a no-op on an
    awake engine; the push costs one weight sync per run_steps stage."""
    transport.wake()
    transport.push(fleet.clients, path, str(version), backend=backend)
