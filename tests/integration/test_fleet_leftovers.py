"""A start_engines stage killed while its engines launch leaves detached engine actors that no record
names yet and that hold their placement bundles. The next attempt finds them in the block's
Ray namespace (`stop_fleet_actors`) and stops them, so its own engines can be scheduled."""

from __future__ import annotations

import subprocess
import sys
import time

import ray

from milepost.core.fleet.actor import EngineActor
from milepost.core.fleet.fleet import stop_fleet_actors
from milepost.core.placement import Placement, actor_strategy, ensure_group

NAMESPACE = "milepost-test-leftovers-b000000"

# A killed stage, as a separate driver: it creates a detached engine actor on bundle 0 and is
# SIGKILLed before it records anything.
KILLED_ATTEMPT = f"""
import os, ray, signal, tempfile
from milepost.core.fleet.actor import EngineActor
from milepost.core.placement import Placement, actor_strategy, ensure_group
ray.init(address=os.environ["RAY_ADDRESS"], namespace={NAMESPACE!r})
group = ensure_group(Placement("disaggregated", 0, 1, 1.0))
actor = EngineActor.options(name="engine-0.0-deadbeef", lifetime="detached",
                            **actor_strategy(group, 0)).remote(tempfile.mktemp())
ray.get(actor.pid.remote())
print("launched", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_next_attempt_stops_an_unrecorded_engine_and_gets_its_bundle():
    ray.init(num_cpus=1, include_dashboard=False, namespace=NAMESPACE)
    try:
        address = ray.get_runtime_context().gcs_address
        env = {**__import__("os").environ, "RAY_ADDRESS": address}
        killed = subprocess.run([sys.executable, "-c", KILLED_ATTEMPT], env=env, capture_output=True, text=True,
                                timeout=180)
        assert "launched" in killed.stdout, killed.stderr[-2000:]
        assert "engine-0.0-deadbeef" in ray.util.list_named_actors()
        group = ensure_group(Placement("disaggregated", 0, 1, 1.0))
        # The bundle (0.5 CPU) is held: a new engine on it cannot start.
        blocked = EngineActor.options(**actor_strategy(group, 0)).remote("/dev/null")
        ready, _ = ray.wait([blocked.pid.remote()], timeout=5)
        assert not ready
        ray.kill(blocked, no_restart=True)

        stopped = stop_fleet_actors()
        assert stopped == ["engine-0.0-deadbeef"]
        assert "engine-0.0-deadbeef" not in ray.util.list_named_actors()
        started = time.monotonic()
        engine = EngineActor.options(**actor_strategy(group, 0)).remote("/dev/null")
        assert ray.get(engine.pid.remote(), timeout=60) > 0
        assert time.monotonic() - started < 60
        assert stop_fleet_actors() == []  # an unnamed actor of this attempt is not touched
        ray.get(engine.pid.remote(), timeout=10)
    finally:
        ray.shutdown()
