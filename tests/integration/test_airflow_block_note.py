"""What a user sees of a block in the Airflow UI, checked through the REST API v2 of a real
Airflow (`milepost airflow up`: `airflow standalone`, SQLite, LocalExecutor, the simple auth
manager with its generated password, as a user runs it), with the local executor.

One tiny block (tiny-arith, 1 block of 2 steps) is triggered with the run id `block_000000`:
- the DAG run's note (set by the progress task through the REST API) holds the held-out
  accuracy, the reward and the regression gate's verdict;
- the evaluate task's log ends with the same table;
- each stage task's log names its stage job's log file, and that file holds the stage's own
  output (run_steps: one line per step with its reward; evaluate: the held-out accuracy);
- timings.json has every stage, and the campaign is `done` in `milepost status --json`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from milepost.core.records import BLOCK_STAGES

# The helper that builds the recipe's tiny model into a cache is shared with tests/faults.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import fault_campaign as cp

ROOT = Path(__file__).resolve().parents[2]
DAG_ID = "milepost_tiny_arith"
RUN_ID = "block_000000"
OVERRIDES = ["campaign.num_blocks=1", "campaign.steps_per_block=2", "rollout.prompts_per_step=8",
             "eval.num_prompts=16", "rollout.num_samples_per_prompt=4", "model.tiny.warmstart_steps=60",
             "data.num_train_rows=16", "filters.drop_zero_variance_groups=false", "checkpoint.every_steps=2"]
GUARD_S = 900  # against hanging forever, not a timing assertion


class Api:
    """The REST API v2 as a logged-in user: a JWT from POST /auth/token."""

    def __init__(self, url: str, password_file: str) -> None:
        self.url = url
        user, password = next(iter(json.loads(Path(password_file).read_text()).items()))
        request = urllib.request.Request(f"{url}/auth/token", method="POST",
                                         data=json.dumps({"username": user, "password": password}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            self.token = json.loads(r.read())["access_token"]

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
        request = urllib.request.Request(f"{self.url}/api/v2{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", "Accept": "application/json",
                                                  "Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def task_instances(self, run_id: str) -> dict[str, dict]:
        status, doc = self.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances")
        assert status == 200, doc
        return {t["task_id"]: t for t in doc["task_instances"]}

    def task_log(self, run_id: str, task_id: str) -> str:
        """The task's log of its last try, as text (the UI shows the same events)."""
        tries = self.task_instances(run_id)[task_id]["try_number"]
        status, doc = self.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{tries}"
                                       "?full_content=true")
        assert status == 200, doc
        return "\n".join(e if isinstance(e, str) else str(e.get("event", "")) for e in doc["content"])


@pytest.fixture(scope="module")
def airflow(tmp_path_factory) -> Any:
    from milepost import airflow_cmd

    work = tmp_path_factory.mktemp("airflow")
    cache = work / "cache"
    listing = work / "campaigns.yaml"
    listing.write_text(f"- recipe: {ROOT / 'recipes' / 'tiny-arith.yaml'}\n  campaign_url: {work / 'default'}\n"
                       "  poll_interval_s: 2\n  retry_delay_s: 5\n")
    cp.build_model(cache, OVERRIDES)  # built once here, so that no stage job pays for it
    state = airflow_cmd.up(work, parallelism=2,
                           env_extra={"MILEPOST_CAMPAIGNS_FILE": str(listing), "MILEPOST_CACHE": str(cache)})
    try:
        assert state["password_file"], f"the simple auth manager wrote no password file; see {state['log']}"
        api = Api(state["url"], state["password_file"])
        deadline = time.monotonic() + 180
        while api.call("GET", f"/dags/{DAG_ID}")[0] != 200:  # the dag processor's first parse
            assert time.monotonic() < deadline, f"{DAG_ID} never appeared; see {state['log']}"
            time.sleep(2)
        assert api.call("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})[0] == 200
        api.work = work
        yield api
    finally:
        assert airflow_cmd.down(work), "the standalone was not running any more at the end"


def _wait(api: Api, run_id: str) -> dict:
    deadline = time.monotonic() + GUARD_S
    while True:
        status, run = api.call("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")
        assert status == 200, run
        if run["state"] in ("success", "failed"):
            return run
        assert time.monotonic() < deadline, f"{run_id} not done after {GUARD_S}s: {api.task_instances(run_id)}"
        time.sleep(2.0)


def test_a_blocks_run_shows_its_summary_note_and_its_stages_own_logs(airflow) -> None:
    campaign = airflow.work / "campaign"
    status, run = airflow.call("POST", f"/dags/{DAG_ID}/dagRuns", {
        "dag_run_id": RUN_ID, "logical_date": None,
        "conf": {"campaign_url": str(campaign), "block": 0, "overrides": OVERRIDES}})
    assert status == 200, run
    run = _wait(airflow, RUN_ID)
    tasks = airflow.task_instances(RUN_ID)
    assert run["state"] == "success", {t: (v["state"], v["try_number"]) for t, v in tasks.items()}
    assert "000000" in run["dag_run_id"]

    # The note: what the block achieved, without opening a log.
    evaluate = json.loads((campaign / "blocks/000000/evaluate.json").read_text())
    accuracy = f"{evaluate['eval']['accuracy']:.3f}"
    rewards = [json.loads(line)["rollout/reward_mean"]
               for line in (campaign / "blocks/000000/metrics.jsonl").read_text().splitlines()]
    note = run["note"] or ""
    assert note.startswith(f"**milepost block 0**: accuracy {accuracy}, gate pass"), note
    assert f"| held-out accuracy | {accuracy} (base policy " in note, note
    assert f"| reward (last step / block mean) | {rewards[-1]:.3f} / {sum(rewards) / len(rewards):.3f} |" in note
    assert "| regression gate | pass" in note and "| steps | 1–2 (2 steps) |" in note
    assert (campaign / "blocks/000000/summary.md").read_text().strip() == note.strip()
    # The note names the block's self-contained page: the table, the plot inline, the steps.
    assert f"| report | {campaign}/blocks/000000/report.html |" in note, note
    page = (campaign / "blocks/000000/report.html").read_text()
    assert f"<td>held-out accuracy</td><td class=n>{accuracy}" in page and "data:image/png;base64," in page

    # The evaluate task's log ends with the same table.
    evaluate_log = airflow.task_log(RUN_ID, "evaluate")
    assert note.splitlines()[-1] in evaluate_log and "| regression gate | pass" in evaluate_log, evaluate_log[-3000:]

    # Each stage task's log points to its job's log, which holds the stage's own output.
    for stage, expected in (("run_steps", [r"step 1: reward \d\.\d{3}", r"step 2: reward", "block 0 run_steps done"]),
                            ("evaluate", [f"held-out accuracy {accuracy}"])):
        task_log = airflow.task_log(RUN_ID, stage)
        # The first try names it when it submits the job; a retry of a stage already done
        # (apache/airflow#67287 hides the first try's log) names it too.
        pointed = re.search(r"(?:goes to|its log:) (\S+_log\.err)", task_log)
        assert pointed, task_log[-3000:]
        job_log = Path(pointed.group(1)).read_text()
        for pattern in expected:
            assert re.search(pattern, job_log), (stage, pattern, job_log[-3000:])
        assert not re.search(r"\b1[789]\d{8}\.\d+\b", task_log), "a raw epoch timestamp in the task log"

    # Nothing failed here, so a retry is Airflow's false "Up For Retry" after a success: the
    # retry ends at once, saying when the earlier try ran, in local time.
    for stage in BLOCK_STAGES:
        if tasks[stage]["try_number"] > 1:
            retry_log = airflow.task_log(RUN_ID, stage)
            ran = r"already done by an earlier try: ran \d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
            assert re.search(ran, retry_log), retry_log
    timings = json.loads((campaign / "blocks/000000/timings.json").read_text())["stages"]
    assert set(BLOCK_STAGES) <= set(timings)

    status_doc = json.loads(subprocess.run([sys.executable, "-m", "milepost.cli", "status", str(campaign), "--json"],
                                           cwd=ROOT, check=True, capture_output=True, text=True).stdout)
    assert status_doc["blocks"][0]["status"] == "done" and status_doc["blocks"][0]["gate"] == "pass"
