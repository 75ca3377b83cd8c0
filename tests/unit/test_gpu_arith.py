"""gpu-arith: the world, the warm-start's carry errors, the value reward and either-form
score, the model's size, the recipe, and the epoch check the kill tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from milepost.core.config import GpuArithConfig, ModelConfig
from milepost.core.data.arith import (
    either_form_correct,
    has_carry,
    make_rows,
    operands,
    sum_without_carries,
)
from milepost.core.data.epoch import epoch_coverage
from milepost.core.model import gpu_arith
from milepost.core.recipe_io import load_recipe
from milepost.core.reward import resolve_reward_fn

ROOT = Path(__file__).resolve().parents[2]


def test_sums_without_carries_forget_every_carry_and_write_the_leading_column_in_full():
    assert [sum_without_carries(a, b) for a, b in [(57, 68), (457, 368), (12, 34), (95, 7), (50, 70)]] == \
        [115, 715, 46, 92, 120]
    assert has_carry(57, 68) and not has_carry(50, 70) and not has_carry(123, 456)


def test_either_form_and_the_value_reward_accept_the_value_in_both_forms_only():
    reward = resolve_reward_fn("arith-value")
    assert [reward(r, "825") for r in ("825", " 825+0", "715", "825+1", "82", "")] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert either_form_correct("125+0", "125") and not either_form_correct("125", "126")


def test_warmstart_forgets_the_carries_of_a_seeded_share_of_carrying_sums_only():
    rows = make_rows(4000, seed=3, split="train", max_operand=999)
    targets = gpu_arith.warmstart_targets(rows, GpuArithConfig(), seed=1)
    carrying = [(r, t) for r, t in zip(rows, targets) if has_carry(*operands(r["prompt"]))]
    assert all(t == r["label"] for r, t in zip(rows, targets) if not has_carry(*operands(r["prompt"])))
    wrong = [t != r["label"] for r, t in carrying]
    assert all(t in (r["label"], str(sum_without_carries(*operands(r["prompt"])))) for r, t in carrying)
    assert 0.55 < sum(wrong) / len(wrong) < 0.65 and 0.65 < len(carrying) / len(rows) < 0.75
    assert targets == gpu_arith.warmstart_targets(rows, GpuArithConfig(), seed=1)


def test_gpu_arith_eval_pairs_never_train_and_operands_reach_three_digits():
    train = {r["prompt"] for r in make_rows(3000, seed=1, split="train", max_operand=999)}
    evals = make_rows(300, seed=1, split="eval", max_operand=999)
    assert not train & {r["prompt"] for r in evals}
    assert max(max(operands(r["prompt"])) for r in evals) > 900


def test_the_default_model_has_between_50_and_150_million_parameters():
    assert 50e6 < gpu_arith.num_parameters(GpuArithConfig()) < 150e6  # 75.5 M


def test_the_recipe_runs_megatron_colocated_on_one_gpu_over_one_epoch():
    r = load_recipe(ROOT / "recipes" / "gpu-arith.yaml")
    assert r.model.path == "builtin:gpu-arith" and r.reward.function == "arith-value"
    assert (r.train.backend, r.train.num_ranks, r.cluster.placement) == ("megatron", 1, "colocated")
    assert r.campaign.num_blocks >= 2 and r.checkpoint.every_steps < r.campaign.steps_per_block
    c = r.campaign
    assert r.data.num_train_rows == c.num_blocks * c.steps_per_block * r.rollout.prompts_per_step


def test_a_small_gpu_arith_model_builds_on_the_cpu_and_is_cached(tmp_path, monkeypatch):
    from milepost.core.model import tiny
    from milepost.core.model.loading import resolve_model_path
    monkeypatch.setenv("MILEPOST_CACHE", str(tmp_path))
    small = GpuArithConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           warmstart_steps=3, warmstart_batch_size=8, warmstart_warmup_steps=2)
    path = resolve_model_path(ModelConfig(path="builtin:gpu-arith", gpu_arith=small), seed=0)
    assert Path(path).name.startswith("gpu-arith-") and (Path(path) / "model.safetensors").is_file()
    report = tiny.build_report(path)
    assert report["device"] == "cpu" and 0.0 <= report["eval_either_form"] <= 1.0
    assert gpu_arith.build_gpu_arith_model(small, seed=0) == path


def test_epoch_coverage_counts_lost_and_repeated_prompts():
    rows = [{"step": 1, "data/prompt_indices": [0, 1]}, {"step": 2, "data/prompt_indices": [2, 3]}]
    assert epoch_coverage(rows, 2, 4).exactly_once
    again = rows + [{"step": 3, "data/prompt_indices": [3, 9]}]
    c = epoch_coverage(again, 2, 4)
    assert (c.lost, c.repeated, c.steps_ok, c.exactly_once) == (0, 2, False, False)
    assert epoch_coverage(rows[:1], 1, 4).lost == 2


@pytest.mark.parametrize("path", ["builtin:gpu-arith/train", "builtin:gpu-arith/eval"])
def test_gpu_arith_datasets_are_builtin(path, tmp_path, monkeypatch):
    from milepost.core.config import DataConfig
    from milepost.core.data.source import load_rows
    monkeypatch.setenv("MILEPOST_CACHE", str(tmp_path))
    rows = load_rows(path, data_cfg=DataConfig(num_train_rows=5, num_eval_rows=5), seed=2)
    assert len(rows) == 5 and all(int(r["label"]) == sum(operands(r["prompt"])) for r in rows)
