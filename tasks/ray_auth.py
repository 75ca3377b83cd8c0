"""The campaign's Ray token: what lets a fresh machine (no ~/.ray) start and join its clusters.

Ray 2.60 runs with token authentication (`RAY_AUTH_MODE=token`), and `ray start --head`
refuses to start when no token exists yet; only `ray.init()` of a local cluster creates
`~/.ray/auth_token`. So milepost creates the token itself, once per campaign, as the
owner-only secret `<campaign>/secrets/ray_auth_token` (core.secrets), and points every
process of the campaign at it by path (`RAY_AUTH_TOKEN_PATH`): the local head, the Slurm
allocation's head and workers (the store is the shared filesystem all nodes see), every
stage job's driver. The value itself is never on a command line, in a record or a log.

A user who manages Ray auth themselves keeps control: `RAY_AUTH_MODE=disabled`, or their
own `RAY_AUTH_TOKEN` / `RAY_AUTH_TOKEN_PATH` in the environment, are left as they are.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from milepost.core.secrets import ensure_secret
from milepost.core.store import CampaignStore

RAY_TOKEN_SECRET = "ray_auth_token"
_USER_SETTINGS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def ray_auth_env(store: CampaignStore) -> dict[str, str]:
    """The environment a process of this campaign needs to start or join its Ray cluster."""
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode != "token":
        return {"RAY_AUTH_MODE": mode}
    if any(os.environ.get(name) for name in _USER_SETTINGS):
        return {"RAY_AUTH_MODE": mode}  # the user's own token wins
    path = ensure_secret(store.local_path(), RAY_TOKEN_SECRET)
    return {"RAY_AUTH_MODE": mode, "RAY_AUTH_TOKEN_PATH": str(path)}


def use_campaign_ray_auth(store: CampaignStore) -> dict[str, str | None]:
    """Set this process's (and its children's) Ray auth environment for the campaign.

    Returns what the variables were before, for `restore_environment`: a process that runs
    stages of several campaigns in turn (a test session, a notebook) must not carry one
    campaign's token path into the next, where it would count as the user's own setting.
    """
    wanted = ray_auth_env(store)
    previous = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    _reload_ray_auth_state()
    return previous


def restore_environment(previous: dict[str, str | None]) -> None:
    """Put back the variables `use_campaign_ray_auth` changed (unset the ones that were unset)."""
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _reload_ray_auth_state()


def _reload_ray_auth_state() -> None:
    """Make Ray in this process read the auth variables again. Ray caches the token it loaded
    first (`AuthenticationTokenLoader`) and the auth mode (`RayConfig`) per process, so a
    process that connected to one campaign's cluster (or started a local one, with its
    ~/.ray token) would present that token to the next cluster and be refused
    (`InvalidAuthToken`). Only between connections: Ray's core worker reads them while
    connected."""
    import sys
    ray = sys.modules.get("ray")
    if ray is None or ray.is_initialized():
        return
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # private, no stubs
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def campaign_ray_auth(store: CampaignStore) -> Iterator[None]:
    """The campaign's Ray auth environment for the duration of a block of code."""
    previous = use_campaign_ray_auth(store)
    try:
        yield
    finally:
        restore_environment(previous)
