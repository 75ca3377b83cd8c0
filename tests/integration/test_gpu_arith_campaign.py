"""recipes/gpu-arith.yaml through bench/gpu_arith.py on the CPU, shrunk by `--set` (a 2-layer
model, 2 blocks of 4 steps): the driver the lent H200 runs, end to end on a real local Ray
with the recipe's Megatron trainer, colocated built-in engine and tensor weight sync. Its
run_steps stage is SIGKILLed in block 0 after the step-2 checkpoint and run again; the run
must then have trained every prompt of the epoch exactly once, and report the either-form
accuracy of the base policy and of each block. Learning is the GPU run's to show (a model
this small, warm-started for seconds, learns no three-digit sums)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKS, STEPS, PROMPTS = 2, 4, 4
SHRUNK = [
    "model.gpu_arith.hidden_size=64", "model.gpu_arith.num_layers=2", "model.gpu_arith.num_heads=4",
    "model.gpu_arith.num_kv_heads=2", "model.gpu_arith.intermediate_size=128",
    "model.gpu_arith.warmstart_steps=20", "model.gpu_arith.warmstart_batch_size=32",
    "model.gpu_arith.warmstart_warmup_steps=5",
    f"campaign.num_blocks={BLOCKS}", f"campaign.steps_per_block={STEPS}", "checkpoint.every_steps=2",
    f"rollout.prompts_per_step={PROMPTS}", "rollout.num_samples_per_prompt=4", "rollout.max_batch_size=64",
    f"data.num_train_rows={BLOCKS * STEPS * PROMPTS}", "data.num_eval_rows=16", "eval.num_prompts=16",
    "filters.drop_zero_variance_groups=false",  # an untrained model's groups are mostly all-wrong
]


@pytest.mark.slow
@pytest.mark.extended  # about 4-5 min on 2 cores: CI proves kill/resume through tests/faults
def test_gpu_arith_driver_kills_run_steps_resumes_and_trains_every_prompt_once(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    sets = [a for s in SHRUNK for a in ("--set", s)]
    env = {**os.environ, "OUT": str(out), "MILEPOST_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "bench/gpu_arith.py", "--campaign", str(tmp_path / "campaign"), *sets],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "gpu_arith.json").read_text())

    kill = result["kill"]
    assert kill["block"] == 0 and kill["checkpoint_step"] == 2 and kill["killed_at_step"] >= 3, kill
    assert len(result["blocks"][0]["stages_s"]["run_steps"]) == 2  # killed, then run again
    assert result["coverage"] == {"lost": 0, "repeated": 0, "steps_ok": True, "one_epoch": True}
    assert result["resumed_exactly_once"] is True and result["gpu_arith_resumed_exactly_once"] is True
    for figure in ("gpu_arith_base_either_form", "gpu_arith_final_either_form"):
        assert 0.0 <= result[figure] <= 1.0
    assert [b["eval"]["num_prompts"] for b in result["blocks"]] == [16.0, 16.0]
    assert result["model"]["report"]["device"] == "cpu" and set(result["phases_s"]) == {"build", "block_0", "block_1"}
    for block in range(BLOCKS):  # teardown released each block's Ray cluster
        start = json.loads((tmp_path / "campaign" / "blocks" / f"{block:06d}" / "start_ray.json").read_text())
        assert start["state"] == "released"
    assert (out / "logs" / "b0-run_steps-1.log").is_file()
    # each step's train time split: the trainer's phases (synced) and the colocated memory handover
    for row in (r for b in result["blocks"] for r in b["steps"]):
        parts = [row[f"timing/{k}_s"] for k in ("train_batch", "train_forward_backward", "train_optimizer",
                                                "engines_release", "engines_resume")]
        assert all(p >= 0.0 for p in parts) and sum(parts) <= row["timing/train_s"] + 1e-6, row
