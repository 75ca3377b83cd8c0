"""`milepost run`'s blocks: the campaign's Airflow DAG run in a child process (the embedded
runner, dags/embedded.py), under the campaign's lease, followed from the store: where each
block's task log is, each stage as it finishes, each block's held-out accuracy, and (on a
terminal) a progress line of the running stage with its rate and ETA (tasks/progress.py).

The child and its local stage jobs die with this process (their `--driver-pid`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time

from milepost.core.config import Recipe
from milepost.core.records import BLOCK_STAGES, Stage, campaign_id, dag_id_for
from milepost.core.store import CampaignStore
from milepost.dags.airflow_home import EXIT_DONE, block_log, embedded_command, embedded_env
from milepost.tasks.block_driver import eval_line
from milepost.tasks.campaign import PreparedCampaign

log = logging.getLogger(__name__)


def run_campaign(prepared: PreparedCampaign, show_progress: bool = True, resume: bool = False) -> int:
    """Run the campaign's remaining blocks; an exit status of dags/airflow_home.py: 0 done,
    3 paused or stopped, 1 a block failed, 2 a block failed on the user's input.

    Raises LeaseHeldError (another run writes the campaign) or CampaignPaused (paused or
    stopped and not `resume`) before any block starts."""
    from milepost.tasks.lease import LeaseKeeper, local_owner
    from milepost.tasks.progression import check_can_start, next_block

    recipe, store = prepared.recipe, prepared.store
    owner = local_owner()
    with LeaseKeeper(store, owner):
        block = next_block(store, recipe)
        if block is None:
            log.info("campaign %s is complete (%d blocks)", store.url, recipe.campaign.num_blocks)
            return EXIT_DONE
        check_can_start(store, recipe, block, resume)
        dag_id = dag_id_for(recipe.campaign.name)
        child = subprocess.Popen(embedded_command(campaign_id(store.url), dag_id, os.getpid()),
                                 env=embedded_env(store, dag_id, os.getpid(), owner))
        try:
            _follow(store, recipe, child, show_progress)
        finally:
            if child.poll() is None:  # interrupted: the child's stage jobs die with this process
                child.terminate()
            child.wait()
        return child.returncode


def _follow(store: CampaignStore, recipe: Recipe, child: subprocess.Popen, show_progress: bool) -> None:
    from milepost.tasks.progress import ProgressLine, current_line
    from milepost.tasks.progression import next_block

    shown: set[tuple[int, Stage]] = set()
    current = None
    line = ProgressLine() if show_progress else None
    while True:
        running = child.poll() is None
        for b in () if current is None else (current,):
            for stage in BLOCK_STAGES:
                record = store.stage_record(b, stage)
                if record and record.done and (b, stage) not in shown:
                    shown.add((b, stage))
                    if line:
                        line.clear()
                    log.info("block %d: %s done (%.1fs)", b, stage, record.duration_s or 0.0)
                    if stage is Stage.EVALUATE:
                        log.info("%s", eval_line(store, recipe, b))
        block = next_block(store, recipe) if running else None
        if block is not None and block != current:
            current = block
            if line:
                line.clear()
            log.info("block %d (last: %d) runs as one run of the campaign's Airflow DAG, in this process; "
                     "its task log: %s", block, recipe.campaign.num_blocks - 1, block_log(store, block))
        if line and current is not None:
            line.show(current_line(store, current, recipe.campaign.steps_per_block))
        if not running:
            break
        time.sleep(1.0)
    if line:
        line.clear()
