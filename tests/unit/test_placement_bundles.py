"""core/placement.py's arithmetic (no Ray): which bundle each rank and engine takes and what it
asks of it, per `cluster.placement`."""

from __future__ import annotations

import pytest

from milepost.core.placement import ENGINE_CPUS, GPU_SHARE, Placement

RANK_CPUS = 1.0


@pytest.mark.parametrize("mode", ["colocated", "shared"])
def test_colocated_and_shared_put_rank_b_and_engine_b_on_one_bundle(mode: str) -> None:
    cpu = Placement(mode, num_ranks=2, num_engines=1, rank_cpus=RANK_CPUS)
    assert cpu.bundles() == [{"CPU": RANK_CPUS + ENGINE_CPUS}, {"CPU": RANK_CPUS + ENGINE_CPUS}]
    assert cpu.engine_bundle(0) == cpu.rank_bundle(0) == 0 and cpu.rank_gpus(0) == 0.0
    gpu = Placement(mode, num_ranks=1, num_engines=1, rank_cpus=RANK_CPUS, engine_gpus=1, gpus=True)
    assert gpu.bundles() == [{"CPU": RANK_CPUS + ENGINE_CPUS, "GPU": 1.0}]  # one GPU for both
    assert gpu.rank_gpus(0) == gpu.engine_gpu_request(0) == GPU_SHARE


def test_disaggregated_gives_every_rank_and_engine_its_own_bundle_and_gpu() -> None:
    apart = Placement("disaggregated", num_ranks=2, num_engines=1, rank_cpus=RANK_CPUS, engine_gpus=1, gpus=True)
    assert apart.bundles() == [{"CPU": RANK_CPUS, "GPU": 1.0}, {"CPU": RANK_CPUS, "GPU": 1.0},
                               {"CPU": ENGINE_CPUS, "GPU": 1.0}]
    assert apart.engine_bundle(0) == 2 and apart.rank_gpus(1) == apart.engine_gpu_request(0) == 1.0


def test_only_colocated_and_shared_share_devices() -> None:
    shares = {m: Placement(m, 1, 1, RANK_CPUS).shares_devices for m in ("colocated", "shared", "disaggregated")}
    assert shares == {"colocated": True, "shared": True, "disaggregated": False}
