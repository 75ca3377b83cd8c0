"""Campaign progression on a real store and real checkpoints: the regression gate pauses the
campaign and marks the block, a resume puts the best block's checkpoint back under the next
block's starting step, a stop request and the last block end the campaign, and a block out
of order is refused."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from milepost.core.checkpoint import CheckpointManager
from milepost.core.recipe_io import load_recipe
from milepost.core.store import CampaignStore
from milepost.tasks import progression
from milepost.tasks.campaign import prepare_campaign

ROOT = Path(__file__).resolve().parents[2]
SPB = 2


def _campaign(tmp_path: Path, max_eval_drop: str = "0.05", num_blocks: int = 4):
    recipe = load_recipe(str(ROOT / "recipes" / "tiny-arith.yaml"), [
        f"campaign.num_blocks={num_blocks}", f"campaign.steps_per_block={SPB}",
        f"campaign.max_eval_drop={max_eval_drop}", "checkpoint.keep_last=1"])
    prepared = prepare_campaign(recipe, str(tmp_path / "c"))
    return prepared.recipe, prepared.store


def _finish_block(recipe, store: CampaignStore, block: int, accuracy: float) -> bytes:
    """What a block's train and evaluate stages leave: a committed checkpoint at its last step
    (weights unique to the block) and an evaluate record."""
    step = (block + 1) * SPB
    weights = f"weights of block {block}".encode()

    def payload(folder: Path) -> None:
        (folder / "hf").mkdir()
        (folder / "hf" / "model.safetensors").write_bytes(weights)

    CheckpointManager(store.local_path("checkpoints"), recipe.checkpoint.keep_last).save(
        step, {"step": step, "policy_version": step, "model_sha256": f"sha-{block}", "metrics": []}, payload)
    store.write_stage_record(block, "evaluate", {"state": "done", "finished_at": time.time(),
                                                 "eval": {"accuracy": accuracy}})
    return weights


def test_passing_blocks_follow_each_other_and_the_best_is_kept(tmp_path: Path) -> None:
    recipe, store = _campaign(tmp_path)
    best_weights = _finish_block(recipe, store, 0, 0.70)
    decision = progression.after_evaluate(store, recipe, 0)
    assert (decision.action, decision.next_block) == ("next", 1)
    _finish_block(recipe, store, 1, 0.68)  # 0.02 below the best: within the gate
    assert progression.after_evaluate(store, recipe, 1).action == "next"
    progress = progression.read_progress(store)
    assert progress["best"]["block"] == 0 and progress["paused"] is None
    # The best block's checkpoint survives keep_last=1 pruning as a snapshot.
    assert not CheckpointManager(store.local_path("checkpoints")).step_dir(SPB).exists()
    assert (Path(progress["best"]["snapshot"]) / "hf" / "model.safetensors").read_bytes() == best_weights
    assert store.read_json("blocks/000001/gate.json")["verdict"] == "pass"
    assert progression.next_block(store, recipe) == 2


def test_a_regression_pauses_and_resume_starts_from_the_best_checkpoint(tmp_path: Path) -> None:
    recipe, store = _campaign(tmp_path)
    best_weights = _finish_block(recipe, store, 0, 0.70)
    progression.after_evaluate(store, recipe, 0)
    _finish_block(recipe, store, 1, 0.60)  # 0.10 below the best: beyond max_eval_drop 0.05
    decision = progression.after_evaluate(store, recipe, 1)
    assert decision.action == "paused" and "block 1 accuracy 0.600 is more than 0.05 below the best block 0" \
        in decision.message
    gate = store.read_json("blocks/000001/gate.json")
    assert gate["verdict"] == "regressed" and gate["best_block"] == 0
    assert progression.after_evaluate(store, recipe, 1).action == "paused"  # idempotent

    with pytest.raises(progression.CampaignPaused, match="is paused .* Resume it with `milepost run --resume`"):
        progression.check_can_start(store, recipe, 2, resume=False)
    progression.check_can_start(store, recipe, 2, resume=True)

    checkpoints = CheckpointManager(store.local_path("checkpoints"))
    latest = checkpoints.latest_valid()
    assert latest.step == 2 * SPB  # block 2 starts where block 1 ended, step-wise ...
    assert (latest.path / "hf" / "model.safetensors").read_bytes() == best_weights  # ... from block 0's weights
    assert latest.state["model_sha256"] == "sha-0" and latest.state["policy_version"] == SPB
    rejected = list(checkpoints.root.glob("rejected-*"))
    assert len(rejected) == 1 and (rejected[0] / "hf" / "model.safetensors").read_bytes() == b"weights of block 1"
    progress = progression.read_progress(store)
    assert progress["paused"] is None and progress["restored"][0]["from_block"] == 0
    progression.check_can_start(store, recipe, 2, resume=False)  # no longer paused


def test_stop_request_and_the_last_block_end_the_campaign(tmp_path: Path) -> None:
    recipe, store = _campaign(tmp_path, num_blocks=2)
    _finish_block(recipe, store, 0, 0.5)
    progression.request_stop(store, by="alice")
    decision = progression.after_evaluate(store, recipe, 0)
    assert decision.action == "stopped" and "alice" in decision.message
    with pytest.raises(progression.CampaignPaused, match="a stop was requested"):
        progression.check_can_start(store, recipe, 1, resume=False)
    progression.check_can_start(store, recipe, 1, resume=True)
    _finish_block(recipe, store, 1, 0.4)  # a drop, but the gate is 0.05 ... and block 1 is the last
    last = progression.after_evaluate(store, recipe, 1)
    assert last.action == "done" and "the last one regressed, so the best policy is block 0's" in last.message
    with pytest.raises(progression.CampaignPaused, match="is complete"):
        progression.check_can_start(store, recipe, 2, resume=True)


def test_no_gate_never_pauses_and_blocks_run_in_order(tmp_path: Path) -> None:
    recipe, store = _campaign(tmp_path, max_eval_drop="null", num_blocks=3)
    with pytest.raises(progression.CampaignPaused, match="block 1 cannot start: block 0 is the next block"):
        progression.check_can_start(store, recipe, 1, resume=False)
    _finish_block(recipe, store, 0, 0.9)
    progression.after_evaluate(store, recipe, 0)
    _finish_block(recipe, store, 1, 0.1)
    assert progression.after_evaluate(store, recipe, 1).action == "next"
    _finish_block(recipe, store, 2, 0.2)
    assert progression.after_evaluate(store, recipe, 2).action == "done"
    assert json.loads(Path(store.local_path("progress.json")).read_text())["best"]["block"] == 0


def _milepost_run(campaign: Path, *extra: str):
    import subprocess
    import sys

    sets = [a for o in ["campaign.num_blocks=4", f"campaign.steps_per_block={SPB}", "campaign.max_eval_drop=0.05",
                        "checkpoint.keep_last=1"] for a in ("--set", o)]
    return subprocess.run([sys.executable, "-m", "milepost.cli", "run", "recipes/tiny-arith.yaml", "--campaign",
                           str(campaign), *sets, *extra], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)


def test_milepost_run_refuses_a_paused_campaign_and_one_another_run_writes(tmp_path: Path) -> None:
    import os

    from milepost.tasks import lease

    recipe, store = _campaign(tmp_path)
    _finish_block(recipe, store, 0, 0.70)
    progression.after_evaluate(store, recipe, 0)
    _finish_block(recipe, store, 1, 0.50)
    progression.after_evaluate(store, recipe, 1)
    done = _milepost_run(tmp_path / "c")
    assert done.returncode == 2 and "is paused (block 1 accuracy 0.500" in done.stderr and "--resume" in done.stderr
    assert not (tmp_path / "c" / "airflow").exists(), "nothing ran"

    lease.acquire(store, "airflow:milepost_tiny_arith/manual__1", pid=os.getpid())
    done = _milepost_run(tmp_path / "c", "--resume")
    assert done.returncode == 2 and "is being run by airflow:milepost_tiny_arith/manual__1" in done.stderr
    assert progression.read_progress(store)["paused"], "a refused run changes nothing"
