"""The campaign store: one folder (local path or any fsspec URL) per campaign.

Layout (see DESIGN.md):
    campaign.yaml                      resolved recipe, written once
    blocks/<NNNNNN>/<stage>.json       stage records
    blocks/<NNNNNN>/metrics.jsonl      one JSON object per step
    checkpoints/<step>/...             committed by MANIFEST.json, `latest` after it
    exports/<step>/                    HF-format weights

Every JSON document is written to a temporary name and renamed, so a reader never sees
half a record.
"""

from __future__ import annotations

import json
import posixpath
import uuid
from typing import Any

import fsspec


class CampaignStore:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    # --- paths -------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def block_dir(self, block: int) -> str:
        return self.path("blocks", f"{block:06d}")

    def local_path(self, *parts: str) -> str:
        """A path usable by processes that only understand local files (engines, torch)."""
        if self.fs.protocol not in ("file", ("file", "local")) and "file" not in self.fs.protocol:
            raise NotImplementedError(
                f"store {self.url} is not a local folder; remote stores need a local staging "
                "folder, which is not implemented yet: use a shared-filesystem path"
            )
        return self.path(*parts)

    # --- small documents ----------------------------------------------------------------
    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

    def write_text_atomic(self, rel: str, text: str) -> None:
        final = self.path(rel)
        self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        with self.fs.open(tmp, "w") as f:
            f.write(text)
        self.fs.mv(tmp, final)

    def read_text(self, rel: str) -> str:
        with self.fs.open(self.path(rel), "r") as f:
            return f.read()

    def write_json(self, rel: str, doc: Any) -> None:
        self.write_text_atomic(rel, json.dumps(doc, indent=2, sort_keys=True))

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_text(rel))

    # --- stage records -------------------------------------------------------------------
    def stage_record(self, block: int, stage: str) -> dict[str, Any] | None:
        rel = f"blocks/{block:06d}/{stage}.json"
        return self.read_json(rel) if self.exists(rel) else None

    def write_stage_record(self, block: int, stage: str, record: dict[str, Any]) -> None:
        self.write_json(f"blocks/{block:06d}/{stage}.json", record)

    def block_indices(self) -> list[int]:
        if not self.exists("blocks"):
            return []
        names = [posixpath.basename(p) for p in self.fs.ls(self.path("blocks"), detail=False)]
        return sorted(int(n) for n in names if n.isdigit())

    # --- metrics -------------------------------------------------------------------------
    def metrics_rel(self, block: int) -> str:
        return f"blocks/{block:06d}/metrics.jsonl"

    def read_metrics(self, block: int) -> list[dict[str, Any]]:
        rel = self.metrics_rel(block)
        if not self.exists(rel):
            return []
        return [json.loads(line) for line in self.read_text(rel).splitlines() if line.strip()]

    def write_metrics(self, block: int, rows: list[dict[str, Any]]) -> None:
        """Rewrite the block's metrics file whole (atomic), keeping it in step with checkpoints."""
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
        self.write_text_atomic(self.metrics_rel(block), text)
