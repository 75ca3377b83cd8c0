"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from milepost.slurm.devcluster import check_dev_cluster


@pytest.fixture(scope="session")
def dev_cluster() -> None:
    """The real dev Slurm cluster (2 virtual nodes with accounting), started by `.ci/run` or by
    hand with `bash slurm/devcluster.sh up`. Missing, the test fails and says how to start it."""
    problem = check_dev_cluster(min_nodes=2)
    if problem:
        pytest.fail(problem, pytrace=False)
