import json
import logging
import sys
from pathlib import Path

import pytest

from milepost.core.checkpoint import CheckpointManager, CheckpointSaveError, NoIntactCheckpointError

sys.path.insert(0, str(Path(__file__).parent))  # test_campaign_progression's helpers


def _payload(content: bytes):
    def write(folder):
        (folder / "trainer").mkdir()
        (folder / "trainer" / "model.pt").write_bytes(content)
    return write


def test_checkpoint_commits_manifest_and_moves_latest(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")
    folder = mgr.save(5, {"step": 5}, _payload(b"abc"))
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == {"trainer/model.pt", "state.json"}
    assert (tmp_path / "ck" / "latest").read_text() == "5"
    assert mgr.latest_valid().step == 5


def test_checkpoint_without_manifest_is_ignored_with_a_warning(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(5, {"step": 5}, _payload(b"abc"))
    mgr.save(10, {"step": 10}, _payload(b"def"))
    (mgr.step_dir(10) / "MANIFEST.json").unlink()
    with caplog.at_level(logging.WARNING):
        latest = mgr.latest_valid()
    assert latest.step == 5
    assert "MANIFEST.json is missing" in caplog.text


def test_checkpoint_with_a_corrupted_file_is_ignored(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(5, {"step": 5}, _payload(b"abc"))
    mgr.save(10, {"step": 10}, _payload(b"def"))
    (mgr.step_dir(10) / "trainer" / "model.pt").write_bytes(b"xyz")
    assert mgr.latest_valid().step == 5


def test_checkpoint_keeps_only_the_last_n(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, {"step": step}, _payload(bytes([step])))
    assert mgr.committed_steps() == [2, 3]


def test_half_written_checkpoint_folder_is_never_taken_as_a_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(1, {"step": 1}, _payload(b"a"))
    (tmp_path / "ck" / ".tmp-00000002-deadbeef").mkdir()
    assert mgr.latest_valid().step == 1


# --- verification rules (real files; the real-backend version is tests/integration/test_store_integrity.py) ---
def test_a_manifest_that_still_parses_but_was_edited_is_torn(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(1, {"step": 1}, _payload(b"a"))
    mgr.save(2, {"step": 2}, _payload(b"b"))
    manifest_path = mgr.step_dir(2) / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["trainer/model.pt"]["size"] = 2  # valid JSON, wrong content
    manifest_path.write_text(json.dumps(manifest))
    assert "does not match its own sha256" in mgr.verify(mgr.step_dir(2))
    assert CheckpointManager(mgr.root).latest_valid().step == 1


def test_sizes_are_checked_always_and_sha256_only_when_deep(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(1, {"step": 1}, _payload(b"abc"))
    model = mgr.step_dir(1) / "trainer" / "model.pt"
    model.write_bytes(b"xyz")  # same size, other bytes
    assert mgr.verify(mgr.step_dir(1), deep=False) is None
    assert "trainer/model.pt is torn: its sha256" in mgr.verify(mgr.step_dir(1))
    model.write_bytes(b"ab")
    assert "trainer/model.pt is truncated or torn: 2 bytes" in mgr.verify(mgr.step_dir(1), deep=False)


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(1, {"step": 1}, _payload(b"abc"))
    (mgr.step_dir(1) / "trainer" / "model.pt").unlink()
    with pytest.raises(NoIntactCheckpointError, match="step 1: trainer/model.pt is missing.*Restore the checkpoints"):
        mgr.latest_valid()


def test_a_failing_payload_leaves_nothing_and_a_later_save_works(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(1, {"step": 1}, _payload(b"a"))

    def half_then_fail(folder):
        _payload(b"half")(folder)
        raise RuntimeError("the trainer died mid-save")

    with pytest.raises(CheckpointSaveError, match="step 2 was not saved .*the trainer died mid-save.*`latest` still "
                                                  "names step 1"):
        mgr.save(2, {"step": 2}, half_then_fail)
    assert sorted(p.name for p in mgr.root.iterdir()) == ["00000001", "latest"]
    mgr.save(2, {"step": 2}, _payload(b"b"))
    assert mgr.latest_valid().step == 2 and (mgr.root / "latest").read_text() == "2"


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(1, {"step": 1}, _payload(b"first"))
    mgr.save(1, {"step": 1, "again": True}, _payload(b"second"))
    latest = mgr.latest_valid()
    assert latest.state["again"] and (latest.path / "trainer" / "model.pt").read_bytes() == b"second"
    assert sorted(p.name for p in mgr.root.iterdir()) == ["00000001", "latest"]


# --- retention ---------------------------------------------------------------------------------------------
def test_retention_never_deletes_the_checkpoint_being_resumed_from(tmp_path):
    """keep_last=1: a stage that resumed from step 2 (its engines launched from 2's hf/) keeps it
    while it saves 3 and 4; the next stage, which resumes from 4, lets 2 go and keeps 4."""
    first = CheckpointManager(tmp_path / "ck", keep_last=1)
    for step in (1, 2):
        first.save(step, {"step": step}, _payload(bytes([step])))
    stage = CheckpointManager(tmp_path / "ck", keep_last=1)
    assert stage.latest_valid().step == 2
    stage.save(3, {"step": 3}, _payload(b"3"))
    stage.save(4, {"step": 4}, _payload(b"4"))
    assert stage.committed_steps() == [2, 4]
    assert stage.verify(stage.step_dir(2)) is None
    following = CheckpointManager(tmp_path / "ck", keep_last=1)
    assert following.latest_valid().step == 4
    following.save(5, {"step": 5}, _payload(b"5"))
    assert following.committed_steps() == [4, 5]


def test_retention_keeps_protected_steps(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=1)
    mgr.save(1, {"step": 1}, _payload(b"1"))
    mgr.protect(mgr.step_of(mgr.step_dir(1) / "hf"))  # e.g. the folder a fleet serves
    for step in (2, 3):
        mgr.save(step, {"step": step}, _payload(bytes([step])))
    assert mgr.committed_steps() == [1, 3]


def test_broken_checkpoints_do_not_count_towards_keep_last(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, {"step": step}, _payload(bytes([step]) * 8))
    (mgr.step_dir(3) / "trainer" / "model.pt").write_bytes(b"cut")  # bit rot after the commit
    mgr.save(4, {"step": 4}, _payload(b"4" * 8))
    assert mgr.committed_steps() == [2, 3, 4]  # two intact ones kept, and the broken one for inspection
    assert [mgr.verify(mgr.step_dir(s)) is None for s in (2, 3, 4)] == [True, False, True]


def test_retention_never_deletes_the_best_by_eval_checkpoint(tmp_path):
    """keep_last=1 over four blocks: block 0 is the best by eval accuracy; its checkpoint leaves
    checkpoints/ at the next save, but its snapshot (best/) stays intact and a regression
    resumes from it."""
    from test_campaign_progression import SPB, _campaign, _finish_block

    from milepost.tasks import progression

    recipe, store = _campaign(tmp_path, num_blocks=4)
    best_weights = _finish_block(recipe, store, 0, 0.70)
    progression.after_evaluate(store, recipe, 0)
    for block, accuracy in ((1, 0.69), (2, 0.68)):  # within the gate, below the best
        _finish_block(recipe, store, block, accuracy)
        assert progression.after_evaluate(store, recipe, block).action == "next"
    _finish_block(recipe, store, 3, 0.50)
    checkpoints = CheckpointManager(store.local_path("checkpoints"))
    assert checkpoints.committed_steps() == [4 * SPB]  # keep_last=1 pruned block 0's copy long ago
    best = progression.read_progress(store)["best"]
    assert best["block"] == 0 and checkpoints.verify(Path(best["snapshot"])) is None
    assert (Path(best["snapshot"]) / "hf" / "model.safetensors").read_bytes() == best_weights
