"""`milepost status`: what a campaign has done, read from its store only."""

from __future__ import annotations

from typing import Any

from milepost.core.checkpoint import CheckpointManager
from milepost.core.store import CampaignStore
from milepost.tasks.failures import BLOCK_STAGES, block_failure, stage_failure


def campaign_status(url: str) -> dict[str, Any]:
    store = CampaignStore(url)
    if not store.exists("campaign.yaml"):
        raise ValueError(f"{url} is not a campaign (no campaign.yaml); pass the folder given to "
                         "`milepost run --campaign`")
    blocks = []
    for index in store.block_indices():
        records = {s: store.stage_record(index, s) for s in BLOCK_STAGES}
        done = [s for s, r in records.items() if r and r.get("state") == "done"]
        failed = block_failure(records.get)
        state = "done" if records.get("evaluate") and "evaluate" in done else (
            "failed" if failed else "running" if done else "pending")
        evaluation = (records.get("evaluate") or {}).get("eval", {})
        doc = {"index": index, "state": state, "stages_done": done, "eval": evaluation}
        if failed and state == "failed":
            stage, record = failed
            doc["failure"] = {"stage": stage, "error": record.get("error"), "error_kind": record.get("error_kind"),
                              "log": record.get("log"), "failed_at": record.get("failed_at")}
        blocks.append(doc)
    # Sizes only: status is read often, and a resume hashes the checkpoint it takes anyway.
    latest = CheckpointManager(store.local_path("checkpoints")).latest_valid(deep=False)
    latest_doc = None
    if latest:
        latest_doc = {"step": latest.step, "policy_version": latest.state["policy_version"],
                      "model_sha256": latest.state["model_sha256"]}
    base = store.read_json("base_eval.json") if store.exists("base_eval.json") else None
    return {"campaign": url, "blocks": blocks, "steps_done": latest.step if latest else 0,
            "latest_checkpoint": latest_doc, "base_eval": base}


def format_status(status: dict[str, Any]) -> str:
    lines = [f"campaign {status['campaign']}: {status['steps_done']} steps done"]
    if status.get("base_eval"):
        lines.append(f"  base policy accuracy: {status['base_eval'].get('accuracy', float('nan')):.3f}")
    for b in status["blocks"]:
        acc = b["eval"].get("accuracy")
        shown = f"accuracy {acc:.3f}" if acc is not None else "no eval yet"
        lines.append(f"  block {b['index']}: {b['state']:8s} {shown}")
        if b.get("failure"):
            f = b["failure"]
            lines.append(f"    stage {f['stage']} failed ({f['error_kind']} error): "
                         f"{stage_failure({'state': 'failed', **f}, '')}")
    ck = status["latest_checkpoint"]
    if ck:
        lines.append(f"  latest checkpoint: step {ck['step']}, policy v{ck['policy_version']}, "
                     f"sha256 {ck['model_sha256'][:12]}…")
    return "\n".join(lines)


def write_plot(url: str, out_path: str) -> None:
    """`--plot`: the campaign's curves (core/metrics/plot.py) into `out_path`. ValueError, saying
    what to do, when matplotlib is missing or the file cannot be written."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib, which is not installed here: pip install 'milepost[plot]'")
    out = Path(out_path)
    if not out.parent.is_dir():
        raise ValueError(f"--plot {out_path}: folder {out.parent} does not exist; create it or pick another path")
    from milepost.core.metrics.plot import plot_campaign

    try:
        plot_campaign(url, out_path)
    except OSError as e:
        raise ValueError(f"--plot {out_path}: cannot write it ({e.strerror}); pick a writable path") from None
