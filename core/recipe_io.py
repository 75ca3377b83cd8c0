"""Reading recipes: YAML + `--set dotted.key=value` overrides → a validated `Recipe`."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from milepost.core.config import Recipe
from milepost.core.errors import UserError


class RecipeError(UserError):
    """A user mistake in a recipe or an override; the message says what to change."""


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: the recipe is not valid:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  - unknown key `{key}`: {_spelling_hint(e['loc'])}")
        elif e.get("input") is None and e["type"] in ("model_type", "dict_type"):
            lines.append(f"  - section `{key}` is empty; put its keys under it, or remove the line")
        else:
            value = e.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            lines.append(f"  - `{key}`: {e['msg'].removeprefix('Value error, ')}{shown}")
    return "\n".join(lines)


def _section_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys the schema accepts in the section that holds `loc`'s last key."""
    model: Any = Recipe
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def _spelling_hint(loc: tuple[Any, ...]) -> str:
    keys = _section_keys(loc)
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
    if close:
        return f"did you mean `{'.'.join(str(p) for p in loc[:-1]) + '.' if len(loc) > 1 else ''}{close[0]}`?"
    if keys:
        return f"remove it; this section takes: {', '.join(keys)}"
    return "remove it or check its spelling (the README's recipe reference lists every key)"


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise RecipeError(f"--set {text!r}: expected dotted.key=value, e.g. --set train.lr=1e-4")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"--set {text!r}: empty key segment in {key!r}; write the full dotted key, "
                          "e.g. --set train.lr=1e-4")
    return parts, _override_value(text, raw)


def _override_value(text: str, raw: str) -> Any:
    """YAML typing: `3` → int, `1e-4` → float, `true` → bool, `null` → None, `[1,2]` → list."""
    if not raw.strip():
        return ""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        # The YAML error's own text is several lines with a caret; its first line says enough.
        problem = str(getattr(e, "problem", None) or e).splitlines()[0]
        raise RecipeError(f"--set {text!r}: the value {raw!r} is not valid YAML ({problem}); quote a "
                          "string (--set 'key=\"text\"'), or write a list as [1, 2]") from None
    if isinstance(value, str) and _looks_like_float(value):
        value = float(value)
    return value


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
    doc = _read_recipe_doc(path)
    doc = apply_overrides(doc, overrides or [])
    return recipe_from_dict(doc, source=str(path))


def _read_recipe_doc(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise RecipeError(f"recipe {path} is a folder; pass a YAML file such as recipes/tiny-arith.yaml")
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist; pass a YAML file such as "
                          "recipes/tiny-arith.yaml")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not a text file (not UTF-8); a recipe is a YAML file") from None
    except OSError as e:
        raise RecipeError(f"recipe file {path} cannot be read ({e.strerror}); check its permissions") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if doc is None:
        raise RecipeError(f"{path}: the recipe is empty; start from recipes/tiny-arith.yaml")
    if not isinstance(doc, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping of sections (`train:`, `rollout:` ...), "
                          f"got a {type(doc).__name__}")
    return doc


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
