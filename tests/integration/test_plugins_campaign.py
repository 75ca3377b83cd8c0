"""tiny-arith with a loss, an advantage estimator, a filter and hooks given as `file.py:function`
on the command line: each is called, the hooks record what they saw, and — each being the
README's rewrite of a built-in — the campaign ends at the built-in run's `model_sha256`. A
plugin with a wrong signature exits 2 before anything starts, naming it.

Every run is the real command line (`python -m milepost.cli`) in a fresh process, in the test's
folder: plugin paths are relative to it, as a user's are to the folder they run in.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["campaign.num_blocks=1", "campaign.steps_per_block=4", "rollout.prompts_per_step=8",
         "eval.num_prompts=16", "rollout.deterministic_inference=true"]

# Each README example, wrapped so that every call is counted in called.txt (the loss runs in
# the trainer rank actors, the others in the run_steps stage: the file is the one witness of both).
COUNTED = '''import functools
from milepost.core.plugins import load_object


def _counted(kind, spec):
    fn = load_object({examples!r} + "/" + spec, what=kind, known=[])

    @functools.wraps(fn)  # the signature check sees the example's own signature
    def call(*args):
        with open({called!r}, "a") as f:
            f.write(kind + "\\n")
        return fn(*args)
    return call


loss = _counted("algo.loss", "ppo_loss.py:ppo_loss")
advantage = _counted("algo.advantage", "grpo_advantage.py:grpo")
flat_groups = _counted("filters.functions", "flat_groups_filter.py:drop_flat_groups")
'''


def _milepost(cwd: Path, *args: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "milepost.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout_s)


def _run(cwd: Path, campaign: str, extra: list[str]) -> str:
    sets = [a for s in SHORT + extra for a in ("--set", s)]
    proc = _milepost(cwd, "run", str(ROOT / "recipes" / "tiny-arith.yaml"), "--campaign", campaign, "--quiet", *sets)
    assert proc.returncode == 0, proc.stderr[-4000:]
    status = _milepost(cwd, "status", campaign, "--json", timeout_s=120)
    assert status.returncode == 0, status.stderr
    return json.loads(status.stdout)["latest_checkpoint"]["model_sha256"]


@pytest.mark.slow
def test_plugins_given_as_files_are_called_and_the_rewritten_builtins_train_the_same_weights(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples" / "plugins", tmp_path / "examples")
    (tmp_path / "counted.py").write_text(COUNTED.format(called=str(tmp_path / "called.txt"),
                                                             examples=str(tmp_path / "examples")))
    builtin_sha = _run(tmp_path, "builtin", [])
    plugin_sha = _run(tmp_path, "plugins", [
        "algo.loss=counted.py:loss", "algo.advantage=counted.py:advantage",
        "filters.drop_zero_variance_groups=false", "filters.functions=[counted.py:flat_groups]",
        *(f"hooks.{event}=[examples/event_log_hooks.py:{event}]"
          for event in ("on_rollout", "on_step_end", "on_checkpoint", "on_block_end"))])

    called = (tmp_path / "called.txt").read_text().split()
    assert {kind: called.count(kind) > 0 for kind in ("algo.loss", "algo.advantage", "filters.functions")} == \
        {"algo.loss": True, "algo.advantage": True, "filters.functions": True}, called
    assert called.count("filters.functions") == 4  # once a step
    events = [json.loads(line) for line in (tmp_path / "hook_events.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("step")) for e in events if e["event"] != "on_checkpoint"] == [
        *((event, step) for step in range(1, 5) for event in ("on_rollout", "on_step_end")),
        ("on_block_end", None)]
    assert all(len(e["rewards"]) == 8 * 8 for e in events if e["event"] == "on_rollout")  # 8 prompts x 8 samples
    checkpoints = [e for e in events if e["event"] == "on_checkpoint"]
    assert checkpoints[-1]["step"] == 4 and checkpoints[-1]["model_sha256"] == plugin_sha
    assert events[-1] == {"event": "on_block_end", "block": 0, "last_step": 4, "model_sha256": plugin_sha}
    rows = [json.loads(line) for line in (tmp_path / "plugins" / "blocks" / "000000" / "metrics.jsonl").open()]
    assert [r["filter/flat_groups"] for r in rows] == [r["filter/dropped_zero_variance_groups"] for r in
                                                      _rows(tmp_path / "builtin")]
    assert plugin_sha == builtin_sha


def _rows(campaign: Path) -> list[dict]:
    return [json.loads(line) for line in (campaign / "blocks" / "000000" / "metrics.jsonl").open()]


def test_a_plugin_with_a_wrong_signature_exits_2_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "my_loss.py").write_text("def loss(inputs, scale):\n    return inputs.logprobs, inputs.mask\n")
    proc = _milepost(tmp_path, "run", str(ROOT / "recipes" / "tiny-arith.yaml"), "--campaign", "c",
                     "--set", "algo.loss=my_loss.py:loss", timeout_s=120)
    assert proc.returncode == 2, proc.stderr
    assert ("algo.loss `my_loss.py:loss` must accept (inputs): missing a required argument: 'scale'; change its "
            "signature to fn(inputs: PolicyLossInputs) -> tuple[Tensor, Tensor]") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_loss.py"]  # no campaign store, nothing else
