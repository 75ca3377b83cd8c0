"""The trigger form of a campaign DAG: typed params whose JSON schema Airflow checks when a
run is triggered (UI form or REST API), before any task starts.

Pure Python, no Airflow import: the schema pieces are tested on their own.

What the schema can check without importing the recipe schema (pydantic, `core.config`) is
the shape of an override: `section.key=value`, where `section` is one of the recipe's
top-level sections. Whether the key exists below that section and whether the value has the
right type is checked by `milepost.core.recipe_io` when start_ray prepares the campaign
(the first thing a run does), with the same messages as `milepost run --set`.
"""

from __future__ import annotations

import re

# The top-level keys of `milepost.core.config.Recipe` (a unit test keeps them equal).
RECIPE_SECTIONS = ("seed", "campaign", "model", "data", "rollout", "reward", "filters", "algo", "train",
                   "precision", "sync", "checkpoint", "loop", "eval", "cluster", "metrics", "hooks")

_KEY = r"[A-Za-z_][A-Za-z0-9_]*"
# `seed=3`, `train.lr=1e-4`, `cluster.slurm.partition=gpu`: a known section, dotted key, `=`, a value.
OVERRIDE_PATTERN = rf"^({'|'.join(RECIPE_SECTIONS)})(\.{_KEY})*=.*$"

OVERRIDES_DESCRIPTION = (
    "Recipe overrides, one `dotted.key=value` per line, as `milepost run --set` takes them "
    f"(e.g. `train.lr=1e-4`, `cluster.executor=slurm`). The key must start with a recipe section: "
    f"{', '.join(RECIPE_SECTIONS)}. Values are read as YAML (`3` is an int, `true` a bool). "
    "A campaign keeps the recipe it was started with: overrides that change it are refused "
    "by start_ray; start a new campaign URL instead.")


# The schema of one override. Airflow refuses a bad one with jsonschema's own message, which
# quotes the regex and then this schema: the description is there so that the message also
# says, in words, what to write (Airflow gives a Param no custom error message).
OVERRIDE_ITEM = {"type": "string", "pattern": OVERRIDE_PATTERN,
                 "description": "HOW TO FIX: write `section.key=value`, e.g. `train.lr=1e-4`, where section is one "
                                f"of {', '.join(RECIPE_SECTIONS)}"}


def check_override(text: str) -> None:
    """Raise ValueError, saying what to write, when `text` does not match the schema's pattern
    (the same check the trigger form applies)."""
    if not re.match(OVERRIDE_PATTERN, text):
        raise ValueError(f"override {text!r} is not `section.key=value` with a section among "
                         f"{', '.join(RECIPE_SECTIONS)} (e.g. `train.lr=1e-4`)")
