"""core/weight_export.py: exports written behind a push are whole before anyone loads them,
their failures reach the loop, and what a restarted engine may need is never pruned."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from milepost.core.weight_export import PARTIAL, ExportError, WeightExports


class HeldExport:
    """An export that writes a config file once the test releases it (or fails, if told)."""

    def __init__(self) -> None:
        self.release, self.started = threading.Event(), threading.Event()
        self.calls: list[str] = []
        self.fail: str | None = None

    def __call__(self, path: str) -> None:
        self.calls.append(path)
        Path(path).mkdir(parents=True, exist_ok=True)
        self.started.set()
        assert self.release.wait(30), "the test never released the export"
        if self.fail:
            raise OSError(self.fail)
        Path(path, "config.json").write_text("{}")


def test_an_export_behind_a_push_is_pending_until_whole_then_prunes_the_older_ones(tmp_path: Path) -> None:
    export = HeldExport()
    exports = WeightExports(tmp_path, export)
    (tmp_path / "00000001").mkdir()  # the previous step's export: the fleet's record names it meanwhile
    (tmp_path / "00000000.partial").mkdir()  # what a killed export left
    written: list[str] = []
    exports.on_written(written.append)
    with exports.behind(2) as folder:
        assert not export.calls  # the push runs first: no export yet
        assert exports.pending() == str(folder) and not exports.durable(str(folder))  # but it is pending
    assert export.started.wait(10)
    assert exports.pending() == str(folder) and not folder.exists()  # written as <step>.partial
    assert export.calls == [str(folder) + PARTIAL]
    assert not exports.durable(str(folder)) and exports.durable(str(tmp_path / "00000001"))
    assert (tmp_path / "00000001").is_dir()  # kept while the new one is not whole
    export.release.set()
    seconds = exports.wait(10)
    assert seconds is not None and seconds > 0
    assert (folder / "config.json").is_file() and exports.durable(str(folder))
    _wait(lambda: written == [str(folder)])
    _wait(lambda: sorted(p.name for p in tmp_path.iterdir()) == ["00000002"])
    assert exports.report_behind() == seconds and exports.report_behind() is None
    exports.close()


def test_a_failed_push_withdraws_its_export(tmp_path: Path) -> None:
    export = HeldExport()
    exports = WeightExports(tmp_path, export)
    with pytest.raises(RuntimeError, match="push failed"), exports.behind(3):
        raise RuntimeError("push failed")
    assert exports.pending() is None and exports.wait(1) is None and not export.calls
    assert exports.durable(str(exports.path_of(3)))  # nothing pending: the fleet never recorded it
    exports.close()


def test_a_failed_export_is_raised_with_its_folder_and_cause_and_never_looks_whole(tmp_path: Path) -> None:
    export = HeldExport()
    export.fail = "No space left on device"
    exports = WeightExports(tmp_path, export)
    written: list[str] = []
    exports.on_written(written.append)
    with exports.behind(4) as folder:
        pass
    export.release.set()
    with pytest.raises(ExportError, match=r"00000004 failed: OSError: No space left on device.*disk's space"):
        exports.wait(10)
    with pytest.raises(ExportError):  # every later wait, and whoever loads it, sees it too
        exports.wait_for(str(folder), 1)
    assert not folder.exists() and not exports.durable(str(folder)) and written == []


def test_wait_for_returns_at_once_for_a_folder_not_being_written(tmp_path: Path) -> None:
    export = HeldExport()
    exports = WeightExports(tmp_path, export)
    with exports.behind(5):
        pass
    assert export.started.wait(10)
    exports.wait_for(str(tmp_path / "checkpoint-hf"), timeout_s=0.01)  # another folder: no wait
    with pytest.raises(ExportError, match="did not finish within 0 s"):
        exports.wait_for(str(exports.path_of(5)), timeout_s=0.01)
    export.release.set()
    exports.wait_for(str(exports.path_of(5)), timeout_s=10)
    exports.close()


def test_a_listener_may_take_a_lock_that_a_waiter_holds(tmp_path: Path) -> None:
    """The fleet's listener takes fleet.lock; an engine's admission waits for the export holding
    it. The listener runs after the waiter is woken, so neither waits for the other."""
    export, fleet_lock = HeldExport(), threading.RLock()
    exports = WeightExports(tmp_path, export)
    recorded: list[str] = []

    def listener(path: str) -> None:
        with fleet_lock:
            recorded.append(path)

    exports.on_written(listener)
    with exports.behind(6) as folder:
        pass
    with fleet_lock:  # the admission
        export.release.set()
        exports.wait_for(str(folder), timeout_s=10)
        loaded = (folder / "config.json").is_file()
    assert loaded
    _wait(lambda: recorded == [str(folder)])
    exports.close()


def test_a_synchronous_write_and_prune(tmp_path: Path) -> None:
    exports = WeightExports(tmp_path, lambda path: Path(path).mkdir())
    first, _ = exports.write(1)
    second, seconds = exports.write(2)
    assert seconds >= 0 and first.is_dir() and second.is_dir()  # the older one stays until the push commits
    exports.prune(keep=second)
    assert [p.name for p in tmp_path.iterdir()] == ["00000002"]
    assert exports.report_behind() is None  # only background exports are reported late


def test_close_logs_a_failed_export_rather_than_raise_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    export = HeldExport()
    export.fail = "disk gone"
    exports = WeightExports(tmp_path, export)
    with exports.behind(7):
        pass
    export.release.set()
    with caplog.at_level(logging.WARNING, logger="milepost.weight_export"):
        exports.close()
    assert "disk gone" in caplog.text


def _wait(condition, timeout_s: float = 10.0) -> None:
    """Until `condition()` (a done callback runs in the export thread, just after the waiter wakes)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.01)


def _write_model(path: str) -> None:
    Path(path, "sub").mkdir(parents=True)
    Path(path, "model.safetensors").write_bytes(b"weights" * 100)
    Path(path, "sub", "tokenizer.json").write_text("{}")


def test_a_checkpoint_links_the_export_this_object_wrote_and_keeps_it_after_pruning(tmp_path: Path) -> None:
    exports = WeightExports(tmp_path / "exports", _write_model)
    written, _ = exports.write(3)
    dest = tmp_path / "checkpoint" / "hf"
    assert exports.link_into(3, dest)
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert files == ["model.safetensors", "sub/tokenizer.json"]
    assert (dest / "model.safetensors").stat().st_ino == (written / "model.safetensors").stat().st_ino
    exports.write(4)
    exports.prune(exports.path_of(4))  # step 3's export goes; the checkpoint's links stay whole
    assert not written.exists() and (dest / "model.safetensors").read_bytes() == b"weights" * 100


def test_a_checkpoint_exports_afresh_where_links_cannot_be_made(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    exports = WeightExports(tmp_path / "exports", _write_model)
    exports.write(2)

    def cross_device(src: object, dst: object) -> None:
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr("milepost.core.weight_export.os.link", cross_device)
    assert not exports.link_into(2, tmp_path / "checkpoint" / "hf")
    assert not (tmp_path / "checkpoint" / "hf").exists()  # nothing half-linked left for the export to meet


def test_a_checkpoint_exports_afresh_what_this_object_did_not_write_whole(tmp_path: Path) -> None:
    root = tmp_path / "exports"
    _write_model(str(root / "00000005"))  # a folder an earlier run left: not known to be these weights
    exports = WeightExports(root, _write_model)
    assert not exports.link_into(5, tmp_path / "a")
    exports.write(6)
    assert not exports.link_into(7, tmp_path / "b")  # another step's
    failing = HeldExport()
    failing.fail, failing_exports = "disk full", WeightExports(tmp_path / "other", failing)
    failing.release.set()
    with pytest.raises(OSError):
        failing_exports.write(8)
    assert not failing_exports.link_into(8, tmp_path / "c")
    assert not any((tmp_path / name).exists() for name in ("a", "b", "c"))
