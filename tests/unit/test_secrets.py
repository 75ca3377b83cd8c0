"""Per-campaign secrets and the Ray token: created once, owner-only, passed by path."""

from __future__ import annotations

import os
import stat
from concurrent.futures import ProcessPoolExecutor

import pytest

from milepost.core.secrets import ensure_secret, read_secret
from milepost.core.store import CampaignStore
from milepost.tasks.ray_auth import campaign_ray_auth, ray_auth_env


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_secret_is_created_once_with_owner_only_permissions(tmp_path):
    path = ensure_secret(tmp_path, "ray_auth_token")
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    value = read_secret(tmp_path, "ray_auth_token")
    assert len(value) == 64 and read_secret(tmp_path, "ray_auth_token") == value
    assert read_secret(tmp_path, "engine_admin_key") != value


def test_a_secret_made_readable_by_others_is_made_owner_only_again(tmp_path):
    path = ensure_secret(tmp_path, "ray_auth_token")
    os.chmod(path, 0o644)
    ensure_secret(tmp_path, "ray_auth_token")
    assert _mode(path) == 0o600


def test_concurrent_creators_agree_on_one_value(tmp_path):
    with ProcessPoolExecutor(4) as pool:
        values = list(pool.map(read_secret, [tmp_path] * 8, ["ray_auth_token"] * 8))
    assert len(set(values)) == 1
    assert [p.name for p in (tmp_path / "secrets").iterdir()] == ["ray_auth_token"]  # no temp file left


def test_secret_names_cannot_leave_the_secrets_folder(tmp_path):
    with pytest.raises(ValueError, match="letters, digits"):
        ensure_secret(tmp_path, "../campaign.yaml")


def test_the_ray_environment_names_the_campaign_token_by_path_only(tmp_path, monkeypatch):
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    env = ray_auth_env(CampaignStore(str(tmp_path)))
    token = read_secret(tmp_path, "ray_auth_token")
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "secrets" / "ray_auth_token")}
    assert token not in repr(env)


def test_a_users_own_ray_auth_settings_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert ray_auth_env(CampaignStore(str(tmp_path))) == {"RAY_AUTH_MODE": "disabled"}
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/etc/my-ray-token")
    assert ray_auth_env(CampaignStore(str(tmp_path))) == {"RAY_AUTH_MODE": "token"}
    assert not (tmp_path / "secrets").exists()


def test_one_campaigns_token_path_does_not_outlive_its_stage(tmp_path, monkeypatch):
    # A process that runs stages of two campaigns in turn (a test session, a notebook): had the
    # first campaign's token path stayed in the environment, the second would take it for the
    # user's own setting and its Ray head would not accept the second campaign's token.
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    first, second = CampaignStore(str(tmp_path / "a")), CampaignStore(str(tmp_path / "b"))
    with campaign_ray_auth(first):
        assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "a" / "secrets" / "ray_auth_token")
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ and "RAY_AUTH_MODE" not in os.environ
    with campaign_ray_auth(second):
        assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "b" / "secrets" / "ray_auth_token")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(RuntimeError), campaign_ray_auth(first):
        raise RuntimeError("a stage that fails")
    assert os.environ["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN_PATH" not in os.environ
