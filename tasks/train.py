"""The train stage: resume from the latest committed checkpoint, run the block's steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from milepost.core.data.source import DataCursor, PromptSource, load_rows
from milepost.core.engine.fleet import FleetTransport
from milepost.core.loop import LoopState, RLLoop
from milepost.core.model.loading import load_tokenizer
from milepost.core.reward import RewardEvaluator, resolve_reward_fn
from milepost.core.rollout import resolve_rollout_fn
from milepost.core.train.torch_backend import TorchBackend
from milepost.core.weight_sync import build_transport


def _restore(runner: Any, backend: Any) -> LoopState:
    latest = runner.checkpoints.latest_valid()
    if latest is None:
        return LoopState()
    backend.load_state(str(latest.path / "trainer"))
    s = latest.state
    return LoopState(step=s["step"], policy_version=s["policy_version"], cursor=s["cursor"],
                     metrics=s["metrics"], model_sha256=s["model_sha256"],
                     rollout_chunks=s.get("rollout_chunks", []))


def run_train_stage(runner: Any, block: int) -> dict[str, Any]:
    recipe, store = runner.recipe, runner.store
    last_step = runner._last_step(block)
    latest = runner.checkpoints.latest_valid()
    if latest and latest.step >= last_step:
        return {"steps": [last_step - recipe.campaign.steps_per_block + 1, last_step], "resumed": True}
    tokenizer = load_tokenizer(runner.model_path)
    start_path = str(latest.path / "hf") if latest else runner.model_path
    backend = TorchBackend.create(start_path, recipe.train, recipe.algo,
                                  temperature=recipe.rollout.temperature, seed=recipe.seed,
                                  total_steps=recipe.campaign.num_blocks * recipe.campaign.steps_per_block)
    try:
        state = _restore(runner, backend)
        rows = load_rows(recipe.data.train_path, recipe.data.prompt_key, recipe.data.label_key,
                         builtin_rows=recipe.data.num_train_rows, seed=recipe.seed)
        cursor = (DataCursor.from_dict(state.cursor) if state.cursor
                  else DataCursor(epoch=0, offset=0, shuffle_seed=recipe.seed, num_rows=len(rows)))
        source = PromptSource(rows, tokenizer, cursor, shuffle=recipe.data.shuffle)
        block_first = last_step - recipe.campaign.steps_per_block + 1
        # Metrics after the checkpoint were never committed: rewrite the file from the checkpoint.
        store.write_metrics(block, [m for m in state.metrics if m["step"] >= block_first])
        bar = tqdm(total=recipe.campaign.steps_per_block, initial=max(0, state.step - block_first + 1),
                   desc=f"block {block}", disable=not runner.show_progress)

        def on_metrics(row: dict[str, Any]) -> None:
            store.write_metrics(block, [m for m in loop.state.metrics if m["step"] >= block_first])
            bar.update(1)
            bar.set_postfix(reward=f"{row['rollout/reward_mean']:.3f}")

        loop = RLLoop(recipe, backend=backend, router=runner.fleet.router_client,
                      engines=runner.fleet.clients, source=source,
                      rollout_fn=resolve_rollout_fn(recipe.rollout.function),
                      rewards=RewardEvaluator(resolve_reward_fn(recipe.reward.function),
                                              recipe.reward.num_workers),
                      transport=FleetTransport(runner.fleet, build_transport(recipe.sync.transport)),
                      checkpoints=runner.checkpoints,
                      exports_dir=Path(store.local_path("exports", "steps")),
                      stop_token_ids=[tokenizer.eos_token_id],
                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                      state=state, on_metrics=on_metrics)
        loop.run_until(last_step)
        bar.close()
        runner.fleet.raise_if_failed()
        return {"steps": [block_first, last_step], "model_sha256": loop.state.model_sha256,
                "policy_version": loop.state.policy_version,
                "engine_restarts": runner.fleet.restart_events()}
    finally:
        backend.shutdown()
