"""The campaign's single-writer lease: `<campaign>/lease.json`.

Two runs of one campaign must never write at once (two `milepost run`s, a `milepost run`
beside an Airflow run, two Airflow deployments pointed at one store). Whoever runs blocks
holds the lease:

    {"owner": "airflow:milepost_tiny_arith/manual__…" | "milepost-run:host:pid",
     "host", "pid", "pid_created_at", "acquired_at", "renewed_at", "expires_at"}

Rules (what `acquire` enforces):
- a free store, an expired lease, or a lease of the same owner is taken (renewed);
- a lease of a local process (`pid` on this host) whose process is gone is stale: taken at
  once, so a SIGKILLed `milepost run` can be rerun without waiting for the expiry;
- anything else is refused with `LeaseHeldError`, naming the owner and when it expires.

The holder renews it (`renew`) well before `expires_at`: `milepost run` from a thread,
an Airflow run from every task and from the stage trigger's polls. `release` gives it back.

Read-modify-write races: on a local store the read and the write happen under an
exclusive `flock` of `<campaign>/.lease.lock`; on a remote store (s3://…) the write is
atomic but the check is not, so two acquisitions in the same second could both pass —
documented, and the reason deployments should point one Airflow at one store.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Self

import psutil

from milepost.core.store import CampaignStore

if TYPE_CHECKING:
    import threading

LEASE_DOC = "lease.json"
DEFAULT_TTL_S = 600.0


class LeaseHeldError(RuntimeError):
    """Another run holds the campaign's lease; the message names it and says what to do."""


def local_owner() -> str:
    return f"milepost-run:{socket.gethostname()}:{os.getpid()}"


def _stale_local_process(lease: dict[str, Any]) -> bool:
    """The lease names a process on this host that no longer exists (or whose pid was reused)."""
    if lease.get("host") != socket.gethostname() or not lease.get("pid"):
        return False
    try:
        proc = psutil.Process(int(lease["pid"]))
        created = lease.get("pid_created_at")
        return (created is not None and abs(proc.create_time() - float(created)) > 1.0) or \
            proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@contextlib.contextmanager
def _locked(store: CampaignStore) -> Iterator[None]:
    if "file" not in store.fs.protocol and store.fs.protocol not in ("file", ("file", "local")):
        yield  # remote store: best effort (see the module docstring)
        return
    import fcntl

    os.makedirs(store.root, exist_ok=True)
    with open(os.path.join(store.root, ".lease.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_lease(store: CampaignStore) -> dict[str, Any] | None:
    return store.read_json(LEASE_DOC) if store.exists(LEASE_DOC) else None


def _describe(lease: dict[str, Any], now: float) -> str:
    where = f" (pid {lease['pid']} on {lease['host']})" if lease.get("pid") else ""
    return f"{lease['owner']}{where}, lease expires in {max(0.0, lease['expires_at'] - now):.0f}s"


def acquire(store: CampaignStore, owner: str, ttl_s: float = DEFAULT_TTL_S, *,
            pid: int | None = None) -> dict[str, Any]:
    """Take or renew the lease for `owner`; `pid` (a local process that holds it) lets a
    later run take over at once when that process is gone. Raises LeaseHeldError."""
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    with _locked(store):
        now = time.time()
        current = read_lease(store)
        if current and current.get("owner") != owner and current.get("expires_at", 0.0) > now \
                and not _stale_local_process(current):
            raise LeaseHeldError(
                f"campaign {store.url} is being run by {_describe(current, now)}. Two runs of one campaign "
                "never write at once: wait for that run to end, stop it, or use another campaign URL.")
        mine = current if current and current.get("owner") == owner else {}
        # Same owner: keep what it recorded (the pid of an embedded `milepost run`).
        doc: dict[str, Any] = {"host": socket.gethostname(), "acquired_at": now, **mine, "owner": owner,
                               "renewed_at": now, "expires_at": now + ttl_s, "ttl_s": ttl_s}
        if pid is not None:
            doc.update(pid=pid, pid_created_at=psutil.Process(pid).create_time())
        store.write_json(LEASE_DOC, doc)
        return doc


def renew(store: CampaignStore, owner: str, ttl_s: float | None = None) -> dict[str, Any]:
    """Extend `owner`'s lease; LeaseHeldError if it lost the lease to another run meanwhile."""
    with _locked(store):
        now = time.time()
        current = read_lease(store)
        if not current or current.get("owner") != owner:
            holder = _describe(current, now) if current else "nobody"
            raise LeaseHeldError(f"{owner} no longer holds the lease of {store.url} (held by {holder}); "
                                 "this run stops writing: another run took the campaign over.")
        ttl = float(ttl_s or current.get("ttl_s") or DEFAULT_TTL_S)
        doc = {**current, "renewed_at": now, "expires_at": now + ttl}
        store.write_json(LEASE_DOC, doc)
        return doc


def release(store: CampaignStore, owner: str) -> bool:
    """Give the lease back if `owner` holds it; True if it did."""
    with _locked(store):
        current = read_lease(store)
        if not current or current.get("owner") != owner:
            return False
        store.fs.rm(store.path(LEASE_DOC))
        return True


class LeaseKeeper:
    """Holds a lease for the life of a `with` block, renewing it from a daemon thread every
    ttl/3 (so a lease outlives a stalled renewal twice before another run may take it)."""

    def __init__(self, store: CampaignStore, owner: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.store, self.owner, self.ttl_s = store, owner, ttl_s
        self.lost: LeaseHeldError | None = None
        self._stop: threading.Event | None = None

    def __enter__(self) -> Self:
        import threading

        acquire(self.store, self.owner, self.ttl_s, pid=os.getpid())
        self._stop = threading.Event()
        threading.Thread(target=self._renew_loop, daemon=True, name="lease-renewal").start()
        return self

    def _renew_loop(self) -> None:
        assert self._stop is not None
        while not self._stop.wait(self.ttl_s / 3):
            try:
                renew(self.store, self.owner, self.ttl_s)
            except LeaseHeldError as e:
                self.lost = e
                return
            except OSError:  # a transient store error: the next round retries before expiry
                continue

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._stop.set()
        release(self.store, self.owner)
