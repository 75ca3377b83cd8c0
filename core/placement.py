"""Where the trainer ranks and the engines run on the block's Ray cluster (`cluster.placement`).

One detached placement group per block cluster, created by the start_engines stage (the first
to need it) and found by name by the run_steps stage and by engine restarts:

- `colocated`: one bundle per device slot, max(trainer ranks, engines) of them; trainer rank
  r and engine e share bundle r and e (devices are shared; engines sleep while the trainer
  runs, see FleetTransport.asleep).
- `disaggregated`: the trainer's bundles first, then the engines' own; nothing is shared,
  so rollout and training overlap freely (async, loop.max_staleness > 0).
- `shared`: bundles as colocated, but the engines never sleep: trainer and engines both keep
  their memory and overlap on the same devices (async on one GPU). Both must fit together
  (`milepost plan` checks it).

SGLang engines (`rollout.engine: sglang`) get GPU bundles: engine e's bundle holds its
TP size in GPUs, the engine actor asks for them (`num_gpus`), Ray sets its
CUDA_VISIBLE_DEVICES, and the engine starts at `--base-gpu-id 0` (core/fleet/launcher.py).

On a cluster with GPUs (`gpus`), every trainer rank and every built-in engine takes one:
disaggregated, each its own bundle's GPU; colocated, a rank and the engine of its bundle
each ask GPU_SHARE of the bundle's one GPU, so Ray gives both that GPU in
CUDA_VISIBLE_DEVICES (an actor that asks no GPU sees none) and they hand its memory over
each step (`shared`: the same, without the handover). Colocated SGLang engines of TP > 1
keep their whole bundle: ranks beside them ask no GPU (not run on GPUs yet).

Strategy PACK: bundles fill one node before the next, so a block's trainer ranks stay
together (their collectives are the heaviest traffic). The group dies with the block's Ray
cluster (teardown); nothing else removes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

GROUP_NAME = "milepost-placement"  # unique: every block has its own Ray cluster and namespace
ENGINE_CPUS = 0.5  # what an engine actor reserves (core/fleet/actor.py)
GPU_SHARE = 0.5  # colocated on a GPU: what the rank and the engine of a bundle each ask of it


@dataclass(frozen=True)
class Placement:
    mode: str  # "colocated" | "disaggregated" | "shared"
    num_ranks: int
    num_engines: int
    rank_cpus: float
    engine_gpus: int = 0  # GPUs per engine: SGLang TP=k takes k, the built-in 1 on GPUs (launcher.engine_gpus)
    gpus: bool = False  # the cluster has GPUs: trainer ranks take one each (module docstring)

    @property
    def shares_devices(self) -> bool:
        """Trainer rank b and engine b on one bundle (colocated and shared)."""
        return self.mode in ("colocated", "shared")

    def bundles(self) -> list[dict[str, float]]:
        """Logical CPUs, plus GPUs: `engine_gpus` in each engine's bundle (an SGLang engine of
        TP=k is one actor: its k GPUs must be one bundle, hence one node) and, with `gpus`,
        one in each rank's. Colocated, bundle b holds engine b and trainer rank b."""
        if self.shares_devices:
            return [{"CPU": self.rank_cpus + ENGINE_CPUS, **_gpu(self._colocated_gpus(b))}
                    for b in range(max(self.num_ranks, self.num_engines))]
        return ([{"CPU": self.rank_cpus, **_gpu(1 if self.gpus else 0)} for _ in range(self.num_ranks)]
                + [{"CPU": ENGINE_CPUS, **_gpu(self.engine_gpus)} for _ in range(self.num_engines)])

    def _colocated_gpus(self, bundle: int) -> int:
        engine = self.engine_gpus if bundle < self.num_engines else 0
        return max(engine, 1 if self.gpus and bundle < self.num_ranks else 0)

    def _shares_gpu(self, bundle: int) -> bool:
        """A rank and a one-GPU engine on one bundle's GPU (colocated or shared)."""
        return (self.shares_devices and self.gpus and self.engine_gpus == 1
                and bundle < self.num_engines and bundle < self.num_ranks)

    def rank_gpus(self, rank: int) -> float:
        """What trainer rank `rank` asks of its bundle (Ray shows it those GPUs)."""
        if not self.gpus:
            return 0.0
        if self._shares_gpu(self.rank_bundle(rank)):
            return GPU_SHARE
        busy = self.shares_devices and rank < self.num_engines and self.engine_gpus > 1
        return 0.0 if busy else 1.0

    def engine_gpu_request(self, index: int) -> float:
        """What engine `index` asks of its bundle."""
        return GPU_SHARE if self._shares_gpu(self.engine_bundle(index)) else float(self.engine_gpus)

    def rank_bundle(self, rank: int) -> int:
        return rank

    def engine_bundle(self, index: int) -> int:
        if self.shares_devices:
            return index % max(self.num_ranks, self.num_engines)
        return self.num_ranks + index


def placement_for(recipe: Any, rank_cpus: float) -> Placement:
    """The block's placement from the recipe (cluster.placement, train.num_ranks, engines) and
    the connected Ray cluster (GPUs or not)."""
    from milepost.core.fleet.launcher import engine_gpus
    gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    return Placement(recipe.cluster.placement, recipe.train.num_ranks, recipe.rollout.num_engines, rank_cpus,
                     engine_gpus(recipe.rollout, gpus), gpus)


def ensure_group(placement: Placement, timeout_s: float = 300.0) -> PlacementGroup:
    """The block's placement group: found by name, or created (detached) and waited for."""
    try:
        return get_placement_group(GROUP_NAME)
    except ValueError:  # not created yet on this cluster
        pass
    group = placement_group(placement.bundles(), strategy="PACK", name=GROUP_NAME, lifetime="detached")
    if not group.wait(timeout_s):
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"the block's Ray cluster cannot hold placement {placement.mode} "
                           f"({placement.bundles()}) within {timeout_s:.0f}s; available: "
                           f"{ray.available_resources()}. Fewer ranks/engines, or more nodes.")
    return group


def find_group() -> PlacementGroup | None:
    try:
        return get_placement_group(GROUP_NAME)
    except ValueError:
        return None


def _gpu(count: float) -> dict[str, float]:
    return {"GPU": float(count)} if count else {}


def actor_strategy(group: PlacementGroup | None, bundle: int) -> dict[str, Any]:
    """Ray actor options putting an actor on `bundle` of `group` (none without a group)."""
    if group is None:
        return {}
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=bundle)}
