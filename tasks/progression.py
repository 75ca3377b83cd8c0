"""Campaign progression: which block runs next, the regression gate, stop and resume.

State lives in the store, so the embedded driver (`milepost run`) and the Airflow DAG (its
`progress` task) make the same decisions from the same records:

    <campaign>/progress.json          {"best": {...}, "paused": {...} | null, "stop_requested": {...} | null,
                                       "restored": [...]}
    <campaign>/blocks/<N>/gate.json   the block's gate verdict ("pass" | "regressed"), with the numbers
    <campaign>/best/<step>/           a hard-linked copy of the best block's final checkpoint

After a block's evaluate, `after_evaluate` applies the gate (`campaign.max_eval_drop`):
accuracy more than that below the best block's pauses the campaign and marks the block
`regressed`; otherwise the block may become the best and the next block follows, until
`campaign.num_blocks` or a stop request.

Resume (`resume_paused`): the regressed block's final checkpoint is set aside as
`checkpoints/rejected-<step>-<time>` and the best block's checkpoint is committed again under
that step number, so the next block's run_steps stage — which resumes from the newest committed
checkpoint and numbers steps by block — starts from the best weights, optimizer and data
cursor. Why a copy of the best one: `checkpoint.keep_last` prunes it long before a
regression is seen. Hard links cost no space: committed checkpoint files are never rewritten.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from milepost.core.checkpoint import MANIFEST, STATE, CheckpointManager
from milepost.core.config import Recipe
from milepost.core.records import GATE_DOC, Stage, block_path
from milepost.core.store import CampaignStore

PROGRESS_DOC = "progress.json"


class CampaignPaused(ValueError):
    """A block was asked to run on a paused (or stopped) campaign without resuming it."""


@dataclass(frozen=True)
class Decision:
    action: Literal["next", "done", "paused", "stopped"]
    block: int
    next_block: int | None
    message: str


def read_progress(store: CampaignStore) -> dict[str, Any]:
    doc = store.read_json(PROGRESS_DOC) if store.exists(PROGRESS_DOC) else {}
    return {"best": None, "paused": None, "stop_requested": None, "restored": [], **doc}


def _accuracy(store: CampaignStore, block: int) -> float:
    evaluation = store.block_eval(block)
    if evaluation is None:
        raise RuntimeError(f"block {block} has no finished evaluate record: the gate runs after evaluate")
    return float(evaluation["accuracy"])


def next_block(store: CampaignStore, recipe: Recipe) -> int | None:
    """The first block whose evaluate is not done; None when the campaign is complete."""
    return next((b for b in range(recipe.campaign.num_blocks) if not store.stage_done(b, Stage.EVALUATE)), None)


def _hardlink_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if rel.parts[0] in skip:
            continue
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:  # another filesystem, or no hard links: copy
            shutil.copy2(path, target)


def _snapshot_best(store: CampaignStore, recipe: Recipe, step: int) -> str:
    checkpoints = CheckpointManager(store.local_path("checkpoints"), recipe.checkpoint.keep_last)
    src = checkpoints.step_dir(step)
    problem = checkpoints.verify(src)
    if problem:
        raise RuntimeError(f"the best block's checkpoint {src} is not intact ({problem})")
    best_root = Path(store.local_path("best"))
    tmp = best_root / f".tmp-{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    _hardlink_tree(src, tmp)
    final = best_root / f"{step:08d}"
    shutil.rmtree(final, ignore_errors=True)  # an earlier attempt at this very snapshot
    tmp.rename(final)
    for old in best_root.iterdir():  # only once the new best is in place: never a moment with none
        if old.name != final.name:
            shutil.rmtree(old, ignore_errors=True)
    return str(final)


def after_evaluate(store: CampaignStore, recipe: Recipe, block: int) -> Decision:
    """Apply the gate to a block whose evaluate is done; record the verdict; what comes next.
    Idempotent: a block already judged keeps its verdict."""
    progress = read_progress(store)
    gate_rel = block_path(block, GATE_DOC)
    if store.exists(gate_rel):
        verdict = store.read_json(gate_rel)
    else:
        accuracy = _accuracy(store, block)
        best = progress["best"]
        limit = recipe.campaign.max_eval_drop
        regressed = best is not None and limit is not None and accuracy < best["accuracy"] - limit
        verdict = {"verdict": "regressed" if regressed else "pass", "accuracy": accuracy,
                   "best_block": best["block"] if best else None, "best_accuracy": best["accuracy"] if best else None,
                   "max_eval_drop": limit, "judged_at": time.time()}
        if regressed and block + 1 < recipe.campaign.num_blocks:  # the last block just ends the campaign
            progress["paused"] = {"block": block, "at": time.time(), "reason": (
                f"block {block} accuracy {accuracy:.3f} is more than {limit} below the best block "
                f"{best['block']} ({best['accuracy']:.3f})")}
        elif best is None or accuracy >= best["accuracy"]:
            step = (block + 1) * recipe.campaign.steps_per_block
            progress["best"] = {"block": block, "accuracy": accuracy, "step": step,
                                "snapshot": _snapshot_best(store, recipe, step)}
        store.write_json(PROGRESS_DOC, progress)
        store.write_json(gate_rel, verdict)
    return _decide(store, recipe, block, verdict, read_progress(store))


def _decide(store: CampaignStore, recipe: Recipe, block: int, verdict: dict[str, Any],
            progress: dict[str, Any]) -> Decision:
    following = block + 1 if block + 1 < recipe.campaign.num_blocks else None
    if verdict["verdict"] == "regressed" and following is None:
        best = progress["best"]
        return Decision("done", block, None, f"campaign complete: {recipe.campaign.num_blocks} blocks; the last one "
                        f"regressed, so the best policy is block {best['block']}'s ({best['snapshot']})")
    if verdict["verdict"] == "regressed":
        return Decision("paused", block, following, "campaign paused by the regression gate: block "
                        f"{block} accuracy {verdict['accuracy']:.3f} is more than {verdict['max_eval_drop']} below "
                        f"the best block {verdict['best_block']} ({verdict['best_accuracy']:.3f}). Resume it "
                        f"(`milepost run --resume`, or trigger the DAG with resume=true) to run the next block "
                        f"from block {verdict['best_block']}'s checkpoint.")
    if following is None:
        return Decision("done", block, None, f"campaign complete: {recipe.campaign.num_blocks} block(s)")
    if progress["stop_requested"]:
        return Decision("stopped", block, following, f"stop requested ({progress['stop_requested'].get('by')}): "
                        f"block {following} was not started; resume to continue")
    return Decision("next", block, following, f"block {block} passed the gate; block {following} is next")


def request_stop(store: CampaignStore, by: str) -> None:
    """Ask the campaign to stop after the block that is running (no block is interrupted)."""
    progress = read_progress(store)
    progress["stop_requested"] = {"at": time.time(), "by": by}
    store.write_json(PROGRESS_DOC, progress)


def check_can_start(store: CampaignStore, recipe: Recipe, block: int, resume: bool) -> None:
    """Before a block starts: refuse a paused or stopped campaign unless resuming, and a block
    that is not the next one. Resuming a paused campaign restores the best checkpoint."""
    progress = read_progress(store)
    expected = next_block(store, recipe)
    if expected is None:
        raise CampaignPaused(f"campaign {store.url} is complete ({recipe.campaign.num_blocks} blocks done); "
                             "raise campaign.num_blocks in a new campaign to train further")
    if block != expected and not store.stage_done(block, Stage.EVALUATE):
        raise CampaignPaused(f"block {block} cannot start: block {expected} is the next block of {store.url}")
    if progress["paused"] or progress["stop_requested"]:
        if not resume:
            why = progress["paused"]["reason"] if progress["paused"] else "a stop was requested"
            raise CampaignPaused(f"campaign {store.url} is paused ({why}). Resume it with "
                                 "`milepost run --resume` or by triggering the DAG with resume=true.")
        resume_paused(store, recipe)


def resume_paused(store: CampaignStore, recipe: Recipe) -> dict[str, Any] | None:
    """Clear a pause or stop; after a regression, put the best checkpoint back as the newest."""
    progress = read_progress(store)
    restored = None
    if progress["paused"] and progress["best"]:
        restored = _restore_best(store, recipe, progress["best"])
        progress["restored"].append(restored)
    progress["paused"] = progress["stop_requested"] = None
    store.write_json(PROGRESS_DOC, progress)
    return restored


def _restore_best(store: CampaignStore, recipe: Recipe, best: dict[str, Any]) -> dict[str, Any]:
    import json

    checkpoints = CheckpointManager(store.local_path("checkpoints"), recipe.checkpoint.keep_last)
    latest = checkpoints.latest_valid()
    snapshot = Path(best["snapshot"])
    if latest is None or checkpoints.verify(snapshot):
        raise RuntimeError(f"cannot resume from the best checkpoint: {snapshot} is missing or not intact, "
                           f"or the campaign has no checkpoint")
    step = latest.step
    if step != best["step"]:
        rejected = checkpoints.root / f"rejected-{step:08d}-{int(time.time())}"
        checkpoints.step_dir(step).rename(rejected)  # kept for inspection; not a committed step any more
        state = {**json.loads((snapshot / STATE).read_text()), "step": step}
        checkpoints.save(step, state, lambda tmp: _hardlink_tree(snapshot, tmp, skip=(STATE, MANIFEST)))
    return {"from_block": best["block"], "from_step": best["step"], "as_step": step, "at": time.time()}


def as_dict(decision: Decision) -> dict[str, Any]:
    return asdict(decision)
