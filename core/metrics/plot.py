"""`milepost status CAMPAIGN --plot out.png`: a campaign's curves against step, read from its
store only (metrics.jsonl of every block, eval records, run_steps starts, rollbacks).

Drawn with matplotlib's Agg canvas on a Figure of its own (no pyplot state), so it runs
headless and in-process. Steps after the last checkpoint of a running block are drawn too:
they are what metrics.jsonl holds now (a resume rewrites them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from milepost.core.records import RECIPE_DOC, STEPS_STARTS_DOC, block_path
from milepost.core.store import CampaignStore

# (metric key, panel title): the list, in reading order.
PANELS: tuple[tuple[str, str], ...] = (
    ("rollout/reward_mean", "reward mean"),
    ("eval/accuracy", "held-out accuracy (per block; step 0: base policy)"),
    ("loss/kl", "KL to reference"),
    ("loss/entropy", "entropy"),
    ("rollout/response_len_mean", "response length (tokens)"),
    ("rollout/staleness", "staleness (policy versions)"),
    ("timing/step_s", "step time (s)"),
)
MARK_LABELS = {"block": "block start", "restart": "run_steps resumed", "rollback": "rolled back to best"}


@dataclass
class CampaignCurves:
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    block_starts: list[tuple[int, float]] = field(default_factory=list)  # (block, x)
    restarts: list[float] = field(default_factory=list)  # x: resumed after this committed step
    rollbacks: list[float] = field(default_factory=list)


def read_curves(store: CampaignStore) -> CampaignCurves:
    curves = CampaignCurves()
    steps_per_block = _steps_per_block(store)
    rows = [row for b in store.block_indices() for row in store.read_metrics(b)]
    for key, _ in PANELS:
        points = sorted((int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float)))
        curves.series[key] = ([s for s, _ in points], [v for _, v in points])
    curves.series["eval/accuracy"] = _eval_points(store, steps_per_block)
    for block in store.block_indices():
        curves.block_starts.append((block, block * steps_per_block + 0.5))
        rel = block_path(block, STEPS_STARTS_DOC)
        starts = store.read_json(rel) if store.exists(rel) else []
        curves.restarts.extend(s["from_step"] + 0.5 for s in starts[1:])
    progress = store.read_json("progress.json") if store.exists("progress.json") else {}
    curves.rollbacks = [r["as_step"] + 0.5 for r in progress.get("restored", []) if "as_step" in r]
    return curves


def _steps_per_block(store: CampaignStore) -> int:
    # Read without the recipe schema: status must work on a campaign of an older milepost.
    doc = yaml.safe_load(store.read_text(RECIPE_DOC)) or {}
    return int(doc.get("campaign", {}).get("steps_per_block", 10))


def _eval_points(store: CampaignStore, steps_per_block: int) -> tuple[list[int], list[float]]:
    points: list[tuple[int, float]] = []
    if store.exists("base_eval.json"):
        points.append((0, float(store.read_json("base_eval.json")["accuracy"])))
    for block in store.block_indices():
        accuracy = (store.block_eval(block) or {}).get("accuracy")
        if accuracy is not None:
            points.append(((block + 1) * steps_per_block, float(accuracy)))
    return [s for s, _ in points], [v for _, v in points]


def draw(curves: CampaignCurves, title: str) -> Any:
    """A matplotlib Figure: one panel per PANELS entry, lines labelled with the metric key."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 2.3 * len(PANELS)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    for ax, (key, name) in zip(axes, PANELS):
        xs, ys = curves.series.get(key, ([], []))
        ax.plot(xs, ys, marker="o" if key.startswith("eval/") or len(xs) < 40 else None,
                markersize=3, linewidth=1.2, label=key)
        ax.set_title(name, loc="left", fontsize=10)
        ax.set_gid(key)
        if not xs:
            ax.text(0.5, 0.5, f"no {key} in the store", transform=ax.transAxes, ha="center", color="grey")
        _marks(ax, curves)
    axes[0].legend(handles=_legend_handles(axes[0]), loc="upper left", fontsize=8)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    for block, x in curves.block_starts:
        axes[0].annotate(f"block {block}", (x, 1.0), xycoords=("data", "axes fraction"),
                         fontsize=7, color="grey", va="bottom")
    fig.suptitle(title)
    return fig


def _marks(ax: Any, curves: CampaignCurves) -> None:
    for _, x in curves.block_starts:
        ax.axvline(x, color="grey", linestyle=":", linewidth=0.8, label=MARK_LABELS["block"])
    for x in curves.restarts:
        ax.axvline(x, color="tab:red", linestyle="--", linewidth=0.9, label=MARK_LABELS["restart"])
    for x in curves.rollbacks:
        ax.axvline(x, color="tab:purple", linestyle="-.", linewidth=0.9, label=MARK_LABELS["rollback"])


def _legend_handles(ax: Any) -> list[Any]:
    seen: dict[str, Any] = {}
    for line in ax.get_lines():
        seen.setdefault(line.get_label(), line)
    return list(seen.values())


def plot_campaign(url: str, out_path: str) -> Any:
    """Draw the campaign at `url` into `out_path` (PNG, or any format matplotlib knows by the
    suffix); returns the Figure."""
    store = CampaignStore(url)
    fig = draw(read_curves(store), f"campaign {url}")
    fig.savefig(out_path, dpi=110)
    return fig
