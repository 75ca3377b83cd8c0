"""`milepost status --plot`: the PNG holds the campaign's curves, checked through the figure's
own line data (not pixels), with block starts, a resumed run_steps stage and a rollback marked."""

from __future__ import annotations

from pathlib import Path

from milepost.core.metrics.plot import MARK_LABELS, PANELS, draw, read_curves
from milepost.core.store import CampaignStore

STEPS_PER_BLOCK = 3


def _campaign(root: Path) -> CampaignStore:
    """A store as two blocks of a campaign leave it (through the store's own writers)."""
    store = CampaignStore(str(root))
    store.write_text_atomic("campaign.yaml", f"campaign:\n  steps_per_block: {STEPS_PER_BLOCK}\n")
    store.write_json("base_eval.json", {"accuracy": 0.1, "num_prompts": 16})
    for block in (0, 1):
        steps = range(block * STEPS_PER_BLOCK + 1, (block + 1) * STEPS_PER_BLOCK + 1)
        store.write_metrics(block, [{"step": s, "rollout/reward_mean": s / 10, "loss/kl": s / 100,
                                     "loss/entropy": 1 - s / 10, "rollout/response_len_mean": 4 + s,
                                     "rollout/staleness": float(s % 2), "timing/step_s": 0.5 + s,
                                     "data/prompt_indices": [s]} for s in steps])
        store.write_stage_record(block, "evaluate", {"state": "done", "eval": {"accuracy": 0.5 + block / 10}})
    store.write_json("blocks/000000/train_starts.json", [{"at": 1.0, "from_step": 0}])
    store.write_json("blocks/000001/train_starts.json", [{"at": 2.0, "from_step": 3}, {"at": 3.0, "from_step": 4}])
    store.write_json("progress.json", {"restored": [{"from_block": 0, "from_step": 3, "as_step": 6}]})
    return store


def _lines(ax, label: str) -> list:
    return [line for line in ax.get_lines() if line.get_label() == label]


def test_plot_draws_every_series_against_step_with_blocks_restarts_and_rollbacks(tmp_path: Path) -> None:
    fig = draw(read_curves(_campaign(tmp_path / "c")), "c")
    axes = {ax.get_gid(): ax for ax in fig.axes}
    assert list(axes) == [key for key, _ in PANELS]
    (reward,) = _lines(axes["rollout/reward_mean"], "rollout/reward_mean")
    assert list(reward.get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert list(reward.get_ydata()) == [s / 10 for s in range(1, 7)]
    (accuracy,) = _lines(axes["eval/accuracy"], "eval/accuracy")
    assert list(accuracy.get_xdata()) == [0, 3, 6] and list(accuracy.get_ydata()) == [0.1, 0.5, 0.6]
    (step_time,) = _lines(axes["timing/step_s"], "timing/step_s")
    assert list(step_time.get_ydata()) == [0.5 + s for s in range(1, 7)]
    for ax in fig.axes:
        assert [line.get_xdata()[0] for line in _lines(ax, MARK_LABELS["block"])] == [0.5, 3.5]
        assert [line.get_xdata()[0] for line in _lines(ax, MARK_LABELS["restart"])] == [4.5]
        assert [line.get_xdata()[0] for line in _lines(ax, MARK_LABELS["rollback"])] == [6.5]


def test_status_plot_writes_a_png_and_exits_0(tmp_path: Path) -> None:
    from milepost.cli import main

    _campaign(tmp_path / "c")
    out = tmp_path / "out.png"
    assert main(["status", str(tmp_path / "c"), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_status_plot_into_a_missing_folder_exits_2(tmp_path: Path, capsys) -> None:
    from milepost.cli import main

    _campaign(tmp_path / "c")
    assert main(["status", str(tmp_path / "c"), "--plot", str(tmp_path / "nope" / "out.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
