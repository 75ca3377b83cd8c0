"""The recipe's `cluster` section: validated at the door like every other section."""

from __future__ import annotations

import pytest

from milepost.core.config import ClusterConfig, Recipe, SlurmOptions
from milepost.core.recipe_io import RecipeError, recipe_from_dict
from milepost.slurm import options


def test_defaults_are_the_embedded_local_executor():
    assert Recipe().cluster == ClusterConfig(executor="local", num_nodes=1, slurm=SlurmOptions())


def test_slurm_options_are_one_model_reexported_by_slurm():
    assert options.SlurmOptions is SlurmOptions


@pytest.mark.parametrize("doc, needle", [
    ({"cluster": {"executor": "kubernetes"}}, "executor"),
    ({"cluster": {"num_nodes": 0}}, "num_nodes"),
    ({"cluster": {"slurm": {"partitoin": "gpu"}}}, "partitoin"),
    ({"cluster": {"slurm": {"extra": {"reservaton": "x"}}}}, "reservaton"),
])
def test_bad_cluster_values_fail_naming_the_field(doc, needle):
    with pytest.raises((RecipeError, ValueError), match=needle):
        recipe_from_dict(doc)
