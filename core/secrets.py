"""Per-campaign secrets (the Ray cluster token, the engines' admin key), kept in the store.

A secret is a random token in `<campaign>/secrets/<name>`, created once with owner-only
permissions (folder 0700, file 0600) and never written anywhere else: not in the recipe,
records, metrics or logs. The store is the shared filesystem every node of a Slurm
allocation sees, so every node reads the same token; processes get its *path* (e.g.
`RAY_AUTH_TOKEN_PATH`) or read it themselves, never the value on a command line.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

SECRETS_DIR = "secrets"
TOKEN_BYTES = 32


def secret_path(store_root: str | Path, name: str) -> Path:
    """Where the campaign's secret `name` lives (created on first use by `ensure_secret`)."""
    if not name.replace("_", "").isalnum():
        raise ValueError(f"secret name {name!r}: letters, digits and `_` only")
    return Path(store_root) / SECRETS_DIR / name


def ensure_secret(store_root: str | Path, name: str) -> Path:
    """The path of the campaign's secret `name`, creating it (owner-only) if missing.
    Safe against concurrent creators: the first `O_EXCL` create wins, the others read it."""
    path = secret_path(store_root, name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if not path.exists():
        tmp = path.with_name(f".{name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(TOKEN_BYTES))
        try:
            os.link(tmp, path)  # atomic, and fails if another process created it first
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    return path


def read_secret(store_root: str | Path, name: str) -> str:
    """The value of the campaign's secret `name` (created if missing)."""
    return ensure_secret(store_root, name).read_text().strip()
