"""Store integrity on real checkpoints (issue 16): the files are written by the real save path
(`CheckpointManager.save` around the torch backend's `save_state` + `export_hf`, as the loop
does), then broken on disk the ways storage breaks them.

- A checkpoint torn at each file boundary resumes from the previous good one: for EVERY file
  of the newest checkpoint, and its MANIFEST.json, truncated to half, bytes flipped, or
  deleted, the manager skips it with a warning naming the file, and the backend resumes
  from the previous checkpoint (its weights' sha256 is the one recorded there). A torn
  `latest` is reported and the newest intact checkpoint is used.
- A full disk during save (a real OS-level failure: RLIMIT_FSIZE makes writes fail with
  EFBIG, at limits that stop the save at different files; and, where mounting is allowed,
  a small tmpfs that runs out of space: ENOSPC) fails the save with a clear error, leaves
  no half checkpoint and no temporary file, keeps `latest` on the previous checkpoint, and
  a later save works.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tinymodels import random_train_samples, save_tiny_qwen2

from milepost.core.checkpoint import MANIFEST, CheckpointManager
from milepost.core.config import AlgoConfig, TrainConfig
from milepost.core.train.torch_backend import TorchBackend

VOCAB = 32
TEARS = ("truncate", "flip", "delete")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), seed=0, vocab=VOCAB)


def tear(path: Path, how: str) -> None:
    """Break a file the way storage does: cut at half, flip bytes in the middle, or lose it."""
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 4]) + data[mid + 4:])
    else:
        path.unlink()


def _save(mgr: CheckpointManager, backend: TorchBackend, step: int) -> dict:
    state = {"step": step, "policy_version": step, "cursor": {}, "metrics": [],
             "model_sha256": backend.weights_sha256()}

    def payload(folder: Path) -> None:  # what RLLoop.save_checkpoint writes
        backend.save_state(str(folder / "trainer"))
        backend.export_hf(str(folder / "hf"))

    mgr.save(step, state, payload)
    return state


def test_a_checkpoint_torn_at_each_file_resumes_from_the_previous_good_one(ray_cluster, model_path, tmp_path,
                                                                           caplog):
    cfg = TrainConfig(num_ranks=2, micro_batch_size=4, lr=1e-2)
    backend = TorchBackend.create(model_path, cfg, AlgoConfig(), 0.7, seed=7, total_steps=10)
    try:
        mgr = CheckpointManager(tmp_path / "checkpoints", keep_last=3)
        backend.train_step(random_train_samples(8, 1, VOCAB), step=1)
        good = _save(mgr, backend, 1)
        backend.train_step(random_train_samples(8, 2, VOCAB), step=2)
        newest = _save(mgr, backend, 2)
        assert newest["model_sha256"] != good["model_sha256"]
        folder = mgr.step_dir(2)
        files = sorted(json.loads((folder / MANIFEST).read_text())["files"]) + [MANIFEST]
        assert {"trainer/model.pt", "trainer/optim_rank1.pt", "trainer/rng_rank0.pt", "hf/model.safetensors",
                "state.json"} <= set(files)
        assert len(files) >= 12, files  # 7 trainer files (2 ranks), 3 hf files, state.json, the manifest
        pristine = tmp_path / "pristine"
        shutil.copytree(folder, pristine)

        for rel in files:
            for how in TEARS:
                shutil.rmtree(folder)
                shutil.copytree(pristine, folder)
                tear(folder / rel, how)
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="milepost.core.checkpoint"):
                    latest = CheckpointManager(mgr.root).latest_valid()  # a fresh process's view
                assert latest is not None and latest.step == 1, (rel, how)
                skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
                assert len(skipped) == 1 and rel in skipped[0] and str(folder) in skipped[0], (rel, how, skipped)
                backend.load_state(str(latest.path / "trainer"))
                assert backend.weights_sha256() == good["model_sha256"], (rel, how)
        shutil.rmtree(folder)
        shutil.copytree(pristine, folder)
        assert CheckpointManager(mgr.root).latest_valid().step == 2  # the pristine copy verifies again

        # `latest` itself torn: resume does not rely on it; the newest intact checkpoint is used
        pointer = mgr.root / "latest"
        for how in TEARS:
            pointer.write_text("2")
            tear(pointer, how)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="milepost.core.checkpoint"):
                assert CheckpointManager(mgr.root).latest_valid().step == 2, how
            assert str(pointer) in caplog.text and "step 2" in caplog.text, how
    finally:
        backend.shutdown()


SAVE_SCRIPT = textwrap.dedent("""
    import json, os, resource, signal, sys
    from pathlib import Path
    from milepost.core.checkpoint import CheckpointManager, CheckpointSaveError
    from milepost.core.config import AlgoConfig, TrainConfig
    from milepost.core.train.torch_backend import RankWorker

    model_path, root, mode, arg = sys.argv[1:5]
    # The rank's real save and export, in this process (world size 1), so the limit applies to them.
    worker = RankWorker(0, 1, model_path, TrainConfig(num_ranks=1), AlgoConfig(), 0.7, seed=7, total_steps=10)
    worker.setup(worker.free_port())

    def payload(folder):
        (folder / "trainer").mkdir()
        worker.save(str(folder / "trainer"))
        worker.export(str(folder / "hf"))

    def state(step):
        return {"step": step, "policy_version": step, "model_sha256": worker.sha256()}

    def view(mgr):
        return {"entries": sorted(p.name for p in mgr.root.iterdir()),
                "latest": (mgr.root / "latest").read_text(), "valid": mgr.latest_valid().step}

    mgr = CheckpointManager(root, keep_last=3)
    mgr.save(1, state(1), payload)
    out = {"sizes": json.loads((mgr.step_dir(1) / "MANIFEST.json").read_text())["files"], "failures": []}
    attempts = [int(x) for x in arg.split(",")] if mode == "fsize" else [None]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    for limit in attempts:
        filler = Path(arg) if mode == "enospc" else None
        if filler is not None:  # fill the disk to below one more checkpoint
            with open(filler, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"x" * 65536)
                except OSError:
                    pass
            os.truncate(filler, os.path.getsize(filler) - 3 * 65536)
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        try:
            mgr.save(2, state(2), payload)
            out["failures"].append({"limit": limit, "error": None})
        except CheckpointSaveError as e:
            out["failures"].append({"limit": limit, "error": str(e), "cause": repr(e.__cause__), **view(mgr)})
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            if filler is not None:
                filler.unlink()
    mgr.save(2, state(2), payload)  # the cause is gone: a later save works
    out["after"] = view(mgr)
    print("RESULT " + json.dumps(out))
""")


def _run_save_script(model_path: str, root: Path, mode: str, arg: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", SAVE_SCRIPT, model_path, str(root), mode, arg],
                          capture_output=True, text=True, timeout=300, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"save script failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _assert_failed_cleanly(failure: dict, reason: str) -> None:
    assert failure["error"] is not None, f"the save at limit {failure['limit']} did not fail"
    error = failure["error"]
    assert "checkpoint of step 2 was not saved" in error and "`latest` still names step 1" in error, error
    assert reason in error and "rerun the stage" in error, error
    assert failure["entries"] == ["00000001", "latest"], failure  # no half checkpoint, no temp file
    assert failure["latest"] == "1" and failure["valid"] == 1


def test_a_full_disk_fails_the_save_cleanly_and_keeps_latest(model_path, tmp_path):
    root = tmp_path / "probe"
    sizes = _run_save_script(model_path, root, "fsize", "1000000000")["sizes"]  # a limit no file reaches
    # One limit below each distinct file size: each makes the first file written that is larger
    # fail with EFBIG (model.pt is written first, so most stop there, the others at a larger one).
    limits = sorted({meta["size"] - 1 for meta in sizes.values() if meta["size"] > 64})
    assert len(limits) >= 3, sizes
    out = _run_save_script(model_path, tmp_path / "checkpoints", "fsize", ",".join(map(str, limits)))
    for failure in out["failures"]:
        _assert_failed_cleanly(failure, "raise the file size limit (`ulimit -f`")
    assert out["after"] == {"entries": ["00000001", "00000002", "latest"], "latest": "2", "valid": 2}


def test_a_full_tmpfs_fails_the_save_cleanly_and_keeps_latest(model_path, tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True,
                        check=False).returncode == 0 if os.geteuid() == 0 else False
    if not ok:
        pytest.skip("mounting a tmpfs needs root; the RLIMIT_FSIZE test covers the full disk without it")
    try:
        out = _run_save_script(model_path, mount / "checkpoints", "enospc", str(mount / "filler"))
        [failure] = out["failures"]
        _assert_failed_cleanly(failure, "checkpoints is full (")
        assert "free space there (or lower checkpoint.keep_last)" in failure["error"], failure["error"]
        assert out["after"] == {"entries": ["00000001", "00000002", "latest"], "latest": "2", "valid": 2}
    finally:
        subprocess.run(["umount", str(mount)], check=False)
