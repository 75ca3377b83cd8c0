"""Weights & Biases sink: one W&B run per campaign, offline, through W&B's own client.

Offline only: runs are written under `<campaign>/metrics/wandb/wandb/offline-run-*-<id>[-n]/`,
one such folder (segment) per stage process that wrote, all with the same run id (a hash of
the campaign URL, `resume="allow"`), so `wandb sync` uploads them into one run. The API key
(`WANDB_API_KEY`) is only needed by `wandb sync` and comes from the environment.

What the run holds is read back from its own files with W&B's own reader (`wandb leet
inspect --json`, which stops cleanly at a record cut by a kill). W&B's client writes
asynchronously: a SIGKILLed stage may leave logged rows unwritten, and the next stage, reading
back first, writes them then. Each segment's reading is cached by (size, mtime): a file that
did not change holds what it held.

Steps are logged as the metric `milepost/step` (W&B's own `_step` counts per segment, and a
segment may hold an earlier step than the one before it, e.g. the base policy's eval at step
0), and every metric is plotted against it (`define_metric(step_metric=...)`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from milepost.core.metrics.sinks import Held

STEP_KEY = "milepost/step"
CACHE = "held_cache.json"


class WandbSink:
    name = "wandb"

    def __init__(self, root: str, project: str, run_id: str, run_name: str, config: Mapping[str, str]) -> None:
        self.root = Path(root)
        self.project, self.run_id, self.run_name, self.config = project, run_id, run_name, dict(config)
        self._run: Any = None  # opened at the first write: a stage with nothing new adds no segment

    def segments(self) -> list[Path]:
        """This campaign's run files, oldest first (`latest-run` is a link to one of them).
        W&B names a segment's folder `offline-run-<YYYYmmdd_HHMMSS>-<id>`, and a second one
        opened within the same second `…-<id>-1` (then -2, …)."""
        base = self.root / "wandb"
        if not base.is_dir():
            return []
        name = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(self.run_id)}(?:-(\d+))?")
        folders = [(m, p) for p in base.iterdir() if (m := name.fullmatch(p.name)) and not p.is_symlink()
                   and (p / f"run-{self.run_id}.wandb").is_file()]
        # oldest first: by the second the segment opened, then by W&B's suffix within it
        folders.sort(key=lambda mp: (mp[0].group(1), int(mp[0].group(2) or 0)))
        return [p / f"run-{self.run_id}.wandb" for _, p in folders]

    def held(self) -> Held:
        cache_path = self.root / CACHE
        cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
        held: Held = {}
        fresh = {}
        for path in self.segments():
            st = path.stat()
            key, stamp = str(path.relative_to(self.root)), [st.st_size, st.st_mtime_ns]
            entry = cache.get(key)
            if entry is None or entry["stamp"] != stamp:
                entry = {"stamp": stamp, "held": read_history_held(path)}
            fresh[key] = entry
            for step, tags in entry["held"].items():
                held.setdefault(int(step), set()).update(tags)
        tmp = cache_path.with_suffix(".tmp")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(fresh))
        os.replace(tmp, cache_path)
        return held

    def _open(self) -> Any:
        import wandb

        # No console capture, system stats, git or code: this process is a stage job, and the
        # run holds metrics only.
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_meta=True,
                                  x_disable_machine_info=True, disable_git=True, save_code=False,
                                  x_save_requirements=False)
        self.root.mkdir(parents=True, exist_ok=True)
        run = wandb.init(mode="offline", project=self.project, id=self.run_id, resume="allow",
                         name=self.run_name, dir=str(self.root), config=self.config, settings=settings)
        run.define_metric(STEP_KEY)
        run.define_metric("*", step_metric=STEP_KEY)
        return run

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._run is None:
            self._run = self._open()
        self._run.log({STEP_KEY: step, **scalars})

    def flush(self) -> None:
        """Nothing to force: W&B's client writes on its own; what a kill loses is read back as
        missing by the next stage and written then (see the module docstring)."""

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()  # waits until W&B's writer has every row on disk
            self._run = None


def read_history(path: Path) -> list[dict[str, Any]]:
    """The history rows of one W&B run file, as W&B's own reader prints them."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    cmd = [str(wandb_cli) if wandb_cli.exists() else "wandb", "leet", "inspect", "--json", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    rows = []
    for line in out.stdout.splitlines():
        if '"history"' in line:
            record = json.loads(line)
            if record.get("type") == "history":
                rows.append(record["history"]["item"])
    return rows


def read_history_held(path: Path) -> dict[str, list[str]]:
    held: dict[str, set[str]] = {}
    for item in read_history(path):
        if STEP_KEY in item:
            tags = {k for k in item if not k.startswith("_") and k != STEP_KEY}
            held.setdefault(str(int(item[STEP_KEY])), set()).update(tags)
    return {step: sorted(tags) for step, tags in held.items()}
