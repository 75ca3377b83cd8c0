"""What every stage job starts from: the campaign's recipe and store, and the block's Ray
cluster and fleet as the store records them (never in-memory objects of another stage)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from milepost.core.checkpoint import CheckpointManager
from milepost.core.config import Recipe
from milepost.core.records import Stage, StageRecord, StageState, block_path, campaign_id
from milepost.core.store import CampaignStore

if TYPE_CHECKING:
    from milepost.core.fleet.fleet import Fleet

FLEET_DOC = "fleet.json"
ENGINE_ADMIN_KEY = "engine_admin_key"  # secret name: the engines' --admin-api-key (core/secrets.py)


@dataclass
class StageContext:
    url: str
    block: int
    recipe: Recipe
    store: CampaignStore
    checkpoints: CheckpointManager
    # The Ray auth variables as they were before `connect` set the campaign's (restored on
    # `disconnect`).
    _auth_before: dict[str, str | None] | None = field(default=None, repr=False)

    @classmethod
    def open(cls, url: str, block: int) -> StageContext:
        store = CampaignStore(url)
        recipe = store.load_recipe()
        checkpoints = CheckpointManager(store.local_path("checkpoints"), recipe.checkpoint.keep_last)
        return cls(campaign_id(url), block, recipe, store, checkpoints)

    # --- records --------------------------------------------------------------------------
    def record(self, stage: Stage) -> StageRecord | None:
        return self.store.stage_record(self.block, stage)

    def update(self, stage: Stage, **fields: Any) -> StageRecord:
        """Merge `fields` into the stage's record now (e.g. a pid, before waiting on it)."""
        record = (self.record(stage) or StageRecord(StageState.RUNNING)).merged(**fields)
        self.store.write_stage_record(self.block, stage, record)
        return record

    def block_path(self, *parts: str) -> str:
        return self.store.local_path(block_path(self.block, *parts))

    def last_step(self) -> int:
        return (self.block + 1) * self.recipe.campaign.steps_per_block

    # --- the block's Ray cluster ------------------------------------------------------------
    @property
    def namespace(self) -> str:
        """Ray namespace of this block's fleet: detached actor names are per namespace."""
        digest = hashlib.sha1(self.url.encode()).hexdigest()[:10]
        return f"milepost-{digest}-b{self.block:06d}"

    def connect(self) -> str:
        """Join the block's Ray cluster by its recorded address, never `auto` (which attaches
        to any cluster on the node, another campaign's included)."""
        import ray

        launch = self.record(Stage.START_RAY)
        address = launch.outputs.get("address") if launch else None
        if launch is None or not address or launch.state not in (StageState.DONE, StageState.RUNNING):
            raise RuntimeError(f"block {self.block} has no live Ray cluster recorded "
                               f"({launch.state if launch else 'no start_ray record'}): start_ray must run first")
        _check_reachable(address, launch)
        if not ray.is_initialized():
            from milepost.tasks.ray_auth import use_campaign_ray_auth
            self._auth_before = use_campaign_ray_auth(self.store)
            ray.init(address=address, namespace=self.namespace, log_to_driver=False, logging_level=logging.WARNING)
        return address

    def disconnect(self) -> None:  # leaves the cluster, stops nothing of it
        import sys
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
        if self._auth_before is not None:
            from milepost.tasks.ray_auth import restore_environment
            restore_environment(self._auth_before)
            self._auth_before = None

    # --- the block's fleet --------------------------------------------------------------------
    def write_fleet(self, doc: dict[str, Any]) -> None:
        self.store.write_json(block_path(self.block, FLEET_DOC), doc)

    def fleet_doc(self) -> dict[str, Any] | None:
        rel = block_path(self.block, FLEET_DOC)
        return self.store.read_json(rel) if self.store.exists(rel) else None

    def attach_fleet(self) -> Fleet:
        """The fleet the start_engines stage started, with a supervisor of this stage's own."""
        from milepost.core.fleet.fleet import Fleet

        doc = self.fleet_doc()
        if doc is None:
            raise RuntimeError(f"block {self.block} has no fleet recorded: the start_engines stage must run first")
        self.connect()
        fleet = Fleet.attach(doc, self.recipe.rollout, on_change=self.write_fleet,
                             admin_key_path=self.engine_admin_key_path())
        fleet.replace_router_if_dead()
        return fleet

    def engine_admin_key_path(self) -> str:
        """The file holding the campaign's engine admin key (created owner-only on first use).
        Engines and clients get this path, never the key: it stays out of records and logs."""
        from milepost.core.secrets import ensure_secret

        return str(ensure_secret(self.store.local_path(), ENGINE_ADMIN_KEY))

    def model_path(self) -> str:
        from milepost.core.model.loading import resolve_model_path

        return resolve_model_path(self.recipe.model, self.recipe.seed)


def _check_reachable(address: str, launch: StageRecord) -> None:
    """Fail in seconds, not after Ray's long connect timeout, when the block's cluster is
    gone (its allocation ended, a node lost): the driver then relaunches the block."""
    import socket

    if launch.outputs.get("mode") == "slurm":
        from milepost.slurm.state import Outcome, query_states_blocking
        job_id = launch.outputs["job_id"]
        state = query_states_blocking([job_id])[job_id]
        if state.outcome is not Outcome.RUNNING:
            raise RuntimeError(f"the block's Ray allocation {job_id} is {state.slurm_state or state.outcome}, "
                               "not running: its cluster is gone")
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise RuntimeError(f"the block's Ray head {address} does not answer ({e}): its cluster is gone") from e
