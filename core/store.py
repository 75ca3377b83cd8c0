"""The campaign store: one folder (local path or any fsspec URL) per campaign.

Layout (see DESIGN.md):
    campaign.yaml                      resolved recipe, written once
    blocks/<NNNNNN>/<stage>.json       stage records
    blocks/<NNNNNN>/metrics.jsonl      one JSON object per step
    checkpoints/<step>/...             committed by MANIFEST.json, `latest` after it
    exports/<step>/                    HF-format weights

Every JSON document is written to a temporary name and renamed, so a reader never sees
half a record. Names and record shapes are core/records.py's; this module only stores them.
"""

from __future__ import annotations

import json
import posixpath
import uuid
from typing import TYPE_CHECKING, Any

import fsspec

from milepost.core.errors import UserError
from milepost.core.records import (
    RECIPE_DOC,
    Stage,
    StageRecord,
    StageState,
    block_path,
    legacy_stage_name,
    parse_stage,
    stage_record_path,
)

if TYPE_CHECKING:
    from milepost.core.config import Recipe


class NotACampaignError(UserError):
    """The store holds no campaign (no campaign.yaml); the message says how to start one."""


class CampaignStore:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    # --- paths -------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

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

    # --- the recipe ------------------------------------------------------------------------
    def is_campaign(self) -> bool:
        return self.exists(RECIPE_DOC)

    def load_recipe(self) -> Recipe:
        """The campaign's recipe as its first run stored it, validated by the current schema.
        NotACampaignError when there is none; RecipeError when it no longer validates."""
        import yaml

        from milepost.core.recipe_io import recipe_from_dict

        if not self.is_campaign():
            raise NotACampaignError(f"{self.url} is not a campaign (no {RECIPE_DOC}): start it with "
                                    f"`milepost run RECIPE --campaign {self.url}`, or pass the folder given to "
                                    "`milepost run --campaign` before")
        return recipe_from_dict(yaml.safe_load(self.read_text(RECIPE_DOC)), RECIPE_DOC)

    # --- stage records -------------------------------------------------------------------
    def stage_record(self, block: int, stage: Stage | str) -> StageRecord | None:
        """The stage's record; a campaign started before the stages were renamed has it under
        the old name until the stage writes it again (core/records.py)."""
        stage = parse_stage(stage)
        for name in (stage.value, legacy_stage_name(stage)):
            if name and self.exists(stage_record_path(block, name)):
                return StageRecord.from_dict(self.read_json(stage_record_path(block, name)))
        return None

    def stage_done(self, block: int, stage: Stage | str) -> bool:
        record = self.stage_record(block, stage)
        return record is not None and record.done

    def block_eval(self, block: int) -> dict[str, Any] | None:
        """The held-out eval of a block whose evaluate is done (None before)."""
        record = self.stage_record(block, Stage.EVALUATE)
        return dict(record.outputs.get("eval") or {}) if record and record.state is StageState.DONE else None

    def write_stage_record(self, block: int, stage: Stage | str, record: StageRecord | dict[str, Any]) -> None:
        """Always under the stage's current name. A dict is the stored form (checked by
        StageRecord.from_dict): what tests and merges write."""
        typed = record if isinstance(record, StageRecord) else StageRecord.from_dict(record)
        self.write_json(stage_record_path(block, parse_stage(stage).value), typed.to_dict())

    def block_indices(self) -> list[int]:
        if not self.exists("blocks"):
            return []
        names = [posixpath.basename(p) for p in self.fs.ls(self.path("blocks"), detail=False)]
        return sorted(int(n) for n in names if n.isdigit())

    # --- metrics -------------------------------------------------------------------------
    def metrics_rel(self, block: int) -> str:
        return block_path(block, "metrics.jsonl")

    def read_metrics(self, block: int) -> list[dict[str, Any]]:
        rel = self.metrics_rel(block)
        if not self.exists(rel):
            return []
        return [json.loads(line) for line in self.read_text(rel).splitlines() if line.strip()]

    def write_metrics(self, block: int, rows: list[dict[str, Any]]) -> None:
        """Rewrite the block's metrics file whole (atomic), keeping it in step with checkpoints."""
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
        self.write_text_atomic(self.metrics_rel(block), text)
