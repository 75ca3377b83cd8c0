"""Checkpoints: the unit of truth.

A checkpoint is a folder `checkpoints/<step:08d>/` holding the trainer state, `state.json`
(step, policy version, data cursor, RNG, metrics so far) and `MANIFEST.json` (every file's
size and sha256, and the sha256 of that file list itself, so a torn manifest is detected
even when it still parses). `checkpoints/latest` names the newest step, for people and tools.

Save (`CheckpointManager.save`), in this order:
  1. the payload and state.json are written into `.tmp-<step>-<id>/`, every file fsynced;
  2. MANIFEST.json is written last, then the new `latest` text under a temporary name
     (the last write that needs disk space);
  3. the folder is renamed into place: this rename commits the checkpoint;
  4. `latest` is replaced by its new text (a rename), then retention runs.
  Any failure before the commit (a full disk: ENOSPC / EFBIG / EDQUOT, a payload error)
  removes the temporary files and raises `CheckpointSaveError`, which names the step, the
  cause and what to do; `latest` and every committed checkpoint are untouched, and a later
  save works once the cause is gone.

Resume (`latest_valid`) trusts a checkpoint only after verifying it, newest first; a broken
one is skipped with a warning naming the file and the reason, and the next older one is
tried. What is verified, and when:
  - always (cheap: stat calls): MANIFEST.json is present, parses and matches its own
    digest; every file it lists exists with the listed size; state.json parses;
  - the checkpoint returned, i.e. the one a stage resumes from or serves: the sha256 of
    every file too (`deep=True`, the default), hashed by parallel threads and remembered
    per process while no file's size, mtime or inode changes. Measured on 2 cores: sha256
    runs at ~1.2 GB/s per thread (hashlib), so a checkpoint costs about 1 s per GB over the
    threads' count, the order of reading the same bytes to load them; the tiny model's
    checkpoint (0.65 MB, 10 files) verifies in 12 ms deep, 0.6 ms by sizes, 0.9 ms when
    cached, against 50 ms for a rank to load it. Hashing every older candidate on every call
    would multiply that for nothing, hence sizes for them. `deep=False` (sizes only) suits
    read-only reports such as `milepost status`.
`latest` is never what resume relies on: the newest checkpoint that verifies wins, and a
`latest` that is missing, torn, or names another step is reported with a warning. When
committed checkpoints exist and none verifies, `latest_valid` raises
`NoIntactCheckpointError` rather than starting the campaign over from the base model.

Retention (`keep_last`) runs after each save: it keeps the newest `keep_last` checkpoints
that pass the cheap check (broken ones do not count, and any newer than the oldest kept
stay for inspection), and it never deletes a protected step: the one `latest_valid`
returned to this manager (the checkpoint being resumed from, which the fleet was started
from) and any step passed to `protect` (e.g. the one the fleet serves). The best-by-eval
checkpoint lives outside this folder, as `best/<step>/` (tasks/progression.py), which
retention does not touch. Deleting renames the folder out of the committed namespace
first, so a crash mid-delete never leaves a half checkpoint under a step number.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
STATE = "state.json"
LATEST = "latest"
MANIFEST_VERSION = 2
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
SCRATCH_PREFIXES = (".tmp-", ".latest-", ".old-", ".del-")  # never a committed checkpoint


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; nothing of it was committed."""


class NoIntactCheckpointError(RuntimeError):
    """Committed checkpoints exist but none verifies: resuming would lose the campaign."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    state: dict[str, Any]


# --- files ------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems cannot fsync a directory; the rename still orders
        pass


def _fsync_write(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _payload_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


# --- the manifest -------------------------------------------------------------------------
def _files_digest(files: dict[str, Any]) -> str:
    """sha256 of the file list in canonical JSON: what a manifest's own digest covers."""
    canonical = json.dumps(files, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _manifest_for(folder: Path) -> dict[str, Any]:
    """Every file's size and sha256 (every file fsynced), and the list's own digest."""
    paths = _payload_files(folder)
    # The fsyncs wait on the disk, the hashes on the CPU (reading the page cache): one thread
    # syncs while the others hash, so the manifest costs about the larger of the two, not the sum.
    def sync_all() -> None:
        for p in paths:
            _fsync_file(p)

    with ThreadPoolExecutor(HASH_THREADS + 1) as pool:
        synced = pool.submit(sync_all)
        digests = list(pool.map(_sha256, paths))
        synced.result()
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": d}
             for p, d in zip(paths, digests)}
    return {"version": MANIFEST_VERSION, "files": files, "files_sha256": _files_digest(files)}


def read_manifest(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) or (None, why it cannot be trusted)."""
    path = folder / MANIFEST
    if not path.is_file():
        return None, f"{MANIFEST} is missing (the write never committed, or it was deleted)"
    try:
        manifest = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{MANIFEST} is torn or truncated: not valid JSON ({e})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(m, dict) and isinstance(m.get("size"), int) and isinstance(m.get("sha256"), str)
            for m in files.values()):
        return None, f"{MANIFEST} is torn: it has no well-formed file list"
    if manifest.get("version", 1) >= 2 and manifest.get("files_sha256") != _files_digest(files):
        return None, f"{MANIFEST} is torn: its file list does not match its own sha256"
    if STATE not in files:
        return None, f"{MANIFEST} does not list {STATE}"
    return manifest, None


def _check_sizes(folder: Path, manifest: dict[str, Any]) -> str | None:
    for rel, meta in sorted(manifest["files"].items()):
        p = folder / rel
        if not p.is_file():
            return f"{rel} is missing (listed in {MANIFEST})"
        size = p.stat().st_size
        if size != meta["size"]:
            return f"{rel} is truncated or torn: {size} bytes, {MANIFEST} says {meta['size']}"
    return None


def _check_digests(folder: Path, manifest: dict[str, Any]) -> str | None:
    items = sorted(manifest["files"].items(), key=lambda kv: -kv[1]["size"])  # big files first
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = list(pool.map(lambda kv: _sha256(folder / kv[0]), items))
    for (rel, meta), digest in zip(items, digests):
        if digest != meta["sha256"]:
            return f"{rel} is torn: its sha256 does not match {MANIFEST}"
    return None


def _stat_key(folder: Path, manifest: dict[str, Any]) -> tuple[Any, ...]:
    """What must not change for an earlier sha256 verification to still hold."""
    stats = []
    for rel in sorted(manifest["files"]) + [MANIFEST]:
        st = (folder / rel).stat()
        stats.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(stats)


def _errno_in(error: BaseException) -> int | None:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    return None


def _space_problem(root: Path, error: BaseException, needed_bytes: int) -> str | None:
    """Why a write under `root` may have failed for lack of room, or None. Writers such as
    torch.save report a failed write without its errno, so the limits are looked at too."""
    import resource

    code = _errno_in(error)
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if code == errno.EFBIG or soft != resource.RLIM_INFINITY:
        limit = "" if soft == resource.RLIM_INFINITY else f" (this process may not write files over {soft} bytes)"
        return (f"a file is larger than this process may write{limit}: raise the file size limit "
                "(`ulimit -f`, or the job's limits) and rerun the stage")
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    if code in (errno.ENOSPC, errno.EDQUOT) or free < max(needed_bytes, 64 << 20):
        return (f"the filesystem of {root} is full ({free / 2**20:.1f} MiB free, this checkpoint needs more than "
                f"{needed_bytes / 2**20:.1f} MiB): free space there (or lower checkpoint.keep_last) and rerun the "
                "stage")
    return None


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


class CheckpointManager:
    """Writes, verifies, finds and prunes the checkpoints under `root` (rules: module doc).

    One writer per campaign (the lease); readers may run alongside it: they only ever see
    committed folders."""

    def __init__(self, root: str | Path, keep_last: int = 3) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self._protected: set[int] = set()
        self._resumed_from: int | None = None
        self._deep_verified: dict[Path, tuple[Any, ...]] = {}

    def step_dir(self, step: int) -> Path:
        return self.root / f"{step:08d}"

    # --- save -------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], write_payload: Callable[[Path], None]) -> Path:
        """Write a checkpoint: payload → state.json → manifest → (rename: commit) → latest.
        Raises CheckpointSaveError when anything before the commit fails; then nothing of
        this checkpoint is visible and `latest` still names the previous one."""
        self.root.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex[:8]
        tmp = self.root / f".tmp-{step:08d}-{token}"
        pointer_tmp = self.root / f".latest-{token}"
        try:
            tmp.mkdir()
            write_payload(tmp)
            _fsync_write(tmp / STATE, json.dumps(state, sort_keys=True))
            _fsync_write(tmp / MANIFEST, json.dumps(_manifest_for(tmp), indent=1, sort_keys=True))
            _fsync_dir(tmp)
            _fsync_write(pointer_tmp, str(step))
            final = self._commit_folder(tmp, step, token)
        except Exception as e:
            written = _folder_bytes(tmp)
            _remove(tmp)
            _remove(pointer_tmp)
            raise CheckpointSaveError(self._save_failure(step, e, written)) from e
        except BaseException:  # KeyboardInterrupt, SystemExit: clean up, raise as it is
            _remove(tmp)
            _remove(pointer_tmp)
            raise
        self._deep_verified.pop(final, None)
        try:
            pointer_tmp.replace(self.root / LATEST)
            _fsync_dir(self.root)
        except OSError as e:  # the checkpoint is committed; `latest` is advisory (module doc)
            log.warning("checkpoint %s is committed but %s could not be moved to it (%s); resume "
                        "still finds it", final, self.root / LATEST, e)
        try:
            self.prune()
        except OSError as e:  # the save itself succeeded; the next save prunes again
            log.warning("retention after saving %s failed (%s); it runs again after the next save", final, e)
        return final

    def _commit_folder(self, tmp: Path, step: int, token: str) -> Path:
        """Rename `tmp` to the step's folder. A folder already there (an earlier attempt at
        the same step, or a checkpoint being replaced) is moved aside first and deleted
        after, so the step never names a half-written folder."""
        final = self.step_dir(step)
        aside = self.root / f".old-{step:08d}-{token}"
        if final.exists():
            final.rename(aside)
        try:
            tmp.rename(final)
        except OSError:
            if aside.exists():
                aside.rename(final)
            raise
        _fsync_dir(self.root)
        _remove(aside)
        return final

    def _save_failure(self, step: int, error: BaseException, written_bytes: int) -> str:
        """The message of a failed save: what failed, what is kept, why (room or limits), what to do."""
        previous = self._read_pointer()[0]
        kept = f"`latest` still names step {previous}" if previous is not None else "no checkpoint was committed before"
        what = (f"checkpoint of step {step} was not saved ({type(error).__name__}: {error}); nothing of it is "
                f"committed and {kept}.")
        why = _space_problem(self.root, error, written_bytes)
        todo = f"Likely cause: {why}" if why else "Fix the cause above and rerun the stage"
        return f"{what} {todo}; it then resumes from the previous checkpoint."

    # --- verify and find ------------------------------------------------------------------
    def verify(self, folder: Path, deep: bool = True) -> str | None:
        """None if the checkpoint is intact, else why it is not (naming the file). `deep`:
        also compare every file's sha256 (module doc: when)."""
        folder = Path(folder)
        manifest, problem = read_manifest(folder)
        if manifest is None:
            return problem
        problem = _check_sizes(folder, manifest)
        if problem:
            return problem
        try:
            json.loads((folder / STATE).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return f"{STATE} is torn: not valid JSON ({e})"
        if deep:
            key = _stat_key(folder, manifest)
            if self._deep_verified.get(folder) != key:
                problem = _check_digests(folder, manifest)
                if problem:
                    self._deep_verified.pop(folder, None)
                    return problem
                self._deep_verified[folder] = key
        return None

    def committed_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.name) for p in self.root.iterdir() if p.is_dir() and p.name.isdigit())

    def _read_pointer(self) -> tuple[int | None, str | None]:
        """(step named by `latest`, None) or (None, why it cannot be read)."""
        path = self.root / LATEST
        if not path.is_file():
            return None, f"{path} is missing"
        raw = path.read_bytes()
        try:
            return int(raw.decode().strip()), None
        except (UnicodeDecodeError, ValueError):
            return None, f"{path} is torn: {raw[:40]!r} is not a step number"

    def _warn_about_pointer(self, chosen: int | None) -> None:
        step, problem = self._read_pointer()
        if problem and chosen is not None:
            log.warning("%s; resuming from the newest intact checkpoint, step %d", problem, chosen)
        elif step is not None and step != chosen:
            log.warning("%s names step %d, but the newest intact checkpoint is %s (latest is torn, names a "
                        "broken checkpoint, or a save stopped before moving it)", self.root / LATEST, step,
                        f"step {chosen}" if chosen is not None else "none")

    def latest_valid(self, deep: bool = True) -> CheckpointInfo | None:
        """The newest intact checkpoint (broken ones are skipped with a warning naming the
        file and the reason); None for a campaign with no committed checkpoint. The one
        returned is protected from retention in this manager (the checkpoint in use)."""
        steps = self.committed_steps()
        problems = []
        for step in reversed(steps):
            folder = self.step_dir(step)
            problem = self.verify(folder, deep=deep)
            if problem:
                log.warning("skipping checkpoint %s: %s; trying the previous one", folder, problem)
                problems.append(f"step {step}: {problem}")
                continue
            self._warn_about_pointer(step)
            self._resumed_from = step
            return CheckpointInfo(step=step, path=folder, state=json.loads((folder / STATE).read_text()))
        if steps:
            raise NoIntactCheckpointError(
                f"no checkpoint under {self.root} is intact ({'; '.join(problems)}): resuming from the base model "
                "would start the campaign over. Restore the checkpoints folder from a copy, or start a new campaign.")
        return None

    # --- retention ----------------------------------------------------------------------
    def protect(self, step: int) -> None:
        """Retention in this manager never deletes `step` (e.g. the checkpoint a fleet serves)."""
        self._protected.add(step)

    def protected_steps(self) -> set[int]:
        return self._protected | ({self._resumed_from} if self._resumed_from is not None else set())

    def step_of(self, path: str | Path) -> int | None:
        """The step of a checkpoint folder that `path` lies in (e.g. `<root>/00000012/hf`), else None."""
        try:
            rel = Path(path).resolve().relative_to(self.root.resolve())
        except ValueError:
            return None
        return int(rel.parts[0]) if rel.parts and rel.parts[0].isdigit() else None

    def prune(self) -> None:
        """Apply retention (module doc); leftovers of interrupted saves are removed too."""
        if not self.root.is_dir():
            return
        for leftover in self.root.iterdir():
            if leftover.name.startswith(SCRATCH_PREFIXES):
                _remove(leftover)
        keep, intact = set(), 0
        for step in reversed(self.committed_steps()):
            if intact >= self.keep_last:
                break
            keep.add(step)
            intact += self.verify(self.step_dir(step), deep=False) is None
        for step in self.committed_steps():
            if step not in keep and step not in self.protected_steps():
                self._delete(step)

    _prune = prune  # the name earlier callers used

    def _delete(self, step: int) -> None:
        folder = self.step_dir(step)
        doomed = self.root / f".del-{step:08d}-{uuid.uuid4().hex[:8]}"
        try:
            folder.rename(doomed)
        except OSError as e:
            log.warning("retention could not remove checkpoint %s (%s)", folder, e)
            return
        self._deep_verified.pop(folder, None)
        log.info("retention (keep_last=%d): removed checkpoint %s", self.keep_last, folder)
        _remove(doomed)
