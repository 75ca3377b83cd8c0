"""pyproject's package list names every package of the source tree.

An editable install (the quick start's) finds a package left out of `[tool.setuptools]
packages` anyway; a normal install (a cluster's site-packages, a wheel) silently lacks it and
fails at the first import. `milepost.core.quant` was missing that way."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_with_an_init_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    # a nested package-dir entry (milepost.core) is also found under its parent (milepost/core)
    # only when the folders nest; they do not here, so each is found once
    missing = sorted(found - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
    stale = sorted(listed - found)
    assert not stale, f"{stale} in [tool.setuptools] packages have no __init__.py: remove them"
