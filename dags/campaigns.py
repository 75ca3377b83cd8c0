"""Airflow DAG file of milepost's campaigns: one DAG per recipe in the project's `recipes/`
folder, or one per entry of the campaigns file named by `MILEPOST_CAMPAIGNS_FILE`:

    # campaigns.yaml
    - recipe: /abs/path/recipes/tiny-arith.yaml     # relative paths: to this file's folder
      campaign_url: s3://bucket/campaigns/tiny-arith   # optional
      dag_id: milepost_tiny_arith                   # optional
      tags: [team-a]                                # optional
      poll_interval_s: 5                            # optional: how often a waiting stage is checked
      retry_delay_s: 30                             # optional: Airflow's delay before a task retry

`MILEPOST_CAMPAIGNS_ROOT` sets where campaigns are stored by default (`<project>/runs/<name>`).
Parse time reads YAML files only (see milepost.dags.factory).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from milepost.core.records import CAMPAIGNS_FILE_ENV, CAMPAIGNS_ROOT_ENV
from milepost.dags.factory import build_campaign_dag

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def campaign_entries() -> list[dict]:
    listed = os.environ.get(CAMPAIGNS_FILE_ENV)
    if not listed:
        return [{"recipe": str(p)} for p in sorted(RECIPES_DIR.glob("*.yaml"))]
    path = Path(listed)
    entries = yaml.safe_load(path.read_text()) or []
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "recipe" in e for e in entries):
        raise ValueError(f"{path}: expected a list of mappings with a `recipe` key each")
    return [{**e, "recipe": str((path.parent / e["recipe"]).resolve())} for e in entries]


_CAMPAIGNS_ROOT = os.environ.get(CAMPAIGNS_ROOT_ENV, str(RECIPES_DIR.parent / "runs"))

for _entry in campaign_entries():
    _dag = build_campaign_dag(
        _entry["recipe"], dag_id=_entry.get("dag_id"), campaign_url=_entry.get("campaign_url"),
        campaigns_root=_CAMPAIGNS_ROOT, tags=tuple(_entry.get("tags", ())),
        **{k: float(_entry[k]) for k in ("poll_interval_s", "retry_delay_s") if k in _entry})
    globals()[_dag.dag_id] = _dag
