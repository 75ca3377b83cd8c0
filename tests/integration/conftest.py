"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest
import ray

from milepost.slurm.devcluster import check_dev_cluster


@pytest.fixture(scope="session")
def dev_cluster() -> None:
    """The real dev Slurm cluster (2 virtual nodes with accounting), started by `.ci/run` or by
    hand with `bash slurm/devcluster.sh up`. Missing, the test fails and says how to start it."""
    problem = check_dev_cluster(min_nodes=2)
    if problem:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray for one test module (4 logical CPUs: room for 2 ranks and a driver)."""
    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()
