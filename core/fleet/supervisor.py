"""Keeps a fleet's engines alive inside a stage: health checks, restarts, re-registration.

Life of one engine position i (a `Slot` per incarnation):

    starting ──first /health_generate 200, admission probe──► serving ──process gone, or N failed checks──► dead
       │  (only rollout.engine_startup_timeout_s applies: a warming engine is never killed)  │
       └──────────── start-up timeout, process gone ──────────────────────────────────────► dead
    dead ──► DELETE it from the router, stop its actor (engine process group first), launch a
             new actor (new pid, new port) ──► starting ──► on its first healthy answer: read
             its version and routes once (admission.py: a build lacking a route milepost
             drives fails the fleet at once, naming what is missing), load the weights the fleet
             serves now (`fleet.served`), make it the fleet's engine i (`Fleet.replace_engine`),
             POST it to the router and wait until GET /workers lists it healthy ──► serving

Restarts are counted for the whole fleet; one death past `rollout.max_engine_restarts`
sets `error` (naming the engine and quoting its log), which the fleet raises at the next
call: the stage fails clearly instead of limping on with fewer engines.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from milepost.core.config import RolloutConfig
from milepost.core.engine_wire import LOAD_FAILED_EXIT, LOAD_FAILED_LINE
from milepost.core.fleet.actor import EngineActor
from milepost.core.fleet.admission import EngineRefused, probe_engine
from milepost.core.fleet.client import EngineClient
from milepost.core.weight_sync.lora_push import load_served

if TYPE_CHECKING:
    from milepost.core.fleet.fleet import Fleet

log = logging.getLogger(__name__)


class FleetError(RuntimeError):
    pass


def stop_actors(actors: list[Any], timeout_s: float = 15.0) -> None:
    """Stop engine actors: each stops its engine's process group (SIGTERM, then SIGKILL),
    then the actor is killed. An actor that does not answer in time is killed anyway (its
    engine then dies by PR_SET_PDEATHSIG)."""
    refs = []
    for actor in actors:
        try:
            refs.append(actor.stop.remote())
        except Exception:  # noqa: BLE001 - an actor already gone
            pass
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for actor in actors:
        ray.kill(actor, no_restart=True)


def log_tail(path: str, num_lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 16384))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "(no engine log)"
    return "\n".join(lines[-num_lines:]) or "(engine log is empty)"


@dataclass
class Slot:
    """One engine incarnation at position `index`. Written only by that position's watch
    thread, except `state` → "dead", which `FleetSupervisor.probe` may set (under the lock)."""

    index: int
    generation: int
    actor: Any
    url: str
    pid: int
    log_path: str
    model_path: str
    weight_version: str
    client: EngineClient
    launched_at: float = field(default_factory=time.monotonic)
    state: str = "starting"  # starting | serving | dead
    failures: int = 0
    startup_failures: int = 0  # checks that failed while warming up (never fatal by themselves)
    reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    name: str = ""  # the actor's Ray name when the fleet is detached, else ""
    version: str = ""  # the engine build, read at admission (core/fleet/admission.py)
    device: str = ""  # where it serves ("cuda", "cpu"), read at admission


class FleetSupervisor:
    """One watch thread per engine position; each checks its engine every
    `health_check_interval_s` and is the only thread that launches, admits or replaces it.

    Concurrency rules:
    - Slot states and the restart count change under `self._lock`.
    - Admission (reload weights + install the client) holds `fleet.lock`, the lock every
      weight push holds (`FleetTransport`). So a new engine is installed either before a push
      (and receives it) or after its record (and loads what it recorded): never in between.
    - Lock order: `fleet.lock` before `self._lock`, never the reverse.
    - While `fleet.pushing` or `fleet.sleeping` is set, failed health checks are not counted:
      a paused engine holds /health_generate back until `continue`, a sleeping one answers
      503 until the next push. A process that is gone still counts.
    - `error` is set once; then every watch thread exits and nothing is restarted again.
    """

    def __init__(self, fleet: Fleet, cfg: RolloutConfig, load_delay_s: float = 0.0) -> None:
        self.fleet, self.cfg, self.load_delay_s = fleet, cfg, load_delay_s
        self.slots: list[Slot] = []
        self.events: list[dict[str, Any]] = []  # one per restart, with its timings
        self.num_restarts = 0
        self.error: FleetError | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- public -------------------------------------------------------------------------
    def launch_all(self, num_engines: int) -> None:
        """Launch every engine (in parallel) and start the watch threads."""
        pending = [self._launch_remote(i, 0) for i in range(num_engines)]
        try:
            self.slots = [self._finish_launch(*p) for p in pending]
        except BaseException:
            for p in pending:
                ray.kill(p[2], no_restart=True)
            raise
        self._start_watching(num_engines)

    def adopt(self, slots: list[Slot]) -> None:
        """Supervise engines another process launched (a re-attached fleet): start the watch
        threads on these slots. A slot given as "dead" is replaced at the first check."""
        self.slots = slots
        self._start_watching(len(slots))

    def _start_watching(self, num_engines: int) -> None:
        for i in range(num_engines):
            t = threading.Thread(target=self._watch, args=(i,), daemon=True, name=f"fleet-watch-{i}")
            t.start()
            self._threads.append(t)

    def wait_all_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.raise_if_failed()
            if all(s.state == "serving" for s in self.slots):
                return
            time.sleep(0.1)
        late = [s for s in self.slots if s.state != "serving"]
        raise FleetError(f"engines not serving after {timeout_s:.0f}s: " + "; ".join(
            f"engine {s.index} ({s.url}, {s.state}), log {s.log_path}:\n{log_tail(s.log_path)}" for s in late))

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def live_clients(self) -> list[EngineClient]:
        with self._lock:
            return [s.client for s in self.slots if s.state == "serving"]

    def probe(self) -> bool:
        """Check now whether a serving engine's process is gone (after a failed weight push);
        mark such engines dead so the next push skips them. True if one was found."""
        found = False
        for slot in list(self.slots):
            reason = self._gone(slot) if slot.state == "serving" else None
            if reason:
                found |= self._set_state(slot, "dead", expect="serving", reason=reason)
        return found

    def stop(self) -> None:
        self._stopping.set()
        for t in self._threads:
            t.join(timeout=2.0)  # a thread inside a health check exits after it; daemon anyway

    # --- one watch thread per position -------------------------------------------------------
    def _watch(self, index: int) -> None:
        while not self._stopping.wait(self._interval(self.slots[index])):
            if self.error is not None:
                return
            try:
                self._tick(index)
            except Exception:  # a bug here must not silently end supervision
                if self._stopping.is_set():
                    return  # stop() closed the clients under a check in flight
                log.exception("fleet supervisor: checking engine %d failed", index)

    def _tick(self, index: int) -> None:
        slot = self.slots[index]
        reason = self._check(slot)
        while reason and not self._stopping.is_set() and self.error is None:
            reason = self._replace(slot, reason)
            slot = self.slots[index]

    def _interval(self, slot: Slot) -> float:
        # A warming engine is polled often, so a restarted engine is admitted quickly.
        return min(self.cfg.health_check_interval_s, 0.5) if slot.state == "starting" \
            else self.cfg.health_check_interval_s

    def _check(self, slot: Slot) -> str | None:
        """None while the engine is fine (or still warming up), else why it is dead."""
        if slot.state == "dead":
            return slot.reason
        if slot.client.health_generate(timeout_s=self.cfg.health_check_timeout_s):
            slot.failures = 0
            if slot.state == "starting":
                return self._admit(slot)
            return None
        gone = self._gone(slot)
        if gone:
            return gone
        if self.fleet.pushing.is_set() or self.fleet.sleeping.is_set():
            return None  # paused: holds health requests back; asleep: answers 503. Not failures
        if slot.state == "starting":  # grace period: only the start-up timeout counts
            slot.startup_failures += 1
            waited = time.monotonic() - slot.launched_at
            limit = self.cfg.engine_startup_timeout_s
            return f"not healthy {waited:.0f}s after launch (rollout.engine_startup_timeout_s={limit:g})" \
                if waited > limit else None
        slot.failures += 1
        if slot.failures >= self.cfg.health_failure_threshold:
            return f"{slot.failures} consecutive failed /health_generate checks"
        return None

    def _gone(self, slot: Slot) -> str | None:
        """Why the engine's process (or its owning actor) is gone, or None if it runs."""
        try:
            status = ray.get(slot.actor.status.remote(), timeout=10)
        except ray.exceptions.GetTimeoutError:
            return None  # a slow actor is not a dead one: the health checks decide
        except Exception as e:  # noqa: BLE001 - any Ray error here means the actor is gone
            return f"process {slot.pid} gone ({type(e).__name__})"
        if status["alive"]:
            return None
        last = log_tail(slot.log_path, 1)
        if status.get("exit_code") == LOAD_FAILED_EXIT and LOAD_FAILED_LINE in last:
            return last  # the built-in engine's own line: "model load failed: …"
        return f"engine process {slot.pid} exited with status {status.get('exit_code')}; last log line: {last}"

    def _admit(self, slot: Slot) -> str | None:
        """First healthy answer: current weights, client installed, router registration."""
        slot.timings["healthy"] = time.monotonic()
        try:
            caps = probe_engine(slot.url, self.cfg.engine, self.fleet.admin_key)
            slot.version, slot.device = caps.version, caps.device
        except EngineRefused as e:  # a build without what milepost drives: restarting it cannot help
            with self._lock:
                slot.state, slot.reason = "dead", str(e)
                if self.error is None:
                    self.error = FleetError(f"engine {slot.index} refused at admission: {e}")
            return None
        except Exception as e:  # noqa: BLE001 - an engine that cannot answer the probe is not ready
            return f"admission probe failed: {type(e).__name__}: {e}"
        try:
            with self.fleet.lock:
                path, version = self.fleet.loadable_served(self.cfg.engine_startup_timeout_s)
                if (path, version) != (slot.model_path, slot.weight_version):
                    reply = load_served(slot.client, path, version)  # full weights, or a LoRA adapter
                    if not reply.get("success", False):
                        return f"could not load the served weights {path}: {reply.get('message')}"
                    slot.model_path, slot.weight_version = path, version
                self.fleet.replace_engine(slot.index, slot.client, slot.url, slot.actor)
                # Serving from here on, inside the lock: the next push includes this engine.
                self._set_state(slot, "serving", expect="starting")
                router = self.fleet.router
            if router is not None:  # else Fleet.start registers it with the router it starts
                router.add_worker(slot.url, timeout_s=60.0)
        except Exception as e:  # noqa: BLE001 - a failed admission is a failed start
            return f"admission failed: {type(e).__name__}: {e}"
        slot.timings["routable"] = time.monotonic()
        if slot.generation > 0:
            self._record_restart(slot)
        return None

    def _replace(self, slot: Slot, reason: str) -> str | None:
        """Retire a dead engine and launch its successor; a reason if that launch failed."""
        with self._lock:
            slot.state, slot.reason = "dead", reason
            if self.error is None and self.num_restarts >= self.cfg.max_engine_restarts:
                self.error = FleetError(
                    f"engine {slot.index} ({slot.url}, pid {slot.pid}) died: {reason}. The fleet's restart "
                    f"budget is used up (rollout.max_engine_restarts={self.cfg.max_engine_restarts}, "
                    f"{self.num_restarts} used), so the stage fails: raise the budget or fix the cause. "
                    f"Last lines of {slot.log_path}:\n{log_tail(slot.log_path)}")
            failed = self.error is not None
            if not failed:
                self.num_restarts += 1
        if failed:
            self._retire(slot)
            return None
        log.warning("engine %d (%s, pid %d) died: %s; restarting (%d/%d)", slot.index, slot.url, slot.pid,
                    reason, self.num_restarts, self.cfg.max_engine_restarts)
        died_at = time.monotonic()
        self._retire(slot)
        try:
            new = self._finish_launch(*self._launch_remote(slot.index, slot.generation + 1))
        except Exception as e:  # noqa: BLE001 - counts as another death of this position
            return f"restart failed: {type(e).__name__}: {e}"
        new.timings.update(died=died_at, previous_pid=slot.pid, launched=time.monotonic())
        new.reason = reason
        self.slots[slot.index] = new
        if self._stopping.is_set():  # stop() ran meanwhile and did not see this actor
            ray.kill(new.actor, no_restart=True)
        return None

    def _retire(self, slot: Slot) -> None:
        router = self.fleet.router
        if router is not None:
            try:
                router.remove_worker(slot.url)  # the router never drops a dead worker itself
            except Exception as e:  # noqa: BLE001 - a router problem shows in the next requests
                log.warning("could not remove %s from the router: %s", slot.url, e)
        if slot.actor is not None:  # None: an adopted engine whose actor was already gone
            stop_actors([slot.actor])

    def _launch_remote(self, index: int, generation: int) -> tuple[int, int, Any, str, Any, str]:
        log_path = f"{self.fleet.log_dir}/engine-{index}.{generation}.log"
        options = {**self.fleet.actor_options(f"engine-{index}.{generation}"), **self.fleet.engine_placement(index)}
        # ray.remote's class decorator is typed as returning the class itself
        actor = EngineActor.options(**options).remote(log_path)  # type: ignore[attr-defined]
        command = self.fleet.engine_command(self.load_delay_s)
        ref = actor.launch.remote(command, self.fleet.admin_key_path)
        return index, generation, actor, log_path, ref, options.get("name", "")

    def _finish_launch(self, index: int, generation: int, actor: Any, log_path: str, ref: Any,
                       name: str = "") -> Slot:
        try:
            url, pid = ray.get(ref, timeout=self.cfg.engine_startup_timeout_s + 60)  # + actor start-up
        except Exception as e:
            ray.kill(actor, no_restart=True)
            raise FleetError(f"engine {index} did not launch: {e}\nLast lines of {log_path}:\n"
                             f"{log_tail(log_path)}") from e
        return Slot(index, generation, actor, url, pid, log_path, self.fleet.base_model_path,
                    self.fleet.base_weight_version, self.fleet.engine_client(url), name=name)

    def _set_state(self, slot: Slot, state: str, expect: str, reason: str = "") -> bool:
        with self._lock:
            if slot.state != expect:
                return False
            slot.state, slot.reason = state, reason or slot.reason
            return True

    def _record_restart(self, slot: Slot) -> None:
        t = slot.timings
        event = {"engine": slot.index, "reason": slot.reason, "previous_pid": int(t["previous_pid"]),
                 "pid": slot.pid, "url": slot.url, "weight_version": slot.weight_version, "died_at": t["died"],
                 "died_to_launched_s": t["launched"] - t["died"], "died_to_healthy_s": t["healthy"] - t["died"],
                 "healthy_to_routable_s": t["routable"] - t["healthy"]}
        self.events.append(event)
        log.warning("engine %d restarted: %s", slot.index, event)
