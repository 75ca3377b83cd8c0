"""Reading recipes: YAML + `--set dotted.key=value` overrides → a validated `Recipe`."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from milepost.core.config import Recipe


class RecipeError(ValueError):
    """A user mistake in a recipe or an override; the message says what to change."""


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: the recipe is not valid:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  - unknown key `{key}`: remove it or check its spelling "
                         "(`milepost run --help` points to the recipe reference)")
        else:
            value = e.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            lines.append(f"  - `{key}`: {e['msg']}{shown}")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise RecipeError(f"--set {text!r}: expected dotted.key=value, e.g. --set train.lr=1e-4")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"--set {text!r}: empty key segment in {key!r}")
    # YAML typing: `3` → int, `1e-4` → float, `true` → bool, `null` → None, `[1,2]` → list.
    value = yaml.safe_load(raw) if raw.strip() else ""
    if isinstance(value, str) and _looks_like_float(value):
        value = float(value)
    return parts, value


def _looks_like_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def apply_overrides(doc: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        parts, value = parse_override(text)
        node = doc
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise RecipeError(f"--set {text!r}: `{part}` is a value, not a section")
            node = child
        node[parts[-1]] = value
    return doc


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist; pass a YAML file such as "
                          "recipes/tiny-arith.yaml")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping of sections, got {type(doc).__name__}")
    doc = apply_overrides(doc, overrides or [])
    return recipe_from_dict(doc, source=str(path))


def recipe_from_dict(doc: dict[str, Any], source: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(doc)
    except ValidationError as e:
        raise RecipeError(_format_validation_error(e, source)) from None


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=True)


def recipe_diff(stored: str, new: str) -> str:
    return "".join(difflib.unified_diff(
        stored.splitlines(keepends=True), new.splitlines(keepends=True),
        fromfile="campaign.yaml (stored)", tofile="this run's recipe"))


def same_recipe(stored: str, recipe: Recipe) -> bool:
    """Whether a campaign's stored recipe is `recipe`. The stored text is read through the
    current schema first, so a campaign started before a new setting existed (written
    without it) still resumes as long as that setting keeps its default; a setting the
    stored recipe names explicitly must match."""
    resolved = dump_recipe(recipe)
    if stored == resolved:
        return True
    try:
        return dump_recipe(Recipe.model_validate(yaml.safe_load(stored))) == resolved
    except (ValidationError, yaml.YAMLError):
        return False
