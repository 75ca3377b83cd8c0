"""What the fleet (core/fleet/) and the built-in engine (core/engine/) agree on outside a
request body: the admin key's header and file, the engine's module and its exit status.

The fleet talks to engines only over HTTP and through their processes, so it never imports
core/engine/; the built-in engine never imports core/fleet/. Facts both sides need live
here, once. Tensor wire formats have their own shared module (core/weight_sync/wire.py).
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_ENGINE_MODULE = "milepost.core.engine.server"  # `python -m` this to run the built-in engine
LOAD_FAILED_EXIT = 3  # the built-in engine's exit status when its model fails to load
LOAD_FAILED_LINE = "model load failed"  # how its last log line starts then


def bearer_header(key: str) -> dict[str, str]:
    """The header that carries an admin key, as SGLang expects it."""
    return {"Authorization": f"Bearer {key}"}


def read_key_file(path: str | Path) -> str:
    """An admin key kept in a file (e.g. the campaign's secret); the file must not be empty."""
    key = Path(path).read_text().strip()
    if not key:
        raise ValueError(f"admin key file {path} is empty: write the key into it or drop the option")
    return key
