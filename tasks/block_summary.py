"""What one block achieved, as one table: the DAG run's note in the Airflow UI, the end of the
evaluate and progress task logs, `blocks/N/summary.md`, (with matplotlib) the campaign's
curves so far in `blocks/N/report.png`, and `blocks/N/report.html` holding both and the steps.

Read from the store only: the stage records, the block's metrics.jsonl, gate.json (the
regression gate's verdict), base_eval.json and timings.json. Standard library only at import
(the DAG's operators import it at run time); the plot imports matplotlib when drawn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from milepost.core.records import GATE_DOC, TIMINGS_DOC, Stage, StageRecord, block_path
from milepost.core.store import CampaignStore

# Airflow 3.3.2 refuses a DAG-run note longer than this (DAGRunPatchBody.note, max_length).
NOTE_MAX_CHARS = 1000
REPORT_PNG = "report.png"
REPORT_HTML = "report.html"  # written by tasks/block_html.py
SUMMARY_MD = "summary.md"


@dataclass(frozen=True)
class BlockSummary:
    block: int
    steps: tuple[int, int] | None           # first and last step of the block
    accuracy: float | None                  # held-out accuracy after the block
    previous_accuracy: float | None         # the block before's, or the base policy's for block 0
    previous_label: str                     # "block 3" / "base policy"
    reward_last: float | None               # rollout/reward_mean of the block's last step
    reward_mean: float | None               # mean over the block's steps
    gate: str | None                        # "pass" | "regressed" | None (not judged yet)
    gate_detail: str
    checkpoint_step: int | None
    model_sha256: str | None
    wall_time_s: float | None               # first stage submitted → evaluate finished
    report_path: str | None                 # the PNG of the campaign's curves, when drawn
    html_path: str | None = None            # blocks/N/report.html (table, plot, steps), when written


def human_duration(seconds: float) -> str:
    """`45 s`, `2 min 15 s`, `3 h 04 min`, `2 d 5 h`: what a person reads at a glance."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{s // 3600} h {(s % 3600) // 60:02d} min"
    return f"{s // 86400} d {(s % 86400) // 3600} h"


def human_time(epoch_s: float | None) -> str:
    """A timestamp as local date and time with its zone, never a raw epoch number."""
    if not epoch_s:
        return "unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(epoch_s)))


def _previous_accuracy(store: CampaignStore, block: int) -> tuple[float | None, str]:
    if block == 0:
        base = store.read_json("base_eval.json") if store.exists("base_eval.json") else {}
        return base.get("accuracy"), "base policy"
    return (store.block_eval(block - 1) or {}).get("accuracy"), f"block {block - 1}"


def _wall_time(store: CampaignStore, block: int) -> float | None:
    """From the first stage's submission (or start) to evaluate's end, retries included."""
    rel = block_path(block, TIMINGS_DOC)
    timings = (store.read_json(rel) if store.exists(rel) else {}).get("stages", {})
    starts = [float(t["submitted_at"]) for t in timings.values() if t.get("submitted_at")]
    launch = store.stage_record(block, Stage.START_RAY)
    if launch and launch.started_at:
        starts.append(float(launch.started_at))
    evaluated = store.stage_record(block, Stage.EVALUATE)
    end = evaluated.finished_at if evaluated else None
    return float(end) - min(starts) if starts and end else None


def _gate(store: CampaignStore, block: int) -> tuple[str | None, str]:
    rel = block_path(block, GATE_DOC)
    if not store.exists(rel):
        return None, "not judged yet"
    doc = store.read_json(rel)
    if doc.get("best_block") is None or doc.get("max_eval_drop") is None:
        return doc["verdict"], "first block judged" if doc.get("best_block") is None else "no limit set"
    return doc["verdict"], (f"best block {doc['best_block']} {doc['best_accuracy']:.3f}, "
                            f"max drop {doc['max_eval_drop']}")


def read_block_summary(store: CampaignStore, block: int) -> BlockSummary:
    """The block's numbers as the store holds them now (fields missing so far are None)."""
    steps = _outputs(store, block, Stage.RUN_STEPS)
    published = _outputs(store, block, Stage.PUBLISH)
    evaluation = _outputs(store, block, Stage.EVALUATE).get("eval") or {}
    rewards = [float(r["rollout/reward_mean"]) for r in store.read_metrics(block) if "rollout/reward_mean" in r]
    previous, label = _previous_accuracy(store, block)
    gate, detail = _gate(store, block)
    png, page = block_path(block, REPORT_PNG), block_path(block, REPORT_HTML)
    return BlockSummary(
        block=block, steps=tuple(steps["steps"]) if steps.get("steps") else None,
        accuracy=evaluation.get("accuracy"), previous_accuracy=previous, previous_label=label,
        reward_last=rewards[-1] if rewards else None,
        reward_mean=sum(rewards) / len(rewards) if rewards else None,
        gate=gate, gate_detail=detail, checkpoint_step=published.get("step"),
        model_sha256=steps.get("model_sha256"), wall_time_s=_wall_time(store, block),
        report_path=store.local_path(png) if store.exists(png) else None,
        html_path=store.path(page) if store.exists(page) else None)


def _outputs(store: CampaignStore, block: int, stage: Stage) -> dict[str, Any]:
    """What the stage recorded of its own so far (empty when it has no record yet)."""
    record = store.stage_record(block, stage)
    return dict(record.outputs) if record else {}


def _num(value: float | None, fmt: str = ".3f") -> str:
    return "—" if value is None else format(value, fmt)


def summary_rows(s: BlockSummary) -> list[tuple[str, str]]:
    """(what, value) rows of the table, in reading order."""
    steps = f"{s.steps[0]}–{s.steps[1]} ({s.steps[1] - s.steps[0] + 1} steps)" if s.steps else "—"
    versus = ""
    if s.accuracy is not None and s.previous_accuracy is not None:
        versus = f" ({s.previous_label} {s.previous_accuracy:.3f}, {s.accuracy - s.previous_accuracy:+.3f})"
    gate = {"pass": "pass", "regressed": "REGRESSED: campaign paused"}.get(s.gate or "", "not judged yet")
    checkpoint = "—" if s.checkpoint_step is None else f"step {s.checkpoint_step}" + (
        f", sha256 {s.model_sha256[:12]}" if s.model_sha256 else "")
    return [("steps", steps), ("held-out accuracy", _num(s.accuracy) + versus),
            ("reward (last step / block mean)", f"{_num(s.reward_last)} / {_num(s.reward_mean)}"),
            ("regression gate", gate + (f" ({s.gate_detail})" if s.gate else "")),
            ("checkpoint", checkpoint),
            ("wall time", "—" if s.wall_time_s is None else human_duration(s.wall_time_s)),
            ("plot", s.report_path or "not drawn (pip install 'milepost[plot]')")] + (
                [("report", s.html_path)] if s.html_path else [])


def format_summary(s: BlockSummary) -> str:
    """A Markdown table (the Airflow UI renders a note as Markdown; a log shows it as text)."""
    # The UI shows only this first line until the note is opened: the three numbers a user looks for.
    head = (f"**milepost block {s.block}**: accuracy {_num(s.accuracy)}, gate {s.gate or 'not judged yet'}, "
            f"reward {_num(s.reward_mean)}")
    rows = summary_rows(s)
    table = "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])
    text = f"{head}\n\n{table}"
    if len(text) > NOTE_MAX_CHARS and (s.report_path or s.html_path):  # a very deep store path: keep the numbers
        return format_summary(replace(s, report_path=s.report_path and block_path(s.block, REPORT_PNG),
                                      html_path=s.html_path and block_path(s.block, REPORT_HTML)))
    return text[:NOTE_MAX_CHARS]


def draw_report(store: CampaignStore, block: int) -> str | None:
    """The campaign's curves up to this block into blocks/N/report.png; None without
    matplotlib (an optional extra) or on a remote store, where nothing can be drawn in place."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None or "://" in store.url:
        return None
    from milepost.core.metrics.plot import plot_campaign

    out = store.local_path(block_path(block, REPORT_PNG))
    plot_campaign(store.url, out)
    return out


def write_block_report(store: CampaignStore, block: int) -> BlockSummary:
    """Draw the plot, write blocks/N/report.html (the table, the plot inline, the steps), then
    blocks/N/summary.md; the summary they show."""
    from milepost.tasks.block_html import write_html_report

    draw_report(store, block)
    drawn = read_block_summary(store, block)
    write_html_report(store, block, f"milepost block {block}", summary_rows(replace(drawn, html_path=None)),
                      block_path(block, REPORT_PNG) if drawn.report_path else None)
    summary = read_block_summary(store, block)
    store.write_text_atomic(block_path(block, SUMMARY_MD), format_summary(summary) + "\n")
    return summary


def failure_note(block: int, stage: str | None, error: str, error_kind: str | None, log_path: str | None) -> str:
    """The note of a failed block's run: the stage, its root error, and what to do about it."""
    where = f"stage **{stage}**" if stage else "a stage"
    log_line = f"\n\nStage log: `{log_path}`" if log_path else ""
    text = f"**milepost block {block} FAILED** at {where}: {error}\n\n{failure_advice(stage, error_kind)}{log_line}"
    return text[:NOTE_MAX_CHARS]


def failure_advice(stage: str | None, error_kind: str | None) -> str:
    """User errors are deterministic: a retry would fail the same way. Runtime errors (a lost
    node, a killed job) are worth retrying, and a retried stage resumes from the store."""
    if error_kind == "user":
        return ("This is an error in the run's input (recipe, overrides, data or plugin): clearing the task "
                "would fail the same way. Fix the input and trigger the DAG again with corrected overrides "
                "(same campaign_url and block).")
    task = f"the `{stage}` task" if stage else "the failed task"
    return (f"This is a runtime error: clear {task} (with its downstream tasks) to retry it; the block resumes "
            "from its last committed checkpoint. If it fails again the same way, read the stage log.")


def as_dict(s: BlockSummary) -> dict[str, Any]:
    return {**s.__dict__, "steps": list(s.steps) if s.steps else None}


# Per step, in the run_steps stage job's log: (metric key, label, format).
_STEP_FIELDS = (("rollout/reward_mean", "reward", ".3f"), ("loss/kl", "kl", ".4f"), ("loss/entropy", "entropy", ".3f"),
                ("rollout/response_len_mean", "response len", ".1f"), ("rollout/staleness", "staleness", ".0f"))


def step_line(row: dict[str, Any]) -> str:
    """One training step as a log line: `step 12: reward 0.410, kl 0.0012, …, 3.2 s`."""
    parts = [f"{label} {float(row[key]):{fmt}}" for key, label, fmt in _STEP_FIELDS if key in row]
    if "timing/step_s" in row:
        took = float(row["timing/step_s"])
        parts.append(f"took {took:.1f} s" if took < 60 else f"took {human_duration(took)}")
    return f"step {row.get('step')}: " + ", ".join(parts)


def stage_done_line(block: int, stage: Stage, record: StageRecord) -> str:
    """What a finished stage did, in words, for the end of its job's log."""
    duration = record.duration_s if record.started_at and record.finished_at else None
    took = f" in {human_duration(duration)}" if duration is not None else ""
    what = {
        Stage.START_RAY: lambda r: f"Ray at {r.get('address') or r.get('ray_address') or '?'}",
        Stage.START_ENGINES: lambda r: f"{len(r.get('engine_urls') or [])} engine(s) serving policy "
                                       f"v{r.get('policy_version')}",
        Stage.RUN_STEPS: lambda r: (f"steps {r['steps'][0]}-{r['steps'][1]}" if r.get("steps") else "no steps") + (
            f", model sha256 {r['model_sha256'][:12]}" if r.get("model_sha256") else ""),
        Stage.PUBLISH: lambda r: f"checkpoint of step {r.get('step')} exported to {r.get('export_path')}",
        Stage.EVALUATE: lambda r: f"held-out accuracy {(r.get('eval') or {}).get('accuracy', float('nan')):.3f}",
        Stage.TEARDOWN: lambda r: "the block's cluster and fleet released",
    }[stage](record.outputs)
    return f"block {block} {stage} done{took}: {what}"
