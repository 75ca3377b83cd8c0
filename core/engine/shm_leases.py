"""The engine's view of the trainer's shared-memory bucket files (tensor transport).

Files are mapped once and the mappings cached (pages mapped up front, so later pushes into
the same files cost no page faults). A `Lease` is a shared flock on one file, held while any
staged or live tensor of the engine lives in it; the trainer never rewrites a locked file
(protocol in milepost.core.weight_sync.wire).
"""

from __future__ import annotations

import os

import torch

from milepost.core.weight_sync import wire

MAX_CACHED_FILES = 64


class LeaseError(Exception):
    pass


class Lease:
    """Reference-counted shared lock on one file; `refs` counts the tensors using it."""

    def __init__(self, path: str, ident: tuple[int, int]) -> None:
        self.path, self.ident, self.refs, self.fd = path, ident, 0, -1

    def acquire(self) -> None:
        if self.refs == 0:
            fd = os.open(self.path, os.O_RDONLY)
            if wire.file_identity(fd) != self.ident or not wire.try_lock(fd, exclusive=False):
                os.close(fd)
                raise LeaseError(f"{self.path} was replaced or is being written by the trainer")
            self.fd = fd
        self.refs += 1

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            os.close(self.fd)  # drops the flock: the trainer may reuse the file
            self.fd = -1


class ShmFiles:
    """Cached mappings and leases by file name. Not thread-safe: the receiver calls it only
    under its update lock."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[Lease, torch.Tensor]] = {}

    def open(self, name: str, generation: int) -> tuple[Lease, torch.Tensor]:
        """The file's mapping and lease, after checking it holds write `generation`. The
        caller acquires the lease once per tensor it keeps."""
        path = wire.shm_path(name)
        try:
            ident = wire.file_identity(path)
        except FileNotFoundError:
            raise LeaseError(f"shared-memory buffer {name} does not exist on this host") from None
        cached = self._files.get(name)
        if cached is None or cached[0].ident != ident:
            self._evict()
            fd = os.open(path, os.O_RDWR)
            try:
                buf = wire.map_fd(fd)
            finally:
                os.close(fd)
            cached = self._files[name] = (Lease(path, ident), buf)
        lease, buf = cached
        lease.acquire()  # under the lock the header cannot change
        try:
            if wire.read_generation(buf) != generation:
                raise LeaseError(f"{name} holds another write than the one described (rewritten since?)")
        except LeaseError:
            lease.release()
            raise
        return lease, buf

    def prune(self) -> None:
        """Forget unused mappings of files that were unlinked or replaced, so their memory
        is freed (a mapping of an unlinked file would keep it)."""
        for name, (lease, _) in list(self._files.items()):
            if lease.refs == 0:
                try:
                    current = wire.file_identity(lease.path)
                except FileNotFoundError:
                    current = None
                if current != lease.ident:
                    del self._files[name]

    def _evict(self) -> None:
        """Forget mappings of unused files beyond the cap (live tensors keep theirs alive)."""
        idle = [n for n, (lease, _) in self._files.items() if lease.refs == 0]
        for name in idle[:max(0, len(self._files) - MAX_CACHED_FILES + 1)]:
            del self._files[name]
