"""Names shared by the DAG files and the processes that run them, in a module with no Airflow
import (the `milepost run` process imports it before any AIRFLOW_HOME is chosen)."""

from __future__ import annotations

import re

# = milepost.tasks.stage.DRIVER_PID_ENV (not imported: that module pulls in the engine; a test
# keeps the two equal).
DRIVER_PID_ENV = "MILEPOST_DRIVER_PID"
# Set by `milepost run` for the DAG it runs in-process (embedded mode): local stage jobs die
# with that process (as under BlockRunner), and the run writes under that process's lease.
EMBEDDED_DRIVER_PID_ENV = "MILEPOST_EMBEDDED_DRIVER_PID"
LEASE_OWNER_ENV = "MILEPOST_LEASE_OWNER"


def dag_id_for(name: str) -> str:
    return "milepost_" + re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_")
