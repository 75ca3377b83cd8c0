"""Plugins: one resolver for every extension point, the README's examples, signatures checked at start-up."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from milepost.core.algo.advantages import ADVANTAGE_ESTIMATORS, grpo_advantages
from milepost.core.algo.losses import POLICY_LOSSES, PolicyLossInputs, ppo_clip_token_loss, rl_loss
from milepost.core.config import AlgoConfig, FilterConfig, HooksConfig
from milepost.core.extensions import resolve_extensions, trainer_algo
from milepost.core.filters import FILTERS, FilterChain, FilterError, drop_zero_variance_groups
from milepost.core.hooks import BlockInfo, CommittedCheckpoint, HookError, Hooks
from milepost.core.loop import assign_advantages
from milepost.core.plugins import PluginError, portable_spec
from milepost.core.recipe_io import load_recipe
from milepost.core.step_context import StepContext
from milepost.core.types import Sample

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "plugins"
TINY = ROOT / "recipes" / "tiny-arith.yaml"
CONTEXT = StepContext(step=3, policy_version=2, last_step=4, seed=1)


def _sample(group: int, reward: float, index: int = 0) -> Sample:
    return Sample(prompt_index=group, group_index=group, prompt_ids=[1], response_ids=[2, 3],
                  engine_logprobs=[0.0, 0.0], loss_mask=[1, 1], finish_reason="stop", weight_version="0",
                  label=str(index), reward=reward)


def _readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```\n", (ROOT / "README.md").read_text(), flags=re.S)


@pytest.mark.parametrize("name", ["ppo_loss.py", "grpo_advantage.py", "flat_groups_filter.py", "event_log_hooks.py"])
def test_the_readme_shows_each_example_file_as_it_is(name):
    assert f"# examples/plugins/{name}\n" + (EXAMPLES / name).read_text() in _readme_python_blocks()


def test_the_readme_command_line_resolves_through_the_recipe(monkeypatch):
    """The `--set` lines of the README's command, read as `milepost run` reads them."""
    command = (ROOT / "README.md").read_text().split("All four at once, on the command line:")[1]
    overrides = [m.strip("'") for m in re.findall(r"--set ('[^']*'|\S+)", command.split("```")[1])]
    monkeypatch.chdir(ROOT)
    recipe = load_recipe(TINY, overrides)
    extensions = resolve_extensions(recipe)
    assert recipe.algo.loss == "examples/plugins/ppo_loss.py:ppo_loss"
    filters = [spec for spec, _ in extensions.filters.filters]
    assert filters[-1] == "examples/plugins/flat_groups_filter.py:drop_flat_groups"
    assert [spec for spec, _ in extensions.hooks.on_step_end] == ["examples/plugins/event_log_hooks.py:on_step_end"]


# --- each example equals the built-in it rewrites, bit for bit ---------------------------------

def test_the_example_loss_equals_the_builtin_ppo_in_values_and_gradients():
    torch.manual_seed(0)
    lp = torch.randn(4, 7) * 0.3
    old, adv, mask = lp + torch.randn(4, 7) * 0.3, torch.randn(4, 7), (torch.rand(4, 7) > 0.2).float()
    engine = old + torch.randn(4, 7) * 0.01
    cfg_builtin = AlgoConfig()
    cfg_plugin = AlgoConfig(loss=f"{EXAMPLES}/ppo_loss.py:ppo_loss")
    results = []
    for cfg in (cfg_builtin, cfg_plugin):
        x = lp.clone().requires_grad_(True)
        loss, metrics = rl_loss(x, old, engine, adv, mask, cfg, token_normalizer=float(mask.sum()))
        loss.backward()
        results.append((loss.detach(), x.grad, metrics))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2] and results[0][2]["loss/clipfrac"] > 0  # clips were exercised
    inputs = PolicyLossInputs(lp, old, adv, mask, 0.2, 0.28, None)  # and without the dual clip
    plugin = POLICY_LOSSES.resolve(f"{EXAMPLES}/ppo_loss.py:ppo_loss")(inputs)
    builtin = ppo_clip_token_loss(lp, old, adv, 0.2, 0.28, None)
    assert all(torch.equal(a, b) for a, b in zip(plugin, builtin))


def test_the_example_advantage_equals_the_builtin_grpo_through_the_loop():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0]
    groups = [0, 0, 0, 1, 1, 1, 2]
    builtin = [_sample(g, r) for g, r in zip(groups, rewards)]
    plugin = [_sample(g, r) for g, r in zip(groups, rewards)]
    assign_advantages(builtin, "grpo")
    assign_advantages(plugin, f"{EXAMPLES}/grpo_advantage.py:grpo")
    assert [s.advantage for s in plugin] == [s.advantage for s in builtin]
    assert any(s.advantage != 0 for s in plugin)
    table = torch.tensor([[1.0, 0.0, 3.0], [2.0, 2.0, 5.0]])
    assert torch.equal(ADVANTAGE_ESTIMATORS.resolve(f"{EXAMPLES}/grpo_advantage.py:grpo")(table),
                       grpo_advantages(table))


def test_the_example_filter_keeps_what_the_builtin_keeps_and_adds_its_metric():
    samples = [_sample(0, 1.0), _sample(0, 1.0), _sample(1, 0.0), _sample(1, 1.0), _sample(2, 0.0)]
    builtin, _ = FilterChain.from_config(FilterConfig())(samples, CONTEXT)
    spec = f"{EXAMPLES}/flat_groups_filter.py:drop_flat_groups"
    plugin, metrics = FilterChain.from_config(
        FilterConfig(drop_zero_variance_groups=False, functions=(spec,)))(samples, CONTEXT)
    assert plugin == builtin == samples[2:4]
    assert metrics == {"filter/dropped_zero_variance_groups": 0.0, "filter/dropped_length": 0.0,
                       "filter/flat_groups": 2.0, "filter/kept": 2.0}


def test_the_example_hooks_write_what_each_event_showed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = f"{EXAMPLES}/event_log_hooks.py"
    hooks = Hooks.from_config(HooksConfig(on_rollout=(f"{spec}:on_rollout",), on_step_end=(f"{spec}:on_step_end",),
                                          on_checkpoint=(f"{spec}:on_checkpoint",),
                                          on_block_end=(f"{spec}:on_block_end",)))
    hooks.rollout([_sample(0, 1.0), _sample(0, 0.0)], CONTEXT)
    hooks.step_end({"step": 3, "rollout/reward_mean": 0.5}, CONTEXT)
    hooks.checkpoint(CommittedCheckpoint(3, "/c/3", "ab12"), CONTEXT)
    hooks.block_end(BlockInfo(0, 1, 4, "cd34"), CONTEXT)
    events = [json.loads(line) for line in (tmp_path / "hook_events.jsonl").read_text().splitlines()]
    assert events == [{"event": "on_rollout", "step": 3, "rewards": [1.0, 0.0]},
                      {"event": "on_step_end", "step": 3, "reward_mean": 0.5},
                      {"event": "on_checkpoint", "step": 3, "model_sha256": "ab12"},
                      {"event": "on_block_end", "block": 0, "last_step": 4, "model_sha256": "cd34"}]


# --- wrong plugins fail at start-up, naming the key, the plugin, the signature and the fix ------

BAD = """
def two(a, b):
    return a
def none():
    return None
async def later(samples, context):
    return samples, {}
LIMIT = 3
"""


@pytest.mark.parametrize("override,key,attr,signature", [
    ("algo.loss={f}:two", "algo.loss", "two", "fn(inputs: PolicyLossInputs) -> tuple[Tensor, Tensor]"),
    ("algo.advantage={f}:two", "algo.advantage", "two", "fn(rewards: Tensor) -> Tensor"),
    ("filters.functions=[{f}:none]", "filters.functions", "none",
     "fn(samples: list[Sample], context: StepContext) -> tuple[list[Sample], dict[str, float]]"),
    ("hooks.on_rollout=[{f}:none]", "hooks.on_rollout", "none", "fn(samples: Sequence[Sample], context: StepContext)"),
    ("hooks.on_step_end=[{f}:none]", "hooks.on_step_end", "none",
     "fn(metrics: Mapping[str, object], context: StepContext)"),
    ("hooks.on_checkpoint=[{f}:none]", "hooks.on_checkpoint", "none",
     "fn(checkpoint: CommittedCheckpoint, context: StepContext) -> None"),
    ("hooks.on_block_end=[{f}:none]", "hooks.on_block_end", "none", "fn(block: BlockInfo, context: StepContext)"),
])
def test_a_plugin_with_a_wrong_signature_is_refused_before_anything_is_written(tmp_path, override, key, attr,
                                                                               signature):
    from milepost.tasks.campaign import prepare_campaign
    (tmp_path / "bad.py").write_text(BAD)
    campaign = tmp_path / "campaign"
    with pytest.raises(PluginError) as err:
        prepare_campaign(load_recipe(TINY, [override.format(f=tmp_path / "bad.py")]), str(campaign))
    message = str(err.value)
    assert message.startswith(f"{key} `{tmp_path / 'bad.py'}:{attr}` must accept (")
    assert f"change its signature to {signature}" in message
    assert not campaign.exists()


@pytest.mark.parametrize("attr,needle", [
    ("later", r"filters.functions `.*:later` is an async or generator function.*make it a plain `def fn\(samples"),
    ("LIMIT", r"filters.functions `.*:LIMIT` is a int, not callable; name a function fn\(samples"),
    ("nope", r"`.*bad.py` has no attribute `nope`; its functions: later, none, two"),
])
def test_a_filter_that_is_no_function_is_refused(tmp_path, attr, needle):
    (tmp_path / "bad.py").write_text(BAD)
    with pytest.raises(PluginError, match=needle):
        FILTERS.resolve(f"{tmp_path}/bad.py:{attr}")


def test_an_unknown_name_lists_the_registered_ones_and_the_closest():
    with pytest.raises(PluginError, match=r"algo.loss `pp0` is not a registered name \(gspo, ppo\) "
                                          r"\(did you mean `ppo`\?\) nor an import path"):
        POLICY_LOSSES.resolve("pp0")
    with pytest.raises(PluginError, match=r"filters.functions `zero_variance` is not a registered name "
                                          r"\(zero_variance_groups\)"):
        FILTERS.resolve("zero_variance")


def test_builtins_resolve_by_name_to_themselves_and_defaults_are_unchanged():
    assert FILTERS.resolve("zero_variance_groups") is drop_zero_variance_groups
    assert ADVANTAGE_ESTIMATORS.resolve("grpo") is grpo_advantages
    assert set(POLICY_LOSSES) == {"ppo", "gspo"}
    cfg = load_recipe(TINY)
    assert (cfg.algo.loss, cfg.algo.advantage, cfg.filters.functions) == ("ppo", "grpo", ())
    assert cfg.hooks == HooksConfig()


# --- what a plugin may do at run time -----------------------------------------------------------

def test_a_hook_that_raises_stops_the_run_naming_the_hook(tmp_path):
    (tmp_path / "h.py").write_text("def boom(metrics, context):\n    raise KeyError('loss/typo')\n")
    hooks = Hooks.from_config(HooksConfig(on_step_end=(f"{tmp_path}/h.py:boom",)))
    with pytest.raises(HookError, match=r"hooks.on_step_end `.*h.py:boom` raised KeyError: 'loss/typo'; fix the hook"):
        hooks.step_end({"step": 1}, CONTEXT)


def test_a_hook_cannot_change_the_row_or_the_context(tmp_path):
    (tmp_path / "h.py").write_text("def edit(metrics, context):\n    metrics['step'] = 99\n")
    hooks = Hooks.from_config(HooksConfig(on_step_end=(f"{tmp_path}/h.py:edit",)))
    row = {"step": 1}
    with pytest.raises(HookError, match="does not support item assignment"):
        hooks.step_end(row, CONTEXT)
    assert row == {"step": 1}
    with pytest.raises(AttributeError):
        CONTEXT.step = 5  # type: ignore[misc]


def test_a_filter_that_returns_samples_it_was_not_given_is_refused(tmp_path):
    (tmp_path / "f.py").write_text("import copy\ndef clone(samples, context):\n"
                                   "    return [copy.copy(s) for s in samples], {}\n")
    chain = FilterChain.from_config(FilterConfig(functions=(f"{tmp_path}/f.py:clone",)))
    with pytest.raises(FilterError, match=r"filters.functions `.*f.py:clone` returned samples it was not given"):
        chain([_sample(0, 1.0), _sample(0, 0.0)], CONTEXT)


def test_a_loss_with_the_wrong_output_shape_names_the_loss(tmp_path):
    (tmp_path / "l.py").write_text("def mean(inputs):\n    return inputs.logprobs.mean(), inputs.mask\n")
    z = torch.zeros(2, 3)
    with pytest.raises(PluginError, match=r"algo.loss `.*l.py:mean` returned shapes \(\) and \(2, 3\)"):
        rl_loss(z, z, z, z, torch.ones(2, 3), AlgoConfig(loss=f"{tmp_path}/l.py:mean"), 6.0)


def test_the_trainer_ranks_get_the_loss_file_as_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert trainer_algo(AlgoConfig(loss="mine/l.py:f")).loss == f"{tmp_path}/mine/l.py:f"
    assert trainer_algo(AlgoConfig()).loss == "ppo"
    assert portable_spec("my_pkg.losses:f") == "my_pkg.losses:f"
    assert portable_spec("/abs/l.py:f") == "/abs/l.py:f"


def test_a_file_with_plugins_of_several_kinds_is_loaded_once(tmp_path):
    (tmp_path / "p.py").write_text("LOADS = []\nLOADS.append(1)\n"
                                   "def adv(rewards):\n    return rewards\n"
                                   "def filt(samples, context):\n    return samples, {'loads': float(len(LOADS))}\n")
    ADVANTAGE_ESTIMATORS.resolve(f"{tmp_path}/p.py:adv")
    _, metrics = FILTERS.resolve(f"{tmp_path}/p.py:filt")([], CONTEXT)
    assert metrics == {"loads": 1.0}
