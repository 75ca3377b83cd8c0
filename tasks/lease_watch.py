"""The dead driver's switch of a block's Ray cluster.

    python -m milepost.tasks.lease_watch --campaign URL --grace-s 1800 [--interval-s 30] [--armed]
        [--head-pid PID --head-created T --temp-dir DIR]

Exits 0 once no live process has held the campaign's lease (tasks/lease.py) for `--grace-s`
seconds on end. Two users:
- a Ray allocation on Slurm (slurm/sbatch.py starts it once every node joined), which then
  stops itself;
- a local head (tasks/local_ray.start_lease_watch, with --head-pid ...): the watch stops the
  head's processes itself (its engines and router with them), and exits quietly as soon as
  the head is gone some other way (teardown, which also stops the watch: its command line
  holds the head's temp dir).

Why: the cluster is stopped by the block's teardown, which a SIGKILLed `milepost run` (or an
Airflow deployment deleted mid-block) never runs. Without this, Slurm nodes stayed held until
the job's time limit and a local head's engines kept their GPU memory, until someone resumed
the campaign. Whoever runs a block holds
the lease and renews it (a `milepost run` every ttl/3; an Airflow run from its tasks and its
stage triggers' polls), so a lease that stays dead means nobody will use this cluster. A
run that resumes the campaign later starts a new allocation anyway (the block is relaunched
as after a lost node).

Rules:
- dead = `live_lease` is None: no lease, an expired one, or one of a local process that is
  gone (the liveness rule of `milepost status`);
- armed at the first live lease seen, or from the start with `--armed`: the launcher passes
  it when a live run held the lease as it launched the cluster, so a Slurm allocation that
  only starts after its driver died (it waited in the queue) still stops after the grace.
  A cluster launched without a live lease (a stage run by hand, `bench/gpu_arith.py`) and
  never seeing one is nobody's to stop.
- the clock restarts whenever a live lease is seen, so a stall shorter than the grace (a
  scheduler restart, a slow store) never stops a cluster in use;
- a store that cannot be read counts as alive (logged): a storage hiccup must not stop a
  campaign's cluster; only a lease read as dead does.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil

from milepost.core.store import CampaignStore

DEFAULT_GRACE_S = 1800.0
DEFAULT_INTERVAL_S = 30.0


def wait_until_orphaned(read_live: Callable[[], dict[str, Any] | None], grace_s: float, interval_s: float,
                        log: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                        sleep: Callable[[float], None] = time.sleep,
                        still_needed: Callable[[], bool] = lambda: True, armed: bool = False) -> float | None:
    """Poll `read_live` (the live lease, or None) every `interval_s` until it has been None for
    `grace_s` on end, after it was live at least once (or from the start: `armed`); returns
    how long it was dead, or None as soon as `still_needed()` is False (what it guards is
    gone). A raising `read_live` counts as alive."""
    dead_since: float | None = None
    while True:
        if not still_needed():
            return None
        try:
            alive = read_live() is not None
        except Exception as e:  # noqa: BLE001 (any failure to read, s3 or local, must not stop a cluster)
            log(f"lease_watch: the campaign's lease could not be read ({type(e).__name__}: {e}); counted as alive")
            alive = True
        now = clock()
        if alive:
            armed, dead_since = True, None
        elif not armed:
            pass  # started without a live lease: nobody's cluster to stop
        elif dead_since is None:
            dead_since = now
            log(f"lease_watch: no live run holds the campaign's lease; this cluster stops in {grace_s:.0f} s "
                "unless one comes back")
        elif now - dead_since >= grace_s:
            return now - dead_since
        sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--campaign", required=True, help="the campaign's store URL")
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S)
    parser.add_argument("--interval-s", type=float, default=DEFAULT_INTERVAL_S)
    parser.add_argument("--armed", action="store_true",
                        help="a live run held the lease when it launched this cluster: count from the start")
    parser.add_argument("--head-pid", type=int, help="a local head to stop when orphaned (with --head-created)")
    parser.add_argument("--head-created", type=float, help="the head process's create time (pid reuse guard)")
    parser.add_argument("--temp-dir", help="the local head's temp dir (finds its processes)")
    args = parser.parse_args(argv)
    if (args.head_pid is None) != (args.head_created is None):
        parser.error("--head-pid and --head-created go together")
    from milepost.tasks.local_ray import owned_process, stop_processes
    from milepost.tasks.status import live_lease

    store = CampaignStore(args.campaign)
    head = None if args.head_pid is None else [(args.head_pid, args.head_created)]

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def head_alive() -> bool:
        if head is None:
            return True
        proc = owned_process(*head[0])
        try:
            return proc is not None and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    dead_for = wait_until_orphaned(lambda: live_lease(store), args.grace_s, min(args.interval_s, args.grace_s), log,
                                   still_needed=head_alive, armed=args.armed)
    if dead_for is None:
        log("lease_watch: the local Ray head is gone (torn down): nothing to guard")
        return 0
    what = "this allocation" if head is None else "the local Ray head and its engines"
    log(f"lease_watch: no run has held the lease of {args.campaign} for {dead_for:.0f} s (its driver is gone "
        f"and nothing resumed it): stopping {what}. Resuming the campaign starts a new one.")
    if head is not None:
        stopped = stop_processes(head, args.temp_dir, [], since=0.0)
        log(f"lease_watch: stopped {len(stopped)} process(es) of the local head")
    return 0


if __name__ == "__main__":
    sys.exit(main())
