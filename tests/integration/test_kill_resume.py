"""SIGKILL `milepost run` at random moments, rerun, and lose or repeat nothing.

Sync mode: the reference campaign runs uninterrupted; the other is killed (SIGKILL, no
clean-up) at seeded-random moments in block 0 and block 1, rerun each time, and must end
with the same `model_sha256`, the same per-step metrics (timings aside) and exactly the same
prompts. Async mode (max_staleness 1): killed at three moments, it must train every prompt
of the epoch exactly once, with every step within the staleness bound.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS_PER_BLOCK = 6
NUM_BLOCKS = 2
PROMPTS_PER_STEP = 8
OVERRIDES = [
    f"campaign.num_blocks={NUM_BLOCKS}", f"campaign.steps_per_block={STEPS_PER_BLOCK}",
    "checkpoint.every_steps=2", f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
    "rollout.num_samples_per_prompt=4", "model.tiny.warmstart_steps=60", "eval.num_prompts=32",
    f"data.num_train_rows={NUM_BLOCKS * STEPS_PER_BLOCK * PROMPTS_PER_STEP}",  # exactly one epoch
    "filters.drop_zero_variance_groups=false",
]
NONDETERMINISTIC = ("timing/",)


def _command(campaign: Path, extra: tuple[str, ...] = ()) -> list[str]:
    sets = [a for o in (*OVERRIDES, *extra) for a in ("--set", o)]
    return [sys.executable, "-m", "milepost.cli", "run", "recipes/tiny-arith.yaml", "--quiet",
            "--campaign", str(campaign), *sets]


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "MILEPOST_CACHE": str(cache)}


def _steps_recorded(campaign: Path) -> int:
    steps = 0
    for metrics in campaign.glob("blocks/*/metrics.jsonl"):
        for line in metrics.read_text().splitlines():
            if line.strip():
                steps = max(steps, json.loads(line)["step"])
    return steps


def _run_to_end(campaign: Path, cache: Path, log: Path, extra: tuple[str, ...] = ()) -> None:
    with open(log, "ab") as out:
        rc = subprocess.run(_command(campaign, extra), env=_env(cache), stdout=out, stderr=subprocess.STDOUT,
                            timeout=600).returncode
    assert rc == 0, log.read_text()[-4000:]


def _run_and_kill(campaign: Path, cache: Path, log: Path, after_step: int, delay_s: float,
                  extra: tuple[str, ...] = ()) -> int:
    """Start a run, SIGKILL it `delay_s` after step `after_step` is in the metrics; the step
    count at the kill."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(_command(campaign, extra), env=_env(cache), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while _steps_recorded(campaign) < after_step:
            assert proc.poll() is None, f"run ended before step {after_step}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, "run made no progress in 600 s"
            time.sleep(0.05)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    return _steps_recorded(campaign)


def _final_state(campaign: Path) -> tuple[str, list[dict]]:
    status = subprocess.run([sys.executable, "-m", "milepost.cli", "status", str(campaign), "--json"],
                            capture_output=True, text=True, timeout=60, check=True)
    doc = json.loads(status.stdout)
    rows = []
    for b in range(NUM_BLOCKS):
        path = campaign / "blocks" / f"{b:06d}" / "metrics.jsonl"
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        for key in [k for k in row if k.startswith(NONDETERMINISTIC)]:
            del row[key]
    return doc["latest_checkpoint"]["model_sha256"], rows


@pytest.mark.slow
def test_sigkilled_sync_campaign_resumes_bitwise_and_trains_each_prompt_once(tmp_path):
    cache = tmp_path / "cache"
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    log = tmp_path / "runs.log"
    _run_to_end(reference, cache, log)
    ref_sha, ref_rows = _final_state(reference)

    rng = random.Random(20261203)
    kills = []
    for lowest, highest in ((1, STEPS_PER_BLOCK - 1), (STEPS_PER_BLOCK + 1, 2 * STEPS_PER_BLOCK - 1)):
        after_step, delay_s = rng.randint(lowest, highest), rng.uniform(0.0, 1.5)
        kills.append((after_step, delay_s, _run_and_kill(killed, cache, log, after_step, delay_s)))
    _run_to_end(killed, cache, log)
    sha, rows = _final_state(killed)

    assert [r["step"] for r in rows] == list(range(1, NUM_BLOCKS * STEPS_PER_BLOCK + 1)), kills
    assert sha == ref_sha, f"kills at {kills}: weights differ from the uninterrupted run"
    for ref_row, row in zip(ref_rows, rows):
        assert row == ref_row, f"step {row['step']} differs after kills at {kills}"
    prompts = [i for r in rows for i in r["data/prompt_indices"]]
    assert len(prompts) == NUM_BLOCKS * STEPS_PER_BLOCK * PROMPTS_PER_STEP
    assert len(set(prompts)) == len(prompts), "a prompt was trained on twice"


@pytest.mark.slow
def test_sigkilled_async_campaign_trains_every_prompt_once_within_the_staleness_bound(tmp_path):
    cache, campaign, log = tmp_path / "cache", tmp_path / "async", tmp_path / "runs.log"
    extra = ("loop.max_staleness=1", "cluster.placement=disaggregated")
    rng = random.Random(20261204)
    kills = []
    for lowest, highest in ((1, 3), (4, STEPS_PER_BLOCK - 1), (STEPS_PER_BLOCK + 1, 2 * STEPS_PER_BLOCK - 2)):
        after_step, delay_s = rng.randint(lowest, highest), rng.uniform(0.0, 1.0)
        kills.append((after_step, delay_s, _run_and_kill(campaign, cache, log, after_step, delay_s, extra)))
    _run_to_end(campaign, cache, log, extra)
    _, rows = _final_state(campaign)

    assert [r["step"] for r in rows] == list(range(1, NUM_BLOCKS * STEPS_PER_BLOCK + 1)), kills
    prompts = sorted(i for r in rows for i in r["data/prompt_indices"])
    assert prompts == list(range(NUM_BLOCKS * STEPS_PER_BLOCK * PROMPTS_PER_STEP)), (
        f"kills at {kills}: the epoch was not trained exactly once")
    assert max(r["rollout/staleness"] for r in rows) <= 1, kills
    assert all(r["rollout/num_samples"] == PROMPTS_PER_STEP * 4 for r in rows)
