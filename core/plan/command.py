"""The `milepost plan` command: load, plan, print; exit 2 when the recipe is refused."""

from __future__ import annotations

import sys
from pathlib import Path

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def run_plan(recipe_path: str | None, overrides: list[str], list_models: bool = False) -> int:
    from milepost.core.plan.arch import from_hf_config
    from milepost.core.plan.catalog import CATALOG
    from milepost.core.plan.planner import format_plan, make_plan
    from milepost.core.recipe_io import RecipeError, load_recipe

    if list_models:
        for name, cfg in CATALOG.items():
            a = from_hf_config(cfg, name)
            print(f"{name:<16}{a.model_type:<13}{a.total_params() / 1e9:8.2f} B params "
                  f"({a.active_params() / 1e9:.2f} B active)")
        return EXIT_OK
    if recipe_path is None:
        print("milepost: plan needs a recipe, e.g. `milepost plan recipes/qwen3-8b-gsm8k.yaml` "
              "(or --models to list the shipped model configs)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        plan = make_plan(load_recipe(recipe_path, overrides))
    except (RecipeError, ValueError) as e:
        print(f"milepost: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    text = format_plan(plan, Path(recipe_path).name)
    if plan.ok:
        print(text)
        return EXIT_OK
    print(text, file=sys.stderr)
    return EXIT_BAD_INPUT
