"""core/records.py: one stage vocabulary (ordered, named by what each stage does), typed stage
records, block paths, the campaign id, DAG ids; light enough for DAG-parse time; and a store
written before the stages were renamed still reads (and resumes) under the new names."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from milepost.core.recipe_io import dump_recipe, load_recipe
from milepost.core.records import (
    BLOCK_STAGES,
    Stage,
    StageRecord,
    StageState,
    block_label,
    block_path,
    campaign_id,
    dag_id_for,
    legacy_stage_name,
    parse_stage,
    stage_record_path,
)
from milepost.core.store import CampaignStore, NotACampaignError

ROOT = Path(__file__).resolve().parents[2]
OLD_NAMES = {"launch_ray": "start_ray", "rollout": "start_engines", "train": "run_steps", "sync": "publish"}


def test_the_stages_run_in_block_order_with_teardown_last() -> None:
    assert [s.value for s in Stage] == ["start_ray", "start_engines", "run_steps", "publish", "evaluate", "teardown"]
    assert tuple(Stage)[:-1] == BLOCK_STAGES
    assert f"mp-{Stage.RUN_STEPS}-b0" == "mp-run_steps-b0"  # a stage formats as its name (job names, logs)


def test_old_stage_names_are_read_as_the_new_ones() -> None:
    for old, new in OLD_NAMES.items():
        assert parse_stage(old) is Stage(new) and legacy_stage_name(Stage(new)) == old
    assert parse_stage("evaluate") is Stage.EVALUATE and legacy_stage_name(Stage.EVALUATE) is None
    with pytest.raises(ValueError, match="unknown stage 'trian'; the stages are: start_ray, start_engines, run_steps"):
        parse_stage("trian")


def test_a_stage_record_round_trips_its_stored_form() -> None:
    stored = {"state": "done", "started_at": 1.5, "finished_at": 4.0, "pid": 42, "slurm_job_id": None,
              "steps": [1, 2], "model_sha256": "ab"}
    record = StageRecord.from_dict(stored)
    assert record.state is StageState.DONE and record.done and record.pid == 42
    assert record.outputs == {"steps": [1, 2], "model_sha256": "ab"} and record.duration_s == 2.5
    assert record.to_dict() == {k: v for k, v in stored.items() if v is not None}  # None fields are left out
    released = record.merged(state=StageState.RELEASED, released_at=9.0)
    assert (released.state, released.outputs["released_at"], released.pid) == (StageState.RELEASED, 9.0, 42)
    failed = StageRecord.from_dict({"state": "failed", "error": "UserError: x", "error_kind": "user"})
    assert failed.user_error and not record.user_error
    with pytest.raises(ValueError, match="state must be one of running, done, failed, aborted, released, got 'ok'"):
        StageRecord.from_dict({"state": "ok"})


def test_block_paths_campaign_ids_and_dag_ids() -> None:
    assert block_path(3) == "blocks/000003" and block_path(3, "logs", "x.log") == "blocks/000003/logs/x.log"
    assert stage_record_path(12, Stage.PUBLISH) == "blocks/000012/publish.json"
    assert block_label(7) == "block_000007"
    assert campaign_id("s3://bucket/c1") == "s3://bucket/c1"
    assert campaign_id("runs/c1") == os.path.join(os.getcwd(), "runs", "c1")
    assert dag_id_for("tiny-arith v2") == "milepost_tiny_arith_v2"


def test_the_store_loads_its_recipe_or_says_how_to_start_a_campaign(tmp_path: Path) -> None:
    store = CampaignStore(str(tmp_path / "c"))
    with pytest.raises(NotACampaignError, match=r"is not a campaign \(no campaign.yaml\): start it with `milepost run"):
        store.load_recipe()
    recipe = load_recipe(ROOT / "recipes/tiny-arith.yaml", ["seed=7"])
    store.write_text_atomic("campaign.yaml", dump_recipe(recipe))
    assert store.is_campaign() and store.load_recipe() == recipe


# --- a campaign started before the rename -----------------------------------------------------------
def _old_record(store: CampaignStore, block: int, old_name: str, doc: dict) -> None:
    """A record as milepost wrote it before issue 19: under the stage's old name."""
    store.write_json(f"blocks/{block:06d}/{old_name}.json", doc)


@pytest.fixture
def old_campaign(tmp_path: Path) -> CampaignStore:
    """Block 0 done and block 1 interrupted after run_steps finished, all under the old names."""
    store = CampaignStore(str(tmp_path / "old"))
    store.write_text_atomic("campaign.yaml", dump_recipe(load_recipe(ROOT / "recipes/tiny-arith.yaml",
                                                                     ["campaign.num_blocks=3"])))
    for old in ("launch_ray", "rollout"):
        _old_record(store, 0, old, {"state": "released"})
    _old_record(store, 0, "train", {"state": "done", "steps": [1, 10], "model_sha256": "ab" * 32})
    _old_record(store, 0, "sync", {"state": "done", "step": 10})
    _old_record(store, 0, "evaluate", {"state": "done", "eval": {"accuracy": 0.5}})
    _old_record(store, 1, "launch_ray", {"state": "done", "launched_at": 5.0})  # a killed run's: not released
    _old_record(store, 1, "rollout", {"state": "done", "engine_urls": ["http://127.0.0.1:1"]})
    _old_record(store, 1, "train", {"state": "done", "started_at": 10.0, "finished_at": 70.0, "pid": 4242,
                                    "steps": [11, 20]})
    return store


def test_old_name_records_count_as_the_new_stages(old_campaign: CampaignStore) -> None:
    from milepost.tasks.progression import next_block
    from milepost.tasks.status import campaign_status

    store = old_campaign
    assert store.stage_done(1, Stage.RUN_STEPS) and store.stage_record(1, "train") == store.stage_record(1, "run_steps")
    assert store.stage_record(1, Stage.START_RAY).state is StageState.DONE
    assert next_block(store, store.load_recipe()) == 1
    blocks = campaign_status(store.url)["blocks"]
    assert blocks[0]["state"] == "done" and blocks[0]["stages_done"] == ["run_steps", "publish", "evaluate"]
    assert blocks[1]["state"] == "interrupted"
    assert blocks[1]["stages_done"] == ["start_ray", "start_engines", "run_steps"]


def test_a_campaign_started_before_the_rename_resumes(old_campaign: CampaignStore) -> None:
    """What a resumed block does first, on old-name records: teardown releases what the killed
    run left (writing the new names), and run_steps, recorded done under `train`, is not run again."""
    from milepost.tasks.stage import run_stage

    store = old_campaign
    run_stage(store.url, 1, Stage.TEARDOWN)  # nothing recorded to stop: no mode, no running record
    for stage in (Stage.START_RAY, Stage.START_ENGINES):
        assert store.read_json(stage_record_path(1, stage))["state"] == "released"
    assert store.stage_record(1, Stage.START_RAY).outputs["launched_at"] == 5.0  # the old record, carried over
    done = run_stage(store.url, 1, "run_steps")  # would need Ray and a fleet if it ran
    assert done.pid == 4242 and done.outputs["steps"] == [11, 20]
    assert not store.exists(stage_record_path(1, Stage.RUN_STEPS))  # returned as recorded, nothing rewritten


def test_a_failure_recorded_under_an_old_name_is_reported_under_the_new_one(tmp_path: Path) -> None:
    from milepost.tasks.status import campaign_status

    store = CampaignStore(str(tmp_path / "c"))
    store.write_text_atomic("campaign.yaml", "seed: 1\n")
    _old_record(store, 0, "launch_ray", {"state": "released"})
    _old_record(store, 0, "train", {"state": "failed", "error": "RuntimeError: gone", "failed_at": 3.0})
    block = json.loads(json.dumps(campaign_status(store.url)))["blocks"][0]
    assert block["status"] == "failed: stage run_steps: RuntimeError: gone"
    assert block["failure"]["stage"] == "run_steps"


# --- one source, one direction --------------------------------------------------------------------------
STAGE_NAMES = {s.value for s in Stage} | set(OLD_NAMES)


def _sources(*folders: str) -> list[Path]:
    return [p for f in folders for p in sorted((ROOT / f).rglob("*.py"))]


def test_the_stage_list_is_written_once() -> None:
    """No module but core/records.py spells out a list of stage names (new or old; a list that
    also holds other words, like the recipe's sections `rollout`, `train`, `sync`, is not one)."""
    for path in _sources("core", "tasks", "dags", "slurm", "milepost", "bench"):
        if path == ROOT / "core" / "records.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                assert len(words) < 3 or not set(words) <= STAGE_NAMES, \
                    f"{path.relative_to(ROOT)}:{node.lineno} lists stages {words}: use milepost.core.records.Stage"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("folder, forbidden", [("tasks", ("milepost.dags",)),
                                               ("core", ("milepost.dags", "milepost.tasks", "milepost.slurm"))])
def test_imports_point_down_only(folder: str, forbidden: tuple[str, ...]) -> None:
    wrong = {f"{p.relative_to(ROOT)}: {m}" for p in _sources(folder) for m in _imports(p)
             if m.startswith(forbidden)}
    assert not wrong, f"layering is dags -> tasks -> core: {sorted(wrong)}"


def test_records_are_light_enough_for_dag_parse_time() -> None:
    probe = ("import sys, milepost.core.records; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('fsspec', 'pydantic', 'yaml', 'torch', 'ray', 'airflow', 'psutil')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
