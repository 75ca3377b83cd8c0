"""A fleet of engines (built-in or SGLang, core/fleet/launcher.py) owned by Ray actors, the
real sglang-router in front, and a supervisor that keeps the engines alive for the whole stage.

The caller owns Ray (ray.init() before Fleet.start). Generation goes through the router;
control calls (pause, weight updates) go to each engine through `Fleet.clients`, because
the router does not forward them (../shared/FACTS.md).

A fleet that must outlive the process that started it (one block stage starts it, later
stages use it) is started `detached=True`: engines and the router's owner are detached,
named Ray actors in the caller's namespace, `describe()` is the JSON document that finds
them again, and `Fleet.attach(doc, cfg)` in another process re-attaches a supervisor to
them. `on_change(doc)` is called whenever that document changes (an engine restarted, new
weights served), so the caller can keep its record current. Such a fleet dies with its Ray
cluster, or by `stop()`; `detach()` leaves it running.

Admin key: `admin_key_path` names a file holding the engines' admin key (the campaign's
secret, core/secrets.py). Each engine actor reads it and hands it to its engine in an
owner-only `--config` YAML (never on argv; core/fleet/launcher.py), the fleet's engine
clients send it, the router's client does not; `describe()` (the record) holds neither key
nor path.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import ray

from milepost.core.config import LoraConfig, RolloutConfig
from milepost.core.engine_wire import read_key_file
from milepost.core.fleet.actor import EngineActor, RouterActor
from milepost.core.fleet.client import EngineClient
from milepost.core.fleet.launcher import EngineCommand, LaunchError, engine_command, engine_gpus
from milepost.core.fleet.retrying import RetryingClient
from milepost.core.fleet.router import Router
from milepost.core.fleet.supervisor import FleetError, FleetSupervisor, Slot, stop_actors
from milepost.core.placement import Placement, actor_strategy, ensure_group, find_group
from milepost.core.quant.fp8_folder import fp8_folder, sglang_fp8_problem
from milepost.core.quant.modes import disk_form
from milepost.core.train.lora import is_adapter_folder
from milepost.core.weight_export import WeightExports
from milepost.core.weight_sync.base import WeightSource
from milepost.core.weight_sync.lora_push import ADAPTER_NAME, AdapterRequests, load_served

if TYPE_CHECKING:  # the fleet does not depend on which transports exist
    from milepost.core.weight_sync.base import WeightTransport

__all__ = ["EngineActor", "Fleet", "FleetError", "FleetTransport"]


class Fleet:
    """Engines + router + supervisor. One owner starts and stops it.

    How to use it (stage code):

        fleet = Fleet.start(path, cfg.num_engines, cfg, version)   # every engine healthy
        rollout_fn(request, fleet.router_client)   # RetryingClient: survives an engine's death
        transport = FleetTransport(fleet, build_transport(...))  # pass this to the loop
        ...
        fleet.raise_if_failed()   # at stage end: a used-up restart budget fails the stage
        fleet.stop()

    - `fleet.router_client` retries a /generate lost with a dead engine (same body, same
      sampling_seed: same tokens) and raises `FleetError` once the restart budget is spent.
    - `fleet.clients` / `engine_urls` / `actors` are the engines now: a restart replaces
      the lists (`replace_engine`), so read them from the fleet each time, never keep one.
    - A restarted engine loads `fleet.served`, the weights of the last successful push.
      `FleetTransport` records it; code pushing weights another way does so inside
      `with fleet.weight_push() as clients:` and calls `fleet.record_served(path, version)`
      there on success. The loop may still be writing that folder (`track_exports`): a
      restarted engine waits for it (`loadable_served`).
    - `fleet.restart_events()` lists the restarts (engine, pids, reason, timings) for the
      stage record.

    Concurrency: `lock` (re-entrant) guards `served`, the client lists and every weight push;
    the supervisor takes it to install a restarted engine (see FleetSupervisor). `pushing` is
    set while a push runs, so paused engines' slow health checks are not held against them.
    """

    def __init__(self, model_path: str, weight_version: str, cfg: RolloutConfig, host: str | None,
                 log_dir: str | None = None, detached: bool = False,
                 on_change: Callable[[dict[str, Any]], None] | None = None,
                 admin_key_path: str | None = None) -> None:
        self.base_model_path, self.base_weight_version = model_path, weight_version
        self.admin_key_path = admin_key_path  # engines read the key from this file
        self.admin_key = read_key_file(admin_key_path) if admin_key_path else None
        self.cfg, self.host, self.detached, self.on_change = cfg, host, detached, on_change
        self.router_actor: Any = None  # the RouterActor of a detached fleet
        self.router_name: str | None = None
        self.router_pid: int | None = None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="milepost-fleet-")
        self.lock = threading.RLock()
        self.served: tuple[str, str] = (model_path, weight_version)
        self.exports: WeightExports | None = None  # the loop's (track_exports): `served` may be pending there
        self._recorded_served = self.served  # what describe() records: a folder that is whole on disk
        self.pushing = threading.Event()
        self.sleeping = threading.Event()  # colocated: engines gave their memory back (FleetTransport.asleep)
        self.actors: list[Any] = []
        self.engine_urls: list[str] = []
        self.clients: list[EngineClient] = []
        self.router: Router | None = None
        self.router_url: str | None = None
        self.router_client: Any = None
        self.supervisor = FleetSupervisor(self, cfg)
        self.placement_group: Any = None  # core/placement.py: engine i runs on engine_bundles[i]
        self.engine_bundles: list[int] | None = None
        self.engine_gpu_requests: list[float] | None = None  # what each engine asks of its bundle
        self.colocated = False  # engines share the trainer's devices: SGLang gets --enable-memory-saver
        self.lora: LoraConfig | None = None  # train.lora: engines take adapters; `served` may be one
        self.precision = "fp32"  # precision.rollout: the engines' --dtype / --quantization (core/quant/modes.py)
        self.int4_dtype = "float32"  # int4's --dtype: the int4_qat trainer's (modes.int4_dtype)
        self.served_dir = f"{self.log_dir}/served"  # the forms of HF folders its engines load (disk_form)

    @classmethod
    def start(cls, model_path: str, num_engines: int, cfg: RolloutConfig, weight_version: str = "0",
              host: str | None = "127.0.0.1", *, load_delay_s: float = 0.0, log_dir: str | None = None,
              detached: bool = False, on_change: Callable[[dict[str, Any]], None] | None = None,
              placement: Placement | None = None, admin_key_path: str | None = None,
              lora: LoraConfig | None = None, precision: str = "fp32", served_dir: str | None = None,
              int4_dtype: str = "float32") -> Fleet:
        """Launch the engines, wait until each is healthy, start the router in front.
        `host` None: each engine and the router bind their node's IP (multi-node clusters).
        `load_delay_s` (tests only) makes every engine's cold start that much slower.
        `admin_key_path`: a file with the engines' admin key (module docstring). `served_dir`:
        where the folders its engines load in a form of their own are written (`disk_form`).
        `int4_dtype`: with precision int4, the engines' --dtype (modes.int4_dtype)."""
        fleet = cls(model_path, weight_version, cfg, host, log_dir, detached, on_change, admin_key_path)
        fleet.supervisor.load_delay_s = load_delay_s
        fleet.lora = lora  # engines launch from the base weights with LoRA on (lora_push.py)
        fleet.precision, fleet.int4_dtype = precision, int4_dtype
        fleet.served_dir = served_dir or fleet.served_dir
        fleet.check_disk_form()
        if placement is not None:
            fleet.colocated = placement.mode == "colocated"
            fleet.placement_group = ensure_group(placement)
            fleet.engine_bundles = [placement.engine_bundle(i) for i in range(num_engines)]
            fleet.engine_gpu_requests = [placement.engine_gpu_request(i) for i in range(num_engines)]
        fleet.engine_command(load_delay_s)  # refuses what the chosen engine cannot honour, before any launch
        fleet.clients = [None] * num_engines  # type: ignore[list-item]  # filled by admission
        fleet.engine_urls, fleet.actors = [""] * num_engines, [None] * num_engines
        try:
            fleet.supervisor.launch_all(num_engines)
            fleet.supervisor.wait_all_serving(cfg.engine_startup_timeout_s + 60)
            with fleet.lock:  # an engine admitted from now on registers with this router itself
                fleet.router = fleet._start_router()
            fleet._connect_router()
        except BaseException:
            fleet.stop()
            raise
        fleet._changed()
        return fleet

    @classmethod
    def attach(cls, doc: dict[str, Any], cfg: RolloutConfig,
               on_change: Callable[[dict[str, Any]], None] | None = None,
               admin_key_path: str | None = None) -> Fleet:
        """Re-attach to a detached fleet described by `doc` (from `describe()`), with a
        supervisor of its own. The caller is connected to the fleet's Ray cluster and
        namespace. An engine whose actor is gone is replaced at the supervisor's first check."""
        path, version = doc["served"]
        base = doc["base_model_path"] if doc.get("lora") else path  # an adapter is no model to launch from
        fleet = cls(base, str(version), cfg, doc.get("host"), doc["log_dir"], True, on_change, admin_key_path)
        fleet.served = fleet._recorded_served = (path, str(version))
        fleet.lora = LoraConfig(**doc["lora"]) if doc.get("lora") else None
        fleet.precision = doc.get("precision", "fp32")
        fleet.int4_dtype = doc.get("int4_dtype", "float32")
        fleet.served_dir = doc.get("served_dir") or fleet.served_dir
        if doc.get("engine_bundles") is not None:
            fleet.placement_group, fleet.engine_bundles = find_group(), list(doc["engine_bundles"])
            fleet.engine_gpu_requests = doc.get("engine_gpu_requests")
        fleet.colocated = bool(doc.get("colocated", False))
        slots = [fleet._adopted_slot(e, path, str(version)) for e in doc["engines"]]
        fleet.clients = [s.client for s in slots]
        fleet.engine_urls, fleet.actors = [s.url for s in slots], [s.actor for s in slots]
        router = doc["router"]
        fleet.router = Router.attach(router["url"], fleet.engine_urls, router["log_path"])
        fleet.router_name, fleet.router_pid = router["name"], router["pid"]
        fleet.router_actor = _named_actor(router["name"])
        fleet._connect_router()
        fleet.supervisor.adopt(slots)
        return fleet

    def _adopted_slot(self, engine: dict[str, Any], path: str, version: str) -> Slot:
        actor = _named_actor(engine["name"])
        slot = Slot(engine["index"], engine["generation"], actor, engine["url"], engine["pid"],
                    engine["log_path"], path, version, self.engine_client(engine["url"]),
                    state="serving" if actor is not None else "dead", name=engine["name"])
        slot.reason = "" if actor is not None else f"actor {engine['name']} not found"
        slot.version, slot.device = engine.get("version", ""), engine.get("device", "")
        return slot

    def engine_client(self, url: str) -> EngineClient:
        """A client of one engine of this fleet (it sends the admin key, if any)."""
        return EngineClient(url, self.cfg.request_timeout_s, admin_key=self.admin_key, disk_form=self.disk_form)

    def disk_form(self, path: str) -> str:
        """The folder this fleet's engines load for the HF folder `path` (modes.disk_form): with
        SGLang serving fp8, its block-wise fp8 copy, written once under `served_dir`
        (core/quant/fp8_folder.py); else `path` itself. An adapter folder is always itself.
        The base model's copy lives apart from the policies': pushes prune old copies, and a
        restarted engine launches from the base's."""
        if disk_form(self.cfg.engine, self.precision) != "fp8" or is_adapter_folder(path):
            return path
        return fp8_folder(path, f"{self.served_dir}/{'base' if path == self.base_model_path else 'policies'}")

    def check_disk_form(self) -> None:
        """Refuse (LaunchError) before any launch a model its engines cannot load in their form."""
        if disk_form(self.cfg.engine, self.precision) != "fp8":
            return
        config = Path(self.base_model_path, "config.json")
        if not config.is_file():
            raise LaunchError(f"SGLang serving precision.rollout fp8 starts from a local HF folder, and "
                              f"{self.base_model_path} has no config.json")
        problem = sglang_fp8_problem(json.loads(config.read_text()), self.cfg.engine_tensor_parallel)
        if problem:
            raise LaunchError(problem)

    def _start_router(self) -> Router:
        if not self.detached:
            return Router.start(list(self.engine_urls), policy=self.cfg.router_policy, host=self.host or "127.0.0.1")
        log_path = f"{self.log_dir}/router.log"
        options = self.actor_options("router")
        self.router_name = options["name"]
        # ray.remote's class decorator is typed as returning the class itself
        self.router_actor = RouterActor.options(**options).remote(log_path)  # type: ignore[attr-defined]
        info = ray.get(self.router_actor.start.remote(list(self.engine_urls), self.cfg.router_policy, self.host))
        self.router_pid = info["pid"]
        return Router.attach(info["url"], list(self.engine_urls), log_path)

    def _connect_router(self) -> None:
        assert self.router is not None
        self.router_url = self.router.url
        # Retry for as long as replacing a dead engine may take: a fleet whose every
        # engine died serves again only once a successor is routable.
        router: Any = EngineClient(self.router_url, self.cfg.request_timeout_s)
        if self.lora is not None:  # /generate names the adapter once one is served
            router = AdapterRequests(router, lambda: ADAPTER_NAME if is_adapter_folder(self.served[0]) else None)
        self.router_client = RetryingClient(router,
                                            window_s=self.cfg.engine_startup_timeout_s + 60,
                                            check=self.raise_if_failed)

    def replace_router_if_dead(self) -> bool:
        """The supervisor restarts dead engines, not a dead router: a stage that attaches to a
        fleet whose sglang-router process is gone (killed, crashed) starts a fresh one in
        front of the same engines (a new RouterActor; the fleet document records it) instead
        of retrying its requests against the dead one until the client's window runs out.
        Returns True when it replaced the router."""
        import httpx
        import ray

        try:
            if self.router_url and httpx.get(f"{self.router_url}/health", timeout=10.0).status_code == 200:
                return False
        except httpx.HTTPError:
            pass
        with self.lock:
            if self.router_actor is not None:
                ray.kill(self.router_actor, no_restart=True)  # its router subprocess dies with it
            self.router = self._start_router()
            self._connect_router()
        self._changed()
        return True

    def actor_options(self, name: str) -> dict[str, Any]:
        """Ray options of an actor of this fleet: detached and named when the fleet outlives
        its stage. Names get a random suffix: a stage killed mid-restart may leave a name taken."""
        if not self.detached:
            return {}
        import uuid
        return {"name": f"{name}-{uuid.uuid4().hex[:8]}", "lifetime": "detached"}

    def engine_command(self, load_delay_s: float = 0.0) -> EngineCommand:
        """The launch template of this fleet's engines (core/fleet/launcher.py): what every
        engine actor resolves on its node and runs. It starts from the base weights; an
        engine admitted later loads `served` (FleetSupervisor._admit)."""
        return engine_command(self.cfg, self.disk_form(self.base_model_path), self.base_weight_version,
                              colocated=self.colocated,
                              host=self.host, admin_key=self.admin_key_path is not None, load_delay_s=load_delay_s,
                              lora=self.lora, precision=self.precision, int4_dtype=self.int4_dtype)

    def engine_placement(self, index: int) -> dict[str, Any]:
        """Ray options putting engine `index` on its placement-group bundle (none without one),
        with the GPUs it takes there (SGLang TP=k: k; Ray then sets its CUDA_VISIBLE_DEVICES)."""
        gpus = self.engine_gpu_requests[index] if self.engine_gpu_requests else engine_gpus(self.cfg)
        options: dict[str, Any] = {"num_gpus": gpus} if gpus else {}
        if self.engine_bundles is None:
            return options
        return {**options, **actor_strategy(self.placement_group, self.engine_bundles[index])}

    def describe(self) -> dict[str, Any]:
        """What finds this (detached) fleet again: actor names, URLs, pids, served weights."""
        with self.lock:
            engines = [{"index": s.index, "generation": s.generation, "name": s.name, "url": s.url,
                        "pid": s.pid, "log_path": s.log_path, "version": s.version, "device": s.device}
                       for s in self.supervisor.slots]
            router = {"name": self.router_name,
                      "url": self.router_url, "pid": self.router_pid,
                      "log_path": self.router.log_path if self.router else None}
            return {"engines": engines, "router": router, "served": list(self._recorded_served),
                    "log_dir": self.log_dir, "host": self.host, "engine_bundles": self.engine_bundles,
                    "engine_gpu_requests": self.engine_gpu_requests,
                    "colocated": self.colocated, "base_model_path": self.base_model_path,
                    "lora": self.lora.model_dump() if self.lora else None, "precision": self.precision,
                    "int4_dtype": self.int4_dtype, "served_dir": self.served_dir}

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.describe())

    def replace_engine(self, index: int, client: EngineClient, url: str, actor: Any) -> None:
        """Engine `index` is now this one (the supervisor calls it holding `lock`, at
        admission). The three lists are replaced, never changed in place: a list read
        earlier stays as it was, consistent with itself."""
        with self.lock:
            old = self.clients[index]
            self.clients = _with_item(self.clients, index, client)
            self.engine_urls = _with_item(self.engine_urls, index, url)
            self.actors = _with_item(self.actors, index, actor)
            if old is not None and old is not client:
                old.close()
            self._changed()

    @contextlib.contextmanager
    def weight_push(self) -> Iterator[list[EngineClient]]:
        """Hold `lock` for a weight push; yields the engines serving now (one being restarted
        is left out: it loads `served` when admitted, after this push has recorded it)."""
        with self.lock:
            self.pushing.set()
            try:
                yield self.supervisor.live_clients()
            finally:
                self.pushing.clear()

    def record_served(self, path: str, version: str) -> None:
        """The fleet now serves `path` as `version`: what a restarted engine must load. If
        the loop is still writing `path` (`track_exports`), the store's record of the fleet
        keeps the previous folder until it is whole: a stage killed meanwhile must not leave
        a record pointing at a folder never finished."""
        with self.lock:
            self.served = (path, str(version))
            if self.exports is None or self.exports.durable(path):
                self._recorded_served = self.served
            self._changed()

    def track_exports(self, exports: WeightExports) -> None:
        """The loop's exports (core/weight_export.py): folders it records as served may still
        be written; loading one waits for it (`loadable_served`)."""
        self.exports = exports
        exports.on_written(self._export_written)

    def _export_written(self, path: str) -> None:
        with self.lock:
            if self.served[0] == path:
                self._recorded_served = self.served
                self._changed()

    def loadable_served(self, timeout_s: float) -> tuple[str, str]:
        """`served`, once its folder is whole on disk (call it holding `lock`: the loop's
        export does not take it). Raises ExportError if that export failed or took longer."""
        path, version = self.served
        if self.exports is not None:
            self.exports.wait_for(path, timeout_s)
        return path, version

    def raise_if_failed(self) -> None:
        self.supervisor.raise_if_failed()

    def restart_events(self) -> list[dict[str, Any]]:
        return list(self.supervisor.events)

    def pids(self) -> list[int]:
        return [s.pid for s in self.supervisor.slots]

    def health_check(self) -> dict[str, bool]:
        """GET /health of every engine and of the router, by URL."""
        status = {c.base_url: c.health() for c in self.clients if c is not None}
        if self.router_url:
            try:
                status[self.router_url] = httpx.get(f"{self.router_url}/health", timeout=5.0).status_code == 200
            except httpx.HTTPError:
                status[self.router_url] = False
        return status

    def detach(self) -> None:
        """Stop supervising and close this process's clients; the fleet keeps serving."""
        self.supervisor.stop()
        for c in self.clients:
            if c is not None:
                c.close()

    def stop(self) -> None:
        self.detach()
        if self.router is not None:
            self.router.stop()
        if ray.is_initialized():  # else the actors went with Ray
            if self.router_actor is not None:
                ray.kill(self.router_actor, no_restart=True)  # its router dies with its process
            stop_actors([s.actor for s in self.supervisor.slots if s.actor is not None])


T = TypeVar("T")


def _with_item(items: list[T], index: int, item: T) -> list[T]:
    """A copy of `items` with `item` at `index`."""
    return [item if i == index else x for i, x in enumerate(items)]


FLEET_ACTOR_PREFIXES = ("engine-", "router-")  # actor_options names: engine-<i>.<gen>-<hex>, router-<hex>


def stop_fleet_actors(wait_s: float = 30.0) -> list[str]:
    """Stop every fleet actor (engines, router) in the caller's Ray namespace; their names.

    A stage that starts a fleet calls this first: an earlier attempt of it, killed while its
    engines were launching, leaves detached actors that no record names yet (names are only
    recorded once every engine serves) and that still hold their placement bundles, so the
    new engines could never be scheduled. Ray's own list of named actors is the record that
    exists from the moment an actor is created. The namespace is the block's, so nothing of
    another block or campaign is touched."""
    names = [n for n in ray.util.list_named_actors() if n.startswith(FLEET_ACTOR_PREFIXES)]
    actors = [a for a in (_named_actor(n) for n in names) if a is not None]
    for actor in actors:
        ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + wait_s  # their bundles are free once they are gone
    while time.monotonic() < deadline and any(n in names for n in ray.util.list_named_actors()):
        time.sleep(0.2)
    return names


def _named_actor(name: str) -> Any:
    """The detached actor called `name` in this driver's namespace, or None if gone."""
    try:
        return ray.get_actor(name)
    except ValueError:
        return None


class FleetTransport:
    """A weight transport that knows the fleet: it pushes to the engines serving now (an
    engine being restarted is skipped: it loads the recorded weights when admitted), holds
    `fleet.lock` for the whole push, and records what the fleet serves on success.

    If a push fails because an engine died during it, the dead engine is marked and the push
    is retried once on the engines left; any other failure is raised as the inner one.

    A restarted engine reloads `export_dir` from disk, whatever the transport: the loop
    exports HF weights there for each push (before it, or behind it for a transport that
    does not read them: core/weight_export.py), or admission fails with "could not load the
    served weights".
    """

    def __init__(self, fleet: Fleet, inner: WeightTransport) -> None:
        self.fleet, self.inner, self.name = fleet, inner, inner.name
        self.reads_export = inner.reads_export
        # LoRA keeps the base weights on the engines (its pushes send only the adapter)
        self.release_tags = list(getattr(inner, "release_tags", ("weights", "kv_cache")))
        self.handover_s: dict[str, float] = {}  # the last sleep's release / resume times, reported by the push

    def push(self, clients: list[EngineClient], export_dir: str, version: str,
             backend: WeightSource | None = None) -> dict[str, float]:
        del clients  # the fleet's live engines now, not a list captured earlier
        extra = {} if backend is None else {"backend": backend}
        for attempt in (1, 2):
            self.fleet.raise_if_failed()
            with self.fleet.weight_push() as live:
                try:
                    metrics = self.inner.push(live, export_dir, version, **extra)
                except Exception:
                    if attempt == 2 or not self.fleet.supervisor.probe():
                        raise
                    continue
                self.fleet.record_served(export_dir, version)
                if self.fleet.sleeping.is_set():  # every engine holds real weights again
                    self.fleet.sleeping.clear()
                    metrics = {**metrics, "sync/engines_woken": float(len(live)),
                               **{f"timing/engines_{k}_s": v for k, v in self.handover_s.items()}}
                    self.handover_s = {}
                return metrics
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def asleep(self, timeout_s: float = 120.0) -> Iterator[None]:
        """Colocated placement: the engines give their memory back for the body (the trainer's
        step) and take it again at its end, empty; the push that follows fills it.

        Rules: `fleet.sleeping` is set from the release until that push succeeds, so health
        checks of engines that answer 503 meanwhile are not counted (a process that is gone
        still is). If the body raises, the engines are woken and reload the weights the
        fleet last served, so they serve consistently whatever the caller does next.
        """
        self.fleet.sleeping.set()
        began = time.perf_counter()
        with self.fleet.weight_push() as live:
            for c in live:
                c.release_memory_occupation(self.release_tags, timeout_s=timeout_s)
        released = time.perf_counter()
        try:
            yield
        except BaseException:
            self.wake(timeout_s, reload=True)
            raise
        trained = time.perf_counter()
        self.wake(timeout_s, reload=False)
        # inside the loop's timing/train_s: what of it the handover took
        self.handover_s = {"release": released - began, "resume": time.perf_counter() - trained}

    def wake(self, timeout_s: float = 120.0, reload: bool = False) -> None:
        """Every live engine takes its memory back (a no-op on an awake engine). `reload`: it
        also reloads the weights the fleet last served; otherwise the next push fills it."""
        with self.fleet.weight_push() as live:
            for c in live:
                c.resume_memory_occupation(self.release_tags, timeout_s=timeout_s)
                if reload:
                    path, version = self.fleet.loadable_served(timeout_s)
                    load_served(c, path, version, timeout_s)
        if reload:
            self.fleet.sleeping.clear()
