"""blocks/N/report.html: one self-contained page per block (no file beside it needed, so it can
be mailed, attached to a ticket or opened from a copy of the store): the block's summary
table, the campaign's curves so far as an embedded PNG, and one row per RL step.

Standard library only; written at the end of the evaluate stage's task (and by `progress`,
idempotently) with the summary it shows.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable
from typing import Any

from milepost.core.records import block_path
from milepost.core.store import CampaignStore
from milepost.tasks.block_summary import REPORT_HTML

# Per-step columns: (metric key, heading, format).
STEP_COLUMNS = (("rollout/reward_mean", "reward", ".3f"), ("loss/kl", "KL", ".4f"), ("loss/entropy", "entropy", ".3f"),
                ("rollout/response_len_mean", "response len", ".1f"), ("rollout/staleness", "staleness", ".0f"),
                ("timing/step_s", "step s", ".2f"))

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .7em;text-align:left}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}img{max-width:100%}"""


def _cell(value: Any, fmt: str) -> str:
    try:
        return format(float(value), fmt)
    except (TypeError, ValueError):
        return "—"


def _table(head: Iterable[str], rows: Iterable[Iterable[str]], numeric_from: int = 1) -> str:
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        cells = [f'<td{" class=n" if i >= numeric_from else ""}>{html.escape(str(c))}</td>' for i, c in enumerate(row)]
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(out) + "</table>"


def step_table(rows: list[dict[str, Any]]) -> str:
    """One row per RL step of the block, the columns the run_steps log shows."""
    body = [[str(r.get("step"))] + [_cell(r.get(key), fmt) for key, _, fmt in STEP_COLUMNS] for r in rows]
    return _table(["step", *(head for _, head, _ in STEP_COLUMNS)], body)


def render_report(title: str, summary_rows: list[tuple[str, str]], png: bytes | None,
                  steps: list[dict[str, Any]]) -> str:
    """The page: summary table, the plot (inline, base64) when drawn, the per-step table."""
    plot = (f'<img alt="the campaign\'s curves" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
            if png else "<p>No plot: matplotlib is not installed (pip install 'milepost[plot]').</p>")
    return (f"<!doctype html>\n<html><head><meta charset=utf-8><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>\n<h1>{html.escape(title)}</h1>\n"
            f"{_table(['', ''], summary_rows)}\n<h2>Curves of the campaign so far</h2>\n{plot}\n"
            f"<h2>RL steps of this block</h2>\n{step_table(steps)}\n</body></html>\n")


def write_html_report(store: CampaignStore, block: int, title: str, summary_rows: list[tuple[str, str]],
                      png_rel: str | None) -> str:
    """Write blocks/N/report.html; its path in the store."""
    png = None
    if png_rel and store.exists(png_rel):
        with store.fs.open(store.path(png_rel), "rb") as f:
            png = f.read()
    rel = block_path(block, REPORT_HTML)
    store.write_text_atomic(rel, render_report(title, summary_rows, png, store.read_metrics(block)))
    return store.path(rel)
