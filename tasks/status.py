"""`milepost status`: what a campaign has done, read from its store only.

Each block is in one state, and the text after it says why:
- `done`: its evaluate finished (with the regression gate's verdict once judged);
- `paused: <reason>`: the regression gate paused the campaign after this block (or a stop
  was requested after it); `milepost run --resume` continues;
- `running: <stage>`: only while a live process holds the campaign's lease (a `milepost run`
  whose pid still exists, or an Airflow run whose lease has not expired);
- `failed: <root error>`: a stage recorded a failure, and no live run is retrying the block;
- `interrupted`: started, neither done nor failed, and nothing holds the lease any more (a
  killed run): `milepost run` resumes it from its last checkpoint;
- `pending`: nothing of it ran yet.
"""

from __future__ import annotations

import time
from typing import Any

from milepost.core.checkpoint import CheckpointManager
from milepost.core.records import GATE_DOC, Stage, StageRecord, StageState, block_path
from milepost.core.store import CampaignStore
from milepost.tasks.failures import block_failure, stage_failure

# The metrics a block's line shows (the last step's), in order: (key, label, format).
LAST_METRICS = (("rollout/reward_mean", "reward", ".3f"), ("loss/kl", "kl", ".4f"),
                ("rollout/response_len_mean", "response len", ".1f"), ("timing/step_s", "step s", ".1f"))


def live_lease(store: CampaignStore, now: float | None = None) -> dict[str, Any] | None:
    """The campaign's lease when a live process holds it: not expired, and, for a local
    `milepost run`, its process still exists. None otherwise."""
    from milepost.tasks.lease import _stale_local_process, read_lease  # one liveness rule for both

    lease = read_lease(store)
    if not lease or float(lease.get("expires_at", 0.0)) <= (now or time.time()) or _stale_local_process(lease):
        return None
    return lease


def _last_metrics(store: CampaignStore, index: int) -> dict[str, Any]:
    rows = store.read_metrics(index)
    if not rows:
        return {}
    last = rows[-1]
    return {"step": last.get("step"), **{key: last[key] for key, _, _ in LAST_METRICS if key in last}}


def block_state(records: dict[Stage, StageRecord | None], lease: dict[str, Any] | None,
                paused: dict[str, Any] | None) -> tuple[str, str]:
    """(state, why) of one block from its stage records, the live lease (or None) and the
    campaign's pause (when it names this block)."""
    evaluated = records.get(Stage.EVALUATE)
    if evaluated and evaluated.done:
        return ("paused", paused["reason"]) if paused else ("done", "")
    running = [s for s in Stage if (r := records.get(s)) and r.state is StageState.RUNNING]
    failed = block_failure(records.get)
    if lease and (running or not failed):
        return "running", running[0].value if running else "between stages"
    if failed:
        stage, record = failed
        return "failed", f"stage {stage}: {record.error or 'no error recorded'}"
    if any(records.values()):
        return "interrupted", ("no live process holds the campaign's lease (the run was stopped or killed); "
                               "`milepost run` resumes it from its last checkpoint")
    return "pending", ""


def _block_doc(store: CampaignStore, index: int, lease: dict[str, Any] | None,
               progress: dict[str, Any], newest: bool) -> dict[str, Any]:
    records = {s: store.stage_record(index, s) for s in Stage}
    evaluated = records[Stage.EVALUATE]
    paused = progress.get("paused") if (progress.get("paused") or {}).get("block") == index else None
    if paused is None and newest and progress.get("stop_requested") and evaluated and evaluated.done:
        paused = {"reason": f"a stop was requested ({progress['stop_requested'].get('by')})"}
    state, why = block_state(records, lease if newest else None, paused)
    gate_rel = block_path(index, GATE_DOC)
    doc = {"index": index, "state": state, "status": f"{state}: {why}" if why else state,
           "stages_done": [s.value for s in Stage if (r := records[s]) and r.done],
           "eval": dict(evaluated.outputs.get("eval", {})) if evaluated else {},
           "gate": store.read_json(gate_rel).get("verdict") if store.exists(gate_rel) else None,
           "last_metrics": _last_metrics(store, index)}
    failed = block_failure(records.get)
    if failed and state == "failed":
        stage, record = failed
        doc["failure"] = {"stage": stage.value, "error": record.error, "error_kind": record.error_kind,
                          "log": record.log, "failed_at": record.failed_at}
    return doc


def campaign_status(url: str) -> dict[str, Any]:
    from milepost.tasks.progression import read_progress

    store = CampaignStore(url)
    if not store.is_campaign():
        raise ValueError(f"{url} is not a campaign (no campaign.yaml); pass the folder given to "
                         "`milepost run --campaign`")
    lease = live_lease(store)
    progress = read_progress(store)
    indices = store.block_indices()
    # Only the newest block can be the one a live run is working on.
    blocks = [_block_doc(store, i, lease, progress, i == indices[-1]) for i in indices]
    # Sizes only: status is read often, and a resume hashes the checkpoint it takes anyway.
    latest = CheckpointManager(store.local_path("checkpoints")).latest_valid(deep=False)
    latest_doc = None
    if latest:
        latest_doc = {"step": latest.step, "policy_version": latest.state["policy_version"],
                      "model_sha256": latest.state["model_sha256"]}
    base = store.read_json("base_eval.json") if store.exists("base_eval.json") else None
    return {"campaign": url, "blocks": blocks, "steps_done": latest.step if latest else 0,
            "latest_checkpoint": latest_doc, "base_eval": base,
            "lease": {"owner": lease["owner"], "expires_at": lease["expires_at"]} if lease else None}


def _metrics_text(metrics: dict[str, Any]) -> str:
    if not metrics:
        return ""
    shown = [f"{label} {float(metrics[key]):{fmt}}" for key, label, fmt in LAST_METRICS if key in metrics]
    return f"; last step {metrics.get('step')}: " + ", ".join(shown)


def format_status(status: dict[str, Any]) -> str:
    lines = [f"campaign {status['campaign']}: {status['steps_done']} steps done"]
    if status.get("lease"):
        lines.append(f"  being run by {status['lease']['owner']}")
    if status.get("base_eval"):
        lines.append(f"  base policy accuracy: {status['base_eval'].get('accuracy', float('nan')):.3f}")
    for b in status["blocks"]:
        acc = b["eval"].get("accuracy")
        numbers = f"accuracy {acc:.3f}" if acc is not None else "no eval yet"
        if b.get("gate"):
            numbers += f", gate {b['gate']}"
        lines.append(f"  block {b['index']}: {b['status']}")
        lines.append(f"    {numbers}{_metrics_text(b.get('last_metrics') or {})}")
        if b.get("failure"):
            f = b["failure"]
            failure = StageRecord(StageState.FAILED, error=f["error"], error_kind=f["error_kind"], log=f["log"])
            lines.append(f"    {f['error_kind'] or 'unclassified'} error; {stage_failure(failure, '')}")
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
