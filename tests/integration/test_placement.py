"""Placement on a real local Ray cluster: the fleet creates the block's placement group and
the trainer ranks and engines land on the bundles `cluster.placement` gives them (read from
Ray's per-bundle resources), and a layout the cluster cannot hold fails with a clear error."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import remove_placement_group
from tinymodels import save_tiny_qwen2

from milepost.core.config import AlgoConfig, RolloutConfig, TrainConfig
from milepost.core.fleet.fleet import Fleet
from milepost.core.placement import ENGINE_CPUS, Placement, ensure_group, find_group
from milepost.core.train.torch_backend import RANK_NUM_CPUS, TorchBackend


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = save_tiny_qwen2(tmp_path_factory.mktemp("placement") / "m", 0)
    # 4 logical GPUs (no device behind them): Ray accounts and assigns them like real ones.
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield path
    ray.shutdown()


def _used_per_bundle(group_id: str, num_bundles: int) -> list[float]:
    """Logical CPUs taken in each bundle of the group (Ray names them CPU_group_<i>_<id>)."""
    total, free = ray.cluster_resources(), ray.available_resources()
    return [round(total[f"CPU_group_{i}_{group_id}"] - free.get(f"CPU_group_{i}_{group_id}", 0.0), 3)
            for i in range(num_bundles)]


@pytest.mark.parametrize("mode, expected", [
    # 2 ranks + 1 engine. colocated: rank 0 and the engine share bundle 0, rank 1 has bundle 1.
    ("colocated", [RANK_NUM_CPUS + ENGINE_CPUS, RANK_NUM_CPUS]),
    # disaggregated: each rank its own bundle, the engine the third.
    ("disaggregated", [RANK_NUM_CPUS, RANK_NUM_CPUS, ENGINE_CPUS]),
    # shared: as colocated (the engine only never sleeps: tests/integration/test_shared_placement.py).
    ("shared", [RANK_NUM_CPUS + ENGINE_CPUS, RANK_NUM_CPUS]),
])
def test_ranks_and_engines_land_on_their_bundles(model, mode, expected) -> None:
    placement = Placement(mode, num_ranks=2, num_engines=1, rank_cpus=RANK_NUM_CPUS)
    fleet = Fleet.start(model, 1, RolloutConfig(engine_startup_timeout_s=90.0), placement=placement)
    backend = None
    try:
        group = fleet.placement_group
        assert find_group() is not None and find_group().id == group.id
        backend = TorchBackend.create(model, TrainConfig(num_ranks=2, micro_batch_size=4), AlgoConfig(), 1.0,
                                      seed=0, placement_group=group)
        assert len(set(backend.rank_weights_sha256())) == 1  # both ranks answer, in step
        assert _used_per_bundle(group.id.hex(), len(expected)) == [round(x, 3) for x in expected]
        assert fleet.describe()["engine_bundles"] == [placement.engine_bundle(0)]
    finally:
        if backend is not None:
            backend.shutdown()
        fleet.stop()
        remove_placement_group(fleet.placement_group)


def test_a_placement_the_cluster_cannot_hold_is_refused_with_the_numbers(model) -> None:
    too_many = Placement("disaggregated", num_ranks=2, num_engines=12, rank_cpus=RANK_NUM_CPUS)
    with pytest.raises(RuntimeError, match="cannot hold placement disaggregated") as refused:
        ensure_group(too_many, timeout_s=3)
    assert "Fewer ranks/engines" in str(refused.value)
    assert find_group() is None  # the infeasible group was removed, nothing left behind


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


def test_sglang_engines_get_gpu_bundles_and_their_devices(model, tmp_path) -> None:
    """rollout.engine: sglang with TP 2: each engine's bundle holds 2 GPUs, its actor takes
    them (the fleet's own Ray options), and the engine process it launches sees exactly
    those 2 devices in CUDA_VISIBLE_DEVICES (so `--base-gpu-id 0` is its first). The process
    launched is the built-in engine (SGLang cannot run here), through the same actor."""
    from milepost.core.fleet.actor import EngineActor
    from milepost.core.fleet.launcher import engine_command, engine_gpus

    cfg = RolloutConfig(engine="sglang", engine_tensor_parallel=2, num_engines=2)
    placement = Placement("disaggregated", num_ranks=0, num_engines=2, rank_cpus=RANK_NUM_CPUS,
                          engine_gpus=engine_gpus(cfg))
    assert placement.bundles() == [{"CPU": ENGINE_CPUS, "GPU": 2.0}] * 2
    fleet = Fleet(model, "0", cfg, "127.0.0.1", log_dir=str(tmp_path))  # not started: its options only
    fleet.placement_group = ensure_group(placement)
    fleet.engine_bundles = [placement.engine_bundle(i) for i in range(2)]
    builtin = engine_command(RolloutConfig(), model, "0", colocated=False, host="127.0.0.1")
    actors = [EngineActor.options(**fleet.engine_placement(i)).remote(str(tmp_path / f"e{i}.log")) for i in range(2)]
    try:
        assert all(fleet.engine_placement(i)["num_gpus"] == 2 for i in range(2))
        pids = [ray.get(a.launch.remote(builtin), timeout=120)[1] for a in actors]
        devices = [_environ(pid)["CUDA_VISIBLE_DEVICES"].split(",") for pid in pids]
        assert [len(d) for d in devices] == [2, 2] and not set(devices[0]) & set(devices[1]), devices
    finally:
        for a in actors:
            ray.get(a.stop.remote(), timeout=30)
            ray.kill(a, no_restart=True)
        remove_placement_group(fleet.placement_group)


def test_on_gpus_a_colocated_rank_and_builtin_engine_share_one_gpu(model, tmp_path) -> None:
    """A cluster with GPUs: colocated, rank 0 and the built-in engine each ask half of bundle
    0's one GPU, so Ray shows both the same device (an actor asking none would see none);
    disaggregated, every rank and engine gets a GPU of its own."""
    from milepost.core.fleet.actor import EngineActor
    from milepost.core.fleet.launcher import engine_command, engine_gpus
    from milepost.core.placement import actor_strategy

    cfg = RolloutConfig(num_engines=1)
    apart = Placement("disaggregated", 2, 1, RANK_NUM_CPUS, engine_gpus(cfg, True), gpus=True)
    assert [b.get("GPU") for b in apart.bundles()] == [1.0, 1.0, 1.0]
    assert [apart.rank_gpus(r) for r in range(2)] == [1.0, 1.0] and apart.engine_gpu_request(0) == 1.0
    placement = Placement("colocated", 1, 1, RANK_NUM_CPUS, engine_gpus(cfg, True), gpus=True)
    assert placement.bundles() == [{"CPU": RANK_NUM_CPUS + ENGINE_CPUS, "GPU": 1.0}]
    assert placement.rank_gpus(0) == placement.engine_gpu_request(0) == 0.5
    fleet = Fleet(model, "0", cfg, "127.0.0.1", log_dir=str(tmp_path))  # not started: its options only
    fleet.placement_group = ensure_group(placement)
    fleet.engine_bundles, fleet.engine_gpu_requests = [0], [placement.engine_gpu_request(0)]
    rank = ray.remote(lambda: __import__("os").environ.get("CUDA_VISIBLE_DEVICES", "")).options(
        num_cpus=RANK_NUM_CPUS, num_gpus=placement.rank_gpus(0), **actor_strategy(fleet.placement_group, 0))
    actor = EngineActor.options(**fleet.engine_placement(0)).remote(str(tmp_path / "e0.log"))
    try:
        pid = ray.get(actor.launch.remote(engine_command(cfg, model, "0", colocated=True, host="127.0.0.1")),
                      timeout=120)[1]
        seen_by_rank = ray.get(rank.remote(), timeout=60)
        assert seen_by_rank and _environ(pid)["CUDA_VISIBLE_DEVICES"] == seen_by_rank
    finally:
        ray.get(actor.stop.remote(), timeout=30)
        ray.kill(actor, no_restart=True)
        remove_placement_group(fleet.placement_group)
