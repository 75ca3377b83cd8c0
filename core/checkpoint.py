"""Checkpoints: the unit of truth.

A checkpoint is a folder `checkpoints/<step:08d>/` holding the trainer state, `state.json`
(step, policy version, data cursor, RNG, metrics so far) and `MANIFEST.json` (every file's
size and sha256). It is written under a temporary name; the manifest is written last, then
the folder is renamed into place, then `checkpoints/latest` moves. A folder without a valid
manifest does not exist: `latest_valid` skips it with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
STATE = "state.json"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    state: dict[str, Any]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest_for(folder: Path) -> dict[str, Any]:
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(folder).as_posix()
            files[rel] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    return {"version": 1, "files": files}


def _fsync_write(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int = 3) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def step_dir(self, step: int) -> Path:
        return self.root / f"{step:08d}"

    def save(self, step: int, state: dict[str, Any], write_payload: Callable[[Path], None]) -> Path:
        """Write a checkpoint: payload (trainer state) → state.json → manifest → rename → latest."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{step:08d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        write_payload(tmp)
        _fsync_write(tmp / STATE, json.dumps(state, sort_keys=True))
        _fsync_write(tmp / MANIFEST, json.dumps(_manifest_for(tmp), indent=1, sort_keys=True))
        final = self.step_dir(step)
        if final.exists():  # an earlier, uncommitted attempt at the same step
            shutil.rmtree(final)
        tmp.rename(final)
        latest_tmp = self.root / f".latest-{uuid.uuid4().hex[:8]}"
        _fsync_write(latest_tmp, str(step))
        latest_tmp.replace(self.root / "latest")
        self._prune()
        return final

    def verify(self, folder: Path) -> str | None:
        """None if the checkpoint is intact, else why it is not."""
        manifest_path = folder / MANIFEST
        if not manifest_path.is_file():
            return "no MANIFEST.json (the write never committed)"
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            return f"MANIFEST.json is not valid JSON ({e})"
        for rel, meta in manifest.get("files", {}).items():
            p = folder / rel
            if not p.is_file():
                return f"{rel} listed in the manifest is missing"
            if p.stat().st_size != meta["size"] or _sha256(p) != meta["sha256"]:
                return f"{rel} does not match its size/sha256 in the manifest"
        return None

    def committed_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.name) for p in self.root.iterdir() if p.is_dir() and p.name.isdigit())

    def latest_valid(self) -> CheckpointInfo | None:
        """The newest intact checkpoint; broken ones are skipped with a warning."""
        for step in reversed(self.committed_steps()):
            folder = self.step_dir(step)
            problem = self.verify(folder)
            if problem:
                log.warning("ignoring checkpoint %s: %s", folder, problem)
                continue
            state = json.loads((folder / STATE).read_text())
            return CheckpointInfo(step=step, path=folder, state=state)
        return None

    def _prune(self) -> None:
        for leftover in self.root.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        steps = self.committed_steps()
        for step in steps[: max(0, len(steps) - self.keep_last)]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)
