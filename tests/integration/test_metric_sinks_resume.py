"""A tiny-arith campaign with `metrics.sinks: [tensorboard, mlflow]`, SIGKILLed mid-block and
rerun: the real TensorBoard reader and the MLflow client find every step exactly once, with
the values of the campaign's final metrics.jsonl; `milepost status --plot` draws the same
curves and marks the restart."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import fault_campaign as cp

HOLD_HOOK = Path(__file__).resolve().parents[1] / "faults" / "hold_hook.py"
SHAPE = cp.Shape(num_blocks=2, steps_per_block=4, prompts_per_step=8, samples_per_prompt=4, checkpoint_every=2,
                 warmstart_steps=60, eval_prompts=16,
                 extra=("metrics.sinks=[tensorboard, mlflow]", f"hooks.on_step_end=[{HOLD_HOOK}:hold]"))
NUM_STEPS = SHAPE.num_steps
KILL_AFTER_STEP = 7  # block 1, after step 6's checkpoint: step 7 is trained but not committed
TRAIN_TAGS = ("rollout/reward_mean", "loss/entropy", "loss/kl", "rollout/staleness", "timing/step_s")


def _kill_after(campaign: Path, cache: Path, log: Path, step: int, monkeypatch: pytest.MonkeyPatch
                ) -> subprocess.Popen:
    """Run until `step` is recorded and SIGKILL the run there: the hold hook keeps the loop after
    that step (before the next one or a checkpoint) until the kill has landed."""
    hold = campaign.parent / "hold"
    hold.touch()
    monkeypatch.setenv("MILEPOST_TEST_HOLD_FILE", str(hold))
    monkeypatch.setenv("MILEPOST_TEST_HOLD_STEP", str(step))
    proc = cp.start(campaign, cache, SHAPE.overrides(), log)
    monkeypatch.delenv("MILEPOST_TEST_HOLD_FILE")  # the resumed run does not hold
    deadline = time.monotonic() + 600
    while cp.steps_recorded(campaign) < step:
        assert proc.poll() is None, f"run ended before step {step}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, "run made no progress in 600 s"
        time.sleep(0.05)
    assert cp.steps_recorded(campaign) == step  # held there
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    # the held stage job exits once its driver is gone (tasks/stage.die_with); the file stays,
    # so nothing releases it into step 8 before that, and the rerun does not read it
    return proc


@pytest.mark.slow
def test_sinks_hold_every_step_once_after_a_sigkill_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    cache, campaign, log = tmp_path / "cache", tmp_path / "c", tmp_path / "runs.log"
    cp.build_model(cache, SHAPE.overrides())
    killed = _kill_after(campaign, cache, log, KILL_AFTER_STEP, monkeypatch)
    try:
        _check_campaign(tmp_path, campaign, log)
    finally:
        cp.kill_session(killed)  # whatever of the killed run's own session is left


def _check_campaign(tmp_path: Path, campaign: Path, log: Path) -> None:
    from mlflow.tracking import MlflowClient

    from milepost.core.metrics.plot import read_curves
    from milepost.core.metrics.tensorboard_sink import read_scalars
    from milepost.core.store import CampaignStore

    cache = tmp_path / "cache"
    assert cp.run_to_end(campaign, cache, SHAPE.overrides(), log, timeout_s=600) == 0, log.read_text()[-4000:]

    rows = cp.metrics(campaign)
    assert [r["step"] for r in rows] == list(range(1, NUM_STEPS + 1))
    # colocated (tiny-arith's placement): each step records the engines' memory handover
    assert all(r["timing/engines_release_s"] >= 0.0 and r["timing/engines_resume_s"] >= 0.0 for r in rows), rows[0]
    # the weights' export to disk is a part of each step's weight sync, recorded apart
    assert all(0.0 < r["timing/weight_export_s"] <= r["timing/weight_sync_s"] for r in rows), rows[0]
    final = {(r["step"], tag): r[tag] for r in rows for tag in TRAIN_TAGS}
    store = CampaignStore(str(campaign))
    evals = [(0, store.read_json("base_eval.json")["accuracy"])] + [
        ((b + 1) * SHAPE.steps_per_block, cp.record(campaign, "evaluate", b)["eval"]["accuracy"])
        for b in range(SHAPE.num_blocks)]

    tb = read_scalars(str(campaign / "metrics" / "tensorboard"))
    for tag in TRAIN_TAGS:
        assert [s for s, _ in tb[tag]] == list(range(1, NUM_STEPS + 1)), f"tensorboard {tag}: {tb[tag]}"
        for step, value in tb[tag]:
            assert value == pytest.approx(final[step, tag], rel=1e-6, abs=1e-12), (tag, step)
    assert [s for s, _ in tb["eval/accuracy"]] == [s for s, _ in evals]
    assert [v for _, v in tb["eval/accuracy"]] == pytest.approx([v for _, v in evals])
    assert len(list((campaign / "metrics" / "tensorboard").iterdir())) >= 3  # written by several processes

    client = MlflowClient(tracking_uri=f"sqlite:///{campaign / 'metrics' / 'mlflow' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tiny-arith").experiment_id])
    assert len(runs) == 1, "one MLflow run per campaign"
    run_id = runs[0].info.run_id
    for tag in TRAIN_TAGS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, tag))
        assert [s for s, _ in history] == list(range(1, NUM_STEPS + 1)), f"mlflow {tag}: {history}"
        assert [v for _, v in history] == pytest.approx([final[s, tag] for s, _ in history])
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval/accuracy"))
    assert [s for s, _ in history] == [s for s, _ in evals]
    assert [v for _, v in history] == pytest.approx([v for _, v in evals])
    assert runs[0].data.params["campaign.steps_per_block"] == str(SHAPE.steps_per_block)

    from milepost.cli import main

    assert main(["status", str(campaign), "--plot", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    curves = read_curves(store)
    assert curves.series["rollout/reward_mean"] == (list(range(1, NUM_STEPS + 1)),
                                                    [r["rollout/reward_mean"] for r in rows])
    assert curves.restarts == [6.5], "the resumed run_steps stage of block 1 (from step 6) is marked"
    assert [x for _, x in curves.block_starts] == [0.5, 4.5]
