"""Bad input exits 2 in seconds, names the problem, prints no traceback and writes nothing.

Every case runs the real command line (`python -m milepost.cli`) in a fresh process; `{tmp}`
in an argument is the test's folder, where the fixtures below are written first. The
library-level checks behind these messages are in tests/unit/test_bad_input.py.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FIXTURES = {
    "bad-line.jsonl": '{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": \n',
    "no-prompt.jsonl": '{"prompt": "1+1=", "label": "2"}\n{"question": "2+2=", "label": "4"}\n',
    "empty.jsonl": "\n",
    "long.jsonl": json.dumps({"prompt": "1+" * 40 + "1=", "label": "41"}) + "\n",
    "r.py": "LIMIT = 3\ndef one_arg(response_text):\n    return 1.0\n",
    "list.yaml": "- train\n- rollout\n",
    "a-file": "not a campaign folder\n",
    "ckpt-without-config/weights.txt": "",
    "not-a-campaign/notes.txt": "",
}


def _fixtures(tmp_path: Path) -> dict[str, bytes]:
    for name, text in FIXTURES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return _tree(tmp_path)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _milepost(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    return subprocess.run([sys.executable, "-m", "milepost.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _assert_bad_input(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


RUN = ["run", "recipes/tiny-arith.yaml", "--campaign", "{tmp}/campaign"]


@pytest.mark.parametrize("args,expected", [
    # recipes and overrides
    (["--set", "train.lrr=0.1"], "unknown key `train.lrr`: did you mean `train.lr`?"),
    (["--set", "campaign.num_blocks=many"], "`campaign.num_blocks`"),
    (["--set", "train.lr=[1,"], "--set 'train.lr=[1,': the value '[1,' is not valid YAML"),
    (["--set", "train.lr"], "expected dotted.key=value"),
    (["--set", "campaign.steps_per_block=-1"],
     "`campaign.steps_per_block`: Input should be greater than or equal to 1 (got -1)"),
    (["--set", "rollout.top_p=1.5"], "`rollout.top_p`: Input should be less than or equal to 1 (got 1.5)"),
    (["--set", "rollout.temperature=-1"], "`rollout.temperature`: Input should be greater than or equal to 0"),
    (["--set", "loop.max_staleness=2"], "cluster.placement=shared (the same devices, both resident), or loop"),
    # model paths: checked before the store is written
    (["--set", "model.path=/nonexistent/model"], "model.path `/nonexistent/model` does not exist; pass a folder saved"),
    (["--set", "model.path={tmp}/ckpt-without-config"], "is not an HF checkpoint folder (no config.json)"),
    (["--set", "model.path=builtin:gpt5"], "model.path `builtin:gpt5`: unknown builtin model"),
    # datasets: file and line
    (["--set", "data.train_path=/nonexistent/train.jsonl"],
     "data.train_path: dataset `/nonexistent/train.jsonl` does not exist"),
    (["--set", "data.train_path={tmp}/bad-line.jsonl"], "bad-line.jsonl: line 2 is not valid JSON"),
    (["--set", "data.eval_path={tmp}/no-prompt.jsonl"], "no-prompt.jsonl: line 2 has no `prompt`"),
    (["--set", "data.train_path={tmp}/empty.jsonl"], "empty.jsonl` has no rows"),
    (["--set", "data.train_path={tmp}/long.jsonl"],
     "long.jsonl: line 1: the prompt is 82 tokens, longer than 58 tokens"),
    # reward functions
    (["--set", "reward.function=no_such_module:score"], "reward.function `no_such_module:score`: cannot import"),
    (["--set", "reward.function=./nope.py:score"], "file nope.py does not exist"),
    (["--set", "reward.function={tmp}/r.py:score"], "r.py` has no attribute `score`; its functions: one_arg"),
    (["--set", "reward.function={tmp}/r.py:one_arg"], "must accept (response_text, label)"),
    (["--set", "reward.function={tmp}/r.py:LIMIT"], "r.py:LIMIT` is a int, not callable"),
    # flags
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--set"], "argument --set: expected one argument"),
    (["--campaign", "{tmp}/a-file"], "a-file is a file; a campaign is a folder"),
    (["--campaign", " "], "--campaign is empty"),
])
def test_run_with_bad_input_exits_2_names_the_problem_and_writes_nothing(tmp_path, args, expected):
    before = _fixtures(tmp_path)
    proc = _milepost(tmp_path, *RUN, *args)
    _assert_bad_input(proc, expected)
    assert not (tmp_path / "campaign").exists()
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("args,expected", [
    ([], "the following arguments are required: command"),
    (["run"], "the following arguments are required: recipe"),
    (["run", "recipes/no-such.yaml", "--campaign", "{tmp}/campaign"],
     "recipe file recipes/no-such.yaml does not exist"),
    (["run", "{tmp}/list.yaml", "--campaign", "{tmp}/campaign"], "a recipe is a YAML mapping of sections"),
    (["status", "{tmp}/no-such-campaign"],
     "no-such-campaign does not exist; pass the folder given to `milepost run --campaign`"),
    (["status", "{tmp}/not-a-campaign"], "not-a-campaign is not a campaign (no campaign.yaml)"),
    (["plan"], "plan needs a recipe"),
    (["plan", "recipes/no-such.yaml"], "recipe file recipes/no-such.yaml does not exist"),
    (["plan", "recipes/tiny-arith.yaml", "--set", "train.lr=[1,"],
     "--set 'train.lr=[1,': the value '[1,' is not valid YAML"),
    (["plan", "recipes/tiny-arith.yaml", "--set", "train.megatron.tensor_paralel=2"],
     "did you mean `train.megatron.tensor_parallel`?"),
    (["airflow", "sideways"], "argument action: invalid choice: 'sideways'"),
])
def test_other_commands_with_bad_input_exit_2_and_write_nothing(tmp_path, args, expected):
    before = _fixtures(tmp_path)
    proc = _milepost(tmp_path, *args)
    _assert_bad_input(proc, expected)
    assert _tree(tmp_path) == before
    assert not (tmp_path / "campaign").exists() and not (tmp_path / "no-such-campaign").exists()


def test_a_different_recipe_against_an_existing_campaign_is_refused_with_a_diff(tmp_path):
    from milepost.core.recipe_io import load_recipe
    from milepost.tasks.campaign import prepare_campaign
    prepare_campaign(load_recipe(ROOT / "recipes/tiny-arith.yaml"), str(tmp_path / "campaign"))
    stored = (tmp_path / "campaign" / "campaign.yaml").read_text()
    proc = _milepost(tmp_path, *RUN, "--set", "train.lr=0.5")
    assert proc.returncode == 2
    assert "different recipe" in proc.stderr and "+  lr: 0.5" in proc.stderr
    assert (tmp_path / "campaign" / "campaign.yaml").read_text() == stored
