"""The built-in engine (core/engine/) and the fleet (core/fleet/) are two packages with one
seam: the fleet reaches engines over HTTP and through their processes, so neither package
imports the other; what both need is in core/engine_wire.py."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "core"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (lazy imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize(("package", "forbidden"), [("fleet", "milepost.core.engine."),
                                                    ("engine", "milepost.core.fleet")])
def test_neither_package_imports_the_other(package: str, forbidden: str) -> None:
    crossing = {f"{path.name}: {name}" for path in sorted((CORE / package).glob("*.py"))
                for name in imported_modules(path) if name.startswith(forbidden) or name == forbidden.rstrip(".")}
    assert not crossing, f"core/{package}/ imports across the seam (use core/engine_wire.py): {sorted(crossing)}"


def test_the_engine_process_loads_no_fleet_module() -> None:
    """Transitively too: the engine imports the weight-sync wire formats, and that package's
    transports (which drive engines through the fleet's client) load only when used."""
    code = ("import sys, milepost.core.engine.server; "
            "print(sorted(m for m in sys.modules if m.startswith('milepost.core.fleet')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_launcher_runs_the_module_that_serves() -> None:
    """The fleet names the built-in engine's module as a string; that module's parser is
    the engine's own (a rename would otherwise surface only when a fleet starts)."""
    from milepost.core.engine_wire import BUILTIN_ENGINE_MODULE
    from milepost.core.fleet.launcher import ENGINE_MODULES

    assert ENGINE_MODULES["builtin"] == BUILTIN_ENGINE_MODULE
    done = subprocess.run([sys.executable, "-m", BUILTIN_ENGINE_MODULE, "--help"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "--model-path" in done.stdout, done.stderr


def test_a_replaced_engine_swaps_the_fleets_lists_and_leaves_a_held_one_alone(tmp_path) -> None:
    """The supervisor installs a restarted engine through `Fleet.replace_engine`: new lists,
    so a list read before the restart still names the engines it named, and the replaced
    engine's client is closed."""
    from milepost.core.config import RolloutConfig
    from milepost.core.fleet.fleet import Fleet

    fleet = Fleet("/m", "0", RolloutConfig(), "127.0.0.1", log_dir=str(tmp_path))
    before = [fleet.engine_client(f"http://127.0.0.1:{port}") for port in (1, 2)]
    fleet.clients, fleet.engine_urls, fleet.actors = list(before), [c.base_url for c in before], ["a0", "a1"]
    held_clients, held_urls = fleet.clients, fleet.engine_urls
    successor = fleet.engine_client("http://127.0.0.1:3")
    fleet.replace_engine(1, successor, successor.base_url, "a1'")
    assert held_clients == before and held_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert fleet.clients == [before[0], successor] and fleet.actors == ["a0", "a1'"]
    assert fleet.engine_urls == ["http://127.0.0.1:1", "http://127.0.0.1:3"]
    assert before[1]._http.is_closed and not before[0]._http.is_closed
