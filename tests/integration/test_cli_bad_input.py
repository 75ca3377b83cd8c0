"""Bad input exits 2 in seconds, names the problem, and writes nothing to the store."""

import subprocess
import sys

import pytest


def _run(tmp_path, *args):
    campaign = tmp_path / "campaign"
    proc = subprocess.run([sys.executable, "-m", "milepost.cli", "run", "recipes/tiny-arith.yaml",
                           "--campaign", str(campaign), *args],
                          capture_output=True, text=True, timeout=120)
    return proc, campaign


@pytest.mark.parametrize("args,expected", [
    (["--set", "train.lrr=0.1"], "unknown key `train.lrr`"),
    (["--set", "campaign.num_blocks=many"], "`campaign.num_blocks`"),
    (["--set", "data.train_path=/nonexistent/train.jsonl"], "data.train_path: dataset `/nonexistent/train.jsonl` does not exist"),
    (["--set", "reward.function=no_such_module:score"], "reward.function `no_such_module:score`: cannot import"),
    (["--set", "reward.function=./nope.py:score"], "file nope.py does not exist"),
    (["--set", "train.lr"], "expected dotted.key=value"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_input_exits_2_names_the_problem_and_writes_nothing(tmp_path, args, expected):
    proc, campaign = _run(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not campaign.exists()


def test_a_different_recipe_against_an_existing_campaign_is_refused_with_a_diff(tmp_path):
    from milepost.core.recipe_io import load_recipe
    from milepost.tasks.campaign import prepare_campaign
    prepare_campaign(load_recipe("recipes/tiny-arith.yaml"), str(tmp_path / "campaign"))
    proc, _ = _run(tmp_path, "--set", "train.lr=0.5")
    assert proc.returncode == 2
    assert "different recipe" in proc.stderr and "+  lr: 0.5" in proc.stderr
