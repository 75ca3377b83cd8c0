"""Python side of the dev cluster: is it up? (for tests and tools; never starts anything)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).with_name("devcluster.sh")
NOT_RUNNING = "dev cluster not running: run `bash slurm/devcluster.sh up`"


def devcluster_dir() -> Path:
    return Path(os.environ.get("MILEPOST_DEVCLUSTER_DIR", "/var/lib/milepost-devcluster"))


def check_dev_cluster(min_nodes: int = 1) -> str | None:
    """None if the dev cluster is up with at least `min_nodes` nodes, else why not.

    Points this process's Slurm clients at the dev cluster's config when SLURM_CONF is
    unset (the config is also linked from /etc/slurm/slurm.conf when that path was free).
    """
    conf = devcluster_dir() / "etc" / "slurm.conf"
    if conf.exists():
        os.environ.setdefault("SLURM_CONF", str(conf))
    status = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True)
    if status.returncode != 0:
        return f"{NOT_RUNNING}\n{status.stdout}{status.stderr}"
    nodes = set(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True,
                               text=True).stdout.split())
    if len(nodes) < min_nodes:
        return (f"dev cluster has nodes {sorted(nodes)}; {min_nodes} needed: run `bash "
                f"slurm/devcluster.sh down && bash slurm/devcluster.sh up --nodes {min_nodes}`")
    return None
