"""Metric sinks: each committed (step, tag) reaches a sink exactly once, across reopenings
(a restarted stage), half-written steps (a kill mid-write) and a sink that failed for a while.
Read back with the real TensorBoard reader and MLflow client."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from milepost.core.metrics.mlflow_sink import MlflowSink, default_tracking_uri
from milepost.core.metrics.sinks import SinkSet, missing, scalars
from milepost.core.metrics.tensorboard_sink import TensorBoardSink, read_scalars
from milepost.core.recipe_io import RecipeError, recipe_from_dict


def _rows(first: int, last: int) -> list[dict]:
    return [{"step": s, "rollout/reward_mean": s / 10, "loss/kl": 0.01 * s, "policy_version": s,
             "data/prompt_indices": [s, s + 1]} for s in range(first, last + 1)]


def test_scalars_keep_numbers_and_leave_out_step_and_lists() -> None:
    assert scalars({"step": 3, "a": 1, "b": 0.5, "c": [1], "d": "x", "e": True}) == {"a": 1.0, "b": 0.5}


def test_missing_gives_only_the_pairs_not_held_in_step_order() -> None:
    held = {1: {"rollout/reward_mean", "loss/kl", "policy_version"}, 2: {"loss/kl"}}
    todo = missing(list(reversed(_rows(1, 3))), held)
    assert [step for step, _ in todo] == [2, 3]
    assert todo[0][1] == {"rollout/reward_mean": 0.2, "policy_version": 2.0}
    assert set(todo[1][1]) == {"rollout/reward_mean", "loss/kl", "policy_version"}


def _tb_counts(log_dir: Path) -> dict[str, list[int]]:
    return {tag: [step for step, _ in events] for tag, events in read_scalars(str(log_dir)).items()}


def test_tensorboard_sink_reopened_writes_each_step_once(tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    first = SinkSet([TensorBoardSink(str(log_dir))])
    assert first.publish(_rows(1, 3)) == {"tensorboard": 9}
    assert first.publish(_rows(1, 3)) == {"tensorboard": 0}  # same process: held in memory
    first.close()
    second = SinkSet([TensorBoardSink(str(log_dir))])  # a restarted stage: held read back from disk
    assert second.publish(_rows(1, 5)) == {"tensorboard": 6}
    second.close()
    counts = _tb_counts(log_dir)
    assert counts == {tag: [1, 2, 3, 4, 5] for tag in ("rollout/reward_mean", "loss/kl", "policy_version")}
    assert len(list(log_dir.iterdir())) == 2  # one event file per writing process
    values = dict(read_scalars(str(log_dir))["rollout/reward_mean"])
    assert values[4] == pytest.approx(0.4)


def test_tensorboard_step_cut_mid_write_gets_only_its_missing_tags(tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    killed = TensorBoardSink(str(log_dir))  # as a kill leaves it: step 2 has one tag of three
    killed.write(1, scalars(_rows(1, 1)[0]))
    killed.write(2, {"loss/kl": 0.02})
    killed.close()
    resumed = SinkSet([TensorBoardSink(str(log_dir))])
    assert resumed.publish(_rows(1, 2)) == {"tensorboard": 2}
    resumed.close()
    assert _tb_counts(log_dir) == {tag: [1, 2] for tag in ("rollout/reward_mean", "loss/kl", "policy_version")}


def test_a_failed_sink_is_read_back_and_catches_up(tmp_path: Path) -> None:
    blocker = tmp_path / "tb"
    blocker.write_text("a file where the event folder should be")
    sinks = SinkSet([TensorBoardSink(str(blocker))])
    assert sinks.publish(_rows(1, 2)) == {"tensorboard": 0}  # logged, not raised
    sinks.close()
    blocker.unlink()
    assert sinks.publish(_rows(1, 3)) == {"tensorboard": 9}
    sinks.close()
    assert _tb_counts(blocker)["loss/kl"] == [1, 2, 3]


def _mlflow(tmp_path: Path) -> MlflowSink:
    return MlflowSink(default_tracking_uri(str(tmp_path / "mlflow")), "tiny-arith", campaign_url=str(tmp_path / "c"),
                      run_name="c", artifact_location=str(tmp_path / "mlflow" / "artifacts"),
                      params={"train.lr": "5e-05", "seed": "1"})


def test_mlflow_sink_keeps_one_run_per_campaign_and_each_step_once(tmp_path: Path) -> None:
    first = _mlflow(tmp_path)
    sinks = SinkSet([first])
    assert sinks.publish(_rows(1, 2) + [{"step": 2, "eval/accuracy": float("nan")}]) == {"mlflow": 7}
    sinks.close()
    second = _mlflow(tmp_path)  # a restart finds the same run by the campaign's tag
    assert second.run_id == first.run_id
    assert SinkSet([second]).publish(_rows(1, 4)) == {"mlflow": 6}
    client = second.client
    runs = client.search_runs([client.get_experiment_by_name("tiny-arith").experiment_id])
    assert [r.info.run_id for r in runs] == [first.run_id]
    history = client.get_metric_history(first.run_id, "rollout/reward_mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    assert {m.step: m.value for m in history}[3] == pytest.approx(0.3)
    assert math.isnan(client.get_metric_history(first.run_id, "eval/accuracy")[0].value)
    assert client.get_run(first.run_id).data.params == {"train.lr": "5e-05", "seed": "1"}


@pytest.mark.parametrize("sinks, expected", [
    (["tensorbord"], "unknown sink 'tensorbord' (did you mean tensorboard?)"),
    (["wandbb"], "unknown sink 'wandbb' (did you mean wandb?)"),
    (["mlflow", "mlflow"], "lists a sink twice"),
])
def test_a_wrong_sink_names_the_field_and_the_choices(sinks: list[str], expected: str) -> None:
    with pytest.raises(RecipeError, match="metrics.sinks") as err:
        recipe_from_dict({"metrics": {"sinks": sinks}})
    assert expected in str(err.value)


def test_a_sink_whose_package_is_missing_says_which_extra_to_install(monkeypatch) -> None:
    from milepost.core import config

    # The real check (importlib's find_spec) against a module that is really not installed.
    monkeypatch.setitem(config.SINK_EXTRAS, "tensorboard", ("milepost_no_such_module", "tensorboard"))
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({"metrics": {"sinks": ["jsonl", "tensorboard"]}})
    assert "pip install 'milepost[tensorboard]'" in str(err.value) and "metrics.sinks" in str(err.value)


def test_a_tracking_uri_with_a_password_is_refused() -> None:
    with pytest.raises(RecipeError, match="MLFLOW_TRACKING_PASSWORD"):
        recipe_from_dict({"metrics": {"mlflow": {"tracking_uri": "https://me:secret@mlflow.example"}}})
    assert recipe_from_dict({"metrics": {"mlflow": {"tracking_uri": "https://mlflow.example:5000"}}})


def test_milepost_run_with_a_wrong_sink_exits_2_before_anything_starts(tmp_path: Path, capsys) -> None:
    from milepost.cli import main

    campaign = tmp_path / "c"
    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny-arith.yaml")
    rc = main(["run", recipe, "--campaign", str(campaign), "--set", "metrics.sinks=[tensorbord]"])
    assert rc == 2 and not campaign.exists()
    assert "metrics.sinks" in capsys.readouterr().err


def test_a_rerun_block_with_nothing_left_to_train_still_gives_the_sinks_its_last_steps(tmp_path: Path) -> None:
    """run_steps killed after its block's last checkpoint committed and before the sinks took
    steps 3-4 (the window a CI run hit): the rerun trains nothing, and the sinks get them."""
    from milepost.core.checkpoint import CheckpointManager
    from milepost.core.metrics.publish import open_sinks
    from milepost.core.recipe_io import load_recipe
    from milepost.core.store import CampaignStore
    from milepost.tasks.context import StageContext
    from milepost.tasks.run_steps import run_steps

    recipe = load_recipe("recipes/tiny-arith.yaml", ["metrics.sinks=[tensorboard]", "campaign.steps_per_block=4"])
    store = CampaignStore(str(tmp_path / "c"))
    checkpoints = CheckpointManager(store.local_path("checkpoints"), recipe.checkpoint.keep_last)
    checkpoints.save(4, {"step": 4, "metrics": _rows(1, 4)}, lambda folder: (folder / "weights").write_text("w"))
    sinks = open_sinks(recipe, store)
    sinks.publish(_rows(1, 2))  # what the killed stage had published
    sinks.close()
    result = run_steps(StageContext("c", 0, recipe, store, checkpoints))
    assert result == {"steps": [1, 4], "resumed": True}
    assert _tb_counts(Path(store.local_path("metrics", "tensorboard")))["loss/kl"] == [1, 2, 3, 4]
