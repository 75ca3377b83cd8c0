import json
import logging

from milepost.core.checkpoint import CheckpointManager


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
