"""Where an Airflow of milepost's own lives and how it is started: the environment of
`milepost airflow up` (a real scheduler) and of the embedded runner (dags/embedded.py), the
embedded runner's home, its block logs and its command line. Light: no Airflow import, so
`milepost run` (the parent of the embedded runner) and `milepost airflow` use it freely.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from milepost.core.records import (
    CAMPAIGNS_FILE_ENV,
    EMBEDDED_DRIVER_PID_ENV,
    LEASE_OWNER_ENV,
    RECIPE_DOC,
    block_label,
    campaign_id,
)
from milepost.core.store import CampaignStore

# The embedded runner's exit status, which `milepost run` returns.
EXIT_DONE, EXIT_FAILED, EXIT_REFUSED, EXIT_PAUSED = 0, 1, 2, 3
EMBEDDED_POLL_S = 0.5  # how often an in-process trigger looks at a local stage (the default is 5 s)
EMBEDDED_RETRY_DELAY_S = 5.0


def dags_folder() -> Path:
    return Path(__file__).resolve().parent


def embedded_home(store: CampaignStore) -> Path:
    return Path(store.local_path("airflow")).resolve()


def block_log(store: CampaignStore, block: int) -> Path:
    """Every task log of the block's embedded DAG run, in order (`milepost run` names it)."""
    return embedded_home(store) / "logs" / f"{block_label(block)}.log"


def airflow_env(home: Path, campaigns_file: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of an Airflow of our own: its home, the project's dags, no examples."""
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder()),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__LOGGING__COLORED_CONSOLE_LOG": "False", **extra}
    if campaigns_file is not None:
        env[CAMPAIGNS_FILE_ENV] = str(campaigns_file)
    return env


def embedded_env(store: CampaignStore, dag_id: str, driver_pid: int, lease_owner: str) -> dict[str, str]:
    """The embedded runner's environment: its campaigns file names only this campaign (its
    stored recipe as the DAG's recipe); its stage operators learn that they run embedded,
    which process their local stage jobs die with, and whose lease they write under."""
    home = embedded_home(store)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    listing = home / "campaigns.yaml"
    listing.write_text(yaml.safe_dump([{
        "recipe": os.path.abspath(store.local_path(RECIPE_DOC)), "campaign_url": campaign_id(store.url),
        "dag_id": dag_id, "tags": ["embedded"],
        "poll_interval_s": EMBEDDED_POLL_S, "retry_delay_s": EMBEDDED_RETRY_DELAY_S}]))
    return airflow_env(home, listing, **{EMBEDDED_DRIVER_PID_ENV: str(driver_pid), LEASE_OWNER_ENV: lease_owner})


def embedded_command(url: str, dag_id: str, driver_pid: int) -> list[str]:
    return [sys.executable, "-m", "milepost.dags.embedded", "--campaign", url, "--dag-id", dag_id,
            "--driver-pid", str(driver_pid)]
