"""A NaN/inf loss or gradient skips the optimizer step, is logged, and is never checkpointed
(issue 16), on both train backends with a real tiny model on CPU (Ray + gloo, 2 ranks).

The non-finite values come in through the real API: rewards of inf turned into advantages by
the loop's `assign_advantages` (GRPO: NaN advantages for that group, on rank 1's shard only),
or a sample whose advantage is inf (rank 0's shard only). Whether the skipped step left the
optimizer state and schedule exactly as they were is checked by behaviour: the next good
step after the skip gives bitwise the weights of the same good step taken from a checkpoint
saved just before the bad batch.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from tinymodels import random_train_samples, save_tiny_qwen2

from milepost.core.checkpoint import CheckpointManager, CheckpointSaveError
from milepost.core.config import AlgoConfig, TrainConfig
from milepost.core.loop import assign_advantages
from milepost.core.train.factory import create_backend
from milepost.core.train.nonfinite import SKIPPED_METRIC, NonFiniteWeightsError

VOCAB = 32


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), seed=0, vocab=VOCAB, tie_embeddings=True)


def train_cfg(kind: str) -> TrainConfig:
    if kind == "torch":
        return TrainConfig(num_ranks=2, micro_batch_size=2, lr=1e-2, lr_schedule="linear", warmup_steps=1)
    return TrainConfig(backend="megatron", num_ranks=2, micro_batch_size=2, lr=1e-2, lr_schedule="linear",
                       warmup_steps=1, megatron={"micro_batch_tokens": 40})  # TP 1: 2 data-parallel ranks


def inf_rewards_on_rank1() -> list:
    samples = random_train_samples(8, seed=3, vocab=VOCAB)  # ranks get samples 0-3 and 4-7
    for s in samples:
        if s.group_index == 2:  # samples 6 and 7
            s.reward = math.inf
    assign_advantages(samples, "grpo")
    assert [math.isnan(s.advantage) for s in samples] == [False] * 6 + [True] * 2
    return samples


def inf_advantage_on_rank0() -> list:
    samples = random_train_samples(8, seed=4, vocab=VOCAB)
    samples[1].advantage = math.inf
    return samples


@pytest.mark.parametrize("kind", ["torch", "megatron"])
def test_a_nonfinite_step_is_skipped_logged_and_changes_nothing(kind, ray_cluster, model_path, tmp_path, caplog):
    backend = create_backend(model_path, train_cfg(kind), AlgoConfig(), 0.7, seed=7, total_steps=10)
    good = random_train_samples(8, seed=5, vocab=VOCAB)
    try:
        first = backend.train_step(random_train_samples(8, seed=1, vocab=VOCAB), step=1)  # Adam has moments now
        assert first[SKIPPED_METRIC] == 0.0
        before = str(tmp_path / "before")
        backend.save_state(before)
        sha_before = backend.weights_sha256()
        for step, bad in enumerate((inf_rewards_on_rank1, inf_advantage_on_rank0), start=2):
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                metrics = backend.train_step(bad(), step=step)
            assert metrics[SKIPPED_METRIC] == 1.0, (bad.__name__, metrics)
            assert not math.isfinite(metrics["train/loss"]) or not math.isfinite(metrics["train/grad_norm"])
            assert f"step {step}: non-finite loss or gradient" in caplog.text and "skipped" in caplog.text
            assert backend.weights_sha256() == sha_before, bad.__name__
        after_skip = backend.train_step(good, step=4)
        assert after_skip[SKIPPED_METRIC] == 0.0 and math.isfinite(after_skip["train/loss"])
        sha_after_skip = backend.weights_sha256()
        assert sha_after_skip != sha_before
        backend.load_state(before)  # the same good step from the state before the bad batches
        assert backend.weights_sha256() == sha_before
        backend.train_step(good, step=4)
        assert backend.weights_sha256() == sha_after_skip  # optimizer state and schedule were untouched
    finally:
        backend.shutdown()


def test_nonfinite_weights_are_never_checkpointed(ray_cluster, model_path, tmp_path):
    """Weights that are non-finite however they got there (here: a model.pt with a NaN, loaded
    through the real resume path) make save refuse before writing; the checkpoint save then
    fails cleanly and `latest` keeps naming the previous checkpoint."""
    backend = create_backend(model_path, train_cfg("torch"), AlgoConfig(), 0.7, seed=7, total_steps=10)
    mgr = CheckpointManager(tmp_path / "checkpoints")
    payload = lambda folder: backend.save_state(str(folder / "trainer"))  # noqa: E731
    try:
        mgr.save(1, {"step": 1}, payload)
        poisoned = tmp_path / "poisoned"
        backend.save_state(str(poisoned))
        weights = torch.load(poisoned / "model.pt", weights_only=True)
        name = sorted(weights)[3]
        weights[name].view(-1)[0] = float("nan")
        torch.save(weights, poisoned / "model.pt")
        backend.load_state(str(poisoned))
        with pytest.raises(NonFiniteWeightsError, match=f"{name} holds NaN/inf"):
            backend.save_state(str(tmp_path / "direct"))
        assert not (tmp_path / "direct" / "model.pt").exists()
        refused = "(?s)checkpoint of step 2 was not saved .*refusing to checkpoint non-finite weights"
        with pytest.raises(CheckpointSaveError, match=refused):
            mgr.save(2, {"step": 2}, payload)
        assert sorted(p.name for p in mgr.root.iterdir()) == ["00000001", "latest"]
        assert (mgr.root / "latest").read_text() == "1" and mgr.latest_valid().step == 1
    finally:
        backend.shutdown()
