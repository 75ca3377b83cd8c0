"""`cluster.placement: shared` end to end (real Ray, the built-in engine behind sglang-router,
torch DDP): async RL (max_staleness 1) with the engine and the trainer on the same bundle and
both resident. The engine never gives its memory back, rollout runs ahead of training by at
most one policy version, and every prompt of the epoch is trained once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import fault_campaign as cp

from milepost.core.data.epoch import epoch_coverage

SHAPE = cp.Shape(num_blocks=1, steps_per_block=6, prompts_per_step=8, samples_per_prompt=4, checkpoint_every=3,
                 warmstart_steps=60, extra=("loop.max_staleness=1", "cluster.placement=shared",
                                            "sync.transport=tensor"))


@pytest.mark.slow
def test_async_on_shared_devices_trains_every_prompt_once_within_the_bound(tmp_path: Path) -> None:
    cache, campaign, log = tmp_path / "cache", tmp_path / "c", tmp_path / "run.log"
    assert cp.run_to_end(campaign, cache, SHAPE.overrides(), log, timeout_s=600) == 0, log.read_text()[-4000:]
    rows = cp.metrics(campaign)
    assert [r["step"] for r in rows] == list(range(1, SHAPE.num_steps + 1))
    coverage = epoch_coverage(rows, SHAPE.num_steps, SHAPE.num_prompts)
    assert coverage.exactly_once, coverage
    assert max(r["rollout/staleness"] for r in rows) <= 1
    assert any(r["rollout/staleness"] == 1 for r in rows), "rollout never ran ahead: was it async?"
    assert not any("timing/engines_release_s" in r for r in rows)  # shared: no memory handover
    assert cp.fleet_doc(campaign)["colocated"] is False  # so engines launch without the memory saver
