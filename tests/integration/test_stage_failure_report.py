"""A stage that fails shows its root error where the user looks: `milepost run`'s own output,
`milepost status`, the stage record. A runtime failure is retried; a user error is not."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

OVERRIDES = ["campaign.num_blocks=1", "campaign.steps_per_block=2", "rollout.prompts_per_step=4",
             "rollout.num_samples_per_prompt=2", "model.tiny.warmstart_steps=40", "eval.num_prompts=8"]

ROLLOUT_PLUGIN = '''
from milepost.core.errors import UserError
from milepost.core.rollout import default_rollout

def runtime_failure(request, router):
    raise RuntimeError("the disk under /scratch went away")

def user_failure(request, router):
    raise UserError("my_rollout: prompt template needs a {question} field; add it to the recipe")
'''


def _run(tmp_path: Path, function: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path, float]:
    plugin = tmp_path / "my_rollout.py"
    plugin.write_text(ROLLOUT_PLUGIN)
    campaign = tmp_path / "campaign"
    sets = [a for o in (*OVERRIDES, f"rollout.function={plugin}:{function}", *extra) for a in ("--set", o)]
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "milepost.cli", "run", "recipes/tiny-arith.yaml", "--quiet",
                           "--campaign", str(campaign), *sets], capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "MILEPOST_CACHE": str(tmp_path / "cache")})
    return proc, campaign, time.monotonic() - started


def _assert_no_secret_outside_its_file(campaign: Path, name: str) -> None:
    """The campaign's token is in secrets/<name> (owner-only) and in no record, log or recipe."""
    secret = campaign / "secrets" / name
    assert secret.stat().st_mode & 0o077 == 0
    token = secret.read_text().strip().encode()
    leaks = [p for p in campaign.rglob("*") if p.is_file() and p != secret and token in p.read_bytes()]
    assert not leaks, f"the {name} appears in {leaks}"


def _status(campaign: Path) -> tuple[str, dict]:
    text = subprocess.run([sys.executable, "-m", "milepost.cli", "status", str(campaign)],
                          capture_output=True, text=True, timeout=60).stdout
    doc = json.loads(subprocess.run([sys.executable, "-m", "milepost.cli", "status", str(campaign), "--json"],
                                    capture_output=True, text=True, timeout=60).stdout)
    return text, doc


def test_a_runtime_failure_shows_its_root_error_in_run_output_and_status(tmp_path):
    proc, campaign, _ = _run(tmp_path, "runtime_failure", "cluster.max_block_retries=0")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "stage run_steps failed (runtime error): RuntimeError: the disk under /scratch went away" in output
    record = json.loads((campaign / "blocks/000000/run_steps.json").read_text())
    assert record["state"] == "failed" and record["error_kind"] == "runtime"
    assert Path(record["log"]).is_file() and "Traceback" in Path(record["log"]).read_text()
    assert f"stage log: {record['log']}" in output
    _assert_no_secret_outside_its_file(campaign, "ray_auth_token")
    text, doc = _status(campaign)
    assert doc["blocks"][0]["state"] == "failed"
    assert doc["blocks"][0]["failure"]["stage"] == "run_steps"
    assert "RuntimeError: the disk under /scratch went away" in text


def test_a_user_error_in_a_stage_is_shown_without_traceback_and_not_retried(tmp_path):
    # One retry allowed: a runtime failure would run the block twice; a user error runs once.
    proc, campaign, _ = _run(tmp_path, "user_failure", "cluster.max_block_retries=1")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert ("stage run_steps failed (input error, not retried): UserError: my_rollout: prompt template needs a "
            "{question} field; add it to the recipe") in output
    assert "launching it again" not in output and "Traceback" not in output
    record = json.loads((campaign / "blocks/000000/run_steps.json").read_text())
    assert record["error_kind"] == "user"
    # The stage's own output ends with the message and holds no traceback (what follows it is
    # submitit's report that the job's command exited non-zero).
    own = Path(record["log"]).read_text().split("submitit ERROR")[0]
    assert "Traceback" not in own
    assert own.rstrip().endswith("milepost: block 0 stage run_steps: my_rollout: prompt template needs a {question} "
                                 "field; add it to the recipe")
    # The Airflow task ran once: no retry of a deterministic failure.
    task_log = (campaign / "airflow/logs/block_000000.log").read_text()
    assert task_log.count("input error, not retried") >= 1
    assert task_log.count("block 0 run_steps: submitted") == 1
