"""The block summary (the DAG run's note, the end of the evaluate/progress task logs), the
failure advice of `block_failed`, the stage jobs' log lines and the run ids named by block,
built from real store files."""

from __future__ import annotations

import base64
import re

import pytest

from milepost.core.records import Stage, StageRecord
from milepost.core.store import CampaignStore
from milepost.tasks.block_summary import (
    NOTE_MAX_CHARS,
    failure_advice,
    failure_note,
    format_summary,
    human_duration,
    human_time,
    read_block_summary,
    stage_done_line,
    step_line,
    write_block_report,
)

T0 = 1_780_000_000.0


def _block(store: CampaignStore, block: int, accuracy: float, rewards: list[float], *, wall_s: float = 135.0,
           verdict: str | None = "pass") -> None:
    steps = len(rewards)
    first = block * steps + 1
    store.write_stage_record(block, "start_ray", {"state": "released", "started_at": T0, "finished_at": T0 + 5})
    store.write_stage_record(block, "run_steps", {"state": "done", "steps": [first, first + steps - 1],
                                                  "model_sha256": "a6a112ef5939" + "0" * 52,
                                                  "started_at": T0 + 10, "finished_at": T0 + 100})
    store.write_stage_record(block, "publish", {"state": "done", "step": first + steps - 1})
    store.write_stage_record(block, "evaluate", {"state": "done", "eval": {"accuracy": accuracy},
                                                 "started_at": T0 + 110, "finished_at": T0 + wall_s})
    store.write_metrics(block, [{"step": first + i, "rollout/reward_mean": r, "timing/step_s": 1.5}
                                for i, r in enumerate(rewards)])
    store.write_json(f"blocks/{block:06d}/timings.json", {"stages": {
        "start_ray": {"submitted_at": T0 - 1.0}}})
    if verdict:
        store.write_json(f"blocks/{block:06d}/gate.json", {
            "verdict": verdict, "accuracy": accuracy, "best_block": 0 if block else None,
            "best_accuracy": 0.7 if block else None, "max_eval_drop": 0.05 if block else None})


@pytest.fixture
def store(tmp_path) -> CampaignStore:
    s = CampaignStore(str(tmp_path / "campaign"))
    s.write_json("base_eval.json", {"accuracy": 0.0})
    return s


def test_durations_read_as_a_person_would_say_them() -> None:
    assert human_duration(0.4) == "0 s"
    assert human_duration(45) == "45 s"
    assert human_duration(135) == "2 min 15 s"
    assert human_duration(3 * 3600 + 4 * 60 + 9) == "3 h 04 min"
    assert human_duration(2 * 86400 + 5 * 3600) == "2 d 5 h"


def test_a_time_is_a_date_and_clock_time_never_an_epoch_number() -> None:
    shown = human_time(T0)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S*", shown), shown
    assert str(int(T0)) not in shown
    assert human_time(None) == "unknown time"


def test_block_0_is_compared_with_the_base_policy(store) -> None:
    _block(store, 0, 0.68, [0.25, 0.5])
    text = format_summary(read_block_summary(store, 0))
    assert "accuracy 0.680, gate pass" in text.splitlines()[0]
    assert "| steps | 1–2 (2 steps) |" in text
    assert "| held-out accuracy | 0.680 (base policy 0.000, +0.680) |" in text
    assert "| reward (last step / block mean) | 0.500 / 0.375 |" in text
    assert "| regression gate | pass (first block judged) |" in text
    assert "| checkpoint | step 2, sha256 a6a112ef5939 |" in text
    assert "| wall time | 2 min 16 s |" in text  # from start_ray's submission, 1 s before it started


def test_a_later_block_is_compared_with_the_block_before_and_shows_a_regression(store) -> None:
    _block(store, 0, 0.70, [0.5, 0.5])
    _block(store, 1, 0.60, [0.4, 0.3], verdict="regressed")
    text = format_summary(read_block_summary(store, 1))
    assert "| held-out accuracy | 0.600 (block 0 0.700, -0.100) |" in text
    assert "REGRESSED: campaign paused (best block 0 0.700, max drop 0.05)" in text
    assert "| steps | 3–4 (2 steps) |" in text


def test_a_block_not_judged_yet_says_so_and_missing_numbers_show_as_dashes(store) -> None:
    store.write_stage_record(0, "run_steps", {"state": "running"})
    text = format_summary(read_block_summary(store, 0))
    assert "gate not judged yet" in text and "| steps | — |" in text and "| wall time | — |" in text


def test_the_report_is_drawn_into_the_store_and_named_in_the_summary(store) -> None:
    import matplotlib  # noqa: F401  (the plot extra, in the test extra: a missing one fails here)

    from milepost.core.recipe_io import dump_recipe, load_recipe

    store.write_text_atomic("campaign.yaml", dump_recipe(load_recipe("recipes/tiny-arith.yaml", [])))
    _block(store, 0, 0.68, [0.25, 0.5])
    summary = write_block_report(store, 0)
    png = store.local_path("blocks", "000000", "report.png")
    assert summary.report_path == png
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"| plot | {png} |" in store.read_text("blocks/000000/summary.md")
    page = store.read_text("blocks/000000/report.html")  # self-contained: the PNG is inline
    assert summary.html_path == store.path("blocks", "000000", "report.html")
    assert f"| report | {summary.html_path} |" in store.read_text("blocks/000000/summary.md")
    with open(png, "rb") as f:
        assert base64.b64encode(f.read()).decode() in page
    assert "<td>held-out accuracy</td><td class=n>0.680" in page and "<td>regression gate</td>" in page
    assert page.count("<tr>") == 1 + 7 + 1 + 2  # summary head + 7 rows (not itself), steps head + 2 steps
    assert "<td class=n>0.250</td>" in page and "src=\"file" not in page


def test_the_note_fits_airflows_limit_even_with_a_very_deep_store(tmp_path) -> None:
    deep = CampaignStore(str(tmp_path / ("d" * 200) / ("e" * 200) / ("f" * 200) / "campaign"))
    _block(deep, 0, 0.68, [0.25, 0.5])
    deep.fs.makedirs(deep.path("blocks", "000000"), exist_ok=True)
    deep.fs.touch(deep.path("blocks", "000000", "report.png"))
    text = format_summary(read_block_summary(deep, 0))
    assert len(text) <= NOTE_MAX_CHARS
    assert "| plot | blocks/000000/report.png |" in text and "0.680" in text


def test_failure_advice_fits_the_kind_of_failure() -> None:
    user = failure_advice("start_ray", "user")
    assert "trigger the DAG again with corrected overrides" in user and "clear" not in user.split(":")[0]
    runtime = failure_advice("run_steps", "runtime")
    assert "clear the `run_steps` task" in runtime and "checkpoint" in runtime
    note = failure_note(3, "run_steps", "RuntimeError: the disk went away", "runtime", "/jobs/1/1_0_log.err")
    assert note.startswith("**milepost block 3 FAILED** at stage **run_steps**: RuntimeError: the disk went away")
    assert "`/jobs/1/1_0_log.err`" in note
    assert len(failure_note(0, "run_steps", "x" * 5000, "user", None)) <= NOTE_MAX_CHARS


def test_a_training_step_and_a_finished_stage_read_as_one_line_each() -> None:
    line = step_line({"step": 12, "rollout/reward_mean": 0.41, "loss/kl": 0.0012, "rollout/response_len_mean": 7.25,
                      "timing/step_s": 3.2})
    assert line == "step 12: reward 0.410, kl 0.0012, response len 7.2, took 3.2 s"
    record = StageRecord.from_dict({"state": "done", "started_at": T0, "finished_at": T0 + 75,
                                    "eval": {"accuracy": 0.725}})
    assert stage_done_line(2, Stage.EVALUATE, record) == "block 2 evaluate done in 1 min 15 s: held-out accuracy 0.725"
    steps = StageRecord.from_dict({"state": "done", "steps": [41, 60], "model_sha256": "ab" * 32, "started_at": T0,
                                   "finished_at": T0 + 3})
    assert stage_done_line(2, Stage.RUN_STEPS, steps) == (
        "block 2 run_steps done in 3 s: steps 41-60, model sha256 abababababab")
    assert line.isascii() and stage_done_line(2, Stage.RUN_STEPS, steps).isascii()  # stage logs stay ASCII


def test_runs_started_by_progress_are_named_by_block_and_never_nest() -> None:
    from milepost.dags.progress import next_run_id

    first = next_run_id(1, "manual__2026-12-04T10:00:00+00:00")
    assert first.startswith("block_000001__") and first == next_run_id(1, "manual__2026-12-04T10:00:00+00:00")
    second = next_run_id(2, first)
    assert second.startswith("block_000002__") and "block_000001" not in second and len(second) < 40
    assert next_run_id(1, "manual__other") != first  # another campaign's block 1


def test_block_failed_finds_the_first_failed_stage_in_block_order() -> None:
    from milepost.dags.block_failed import failed_stage

    assert failed_stage({"start_ray": "success", "start_engines": "success", "run_steps": "failed",
                         "publish": "upstream_failed", "teardown": "success"}) == "run_steps"
    assert failed_stage({"start_ray": "failed", "run_steps": "failed"}) == "start_ray"
    assert failed_stage({"start_ray": "success", "teardown": "failed"}) is None


def test_summary_numbers_come_from_the_store_not_from_memory(store) -> None:
    _block(store, 0, 0.68, [0.25, 0.5])
    before = read_block_summary(store, 0)
    store.write_metrics(0, [{"step": 1, "rollout/reward_mean": 1.0}])
    assert read_block_summary(store, 0).reward_last == 1.0 != before.reward_last
