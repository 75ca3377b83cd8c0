"""precision.train int4_qat in the megatron backend on CPU (Ray + gloo + megatron-core): its
steps are the torch backend's int4_qat steps, at TP=1 and TP=2 (megatron fuses q/k/v and
gate/up rows and splits rows or input features over ranks; fake quantisation is per row, in
groups of 128 input features, so neither changes the weight a matmul uses), and a tensor
parallel split that would cut those groups is refused naming the layer.
tests/integration/test_int4_serving.py checks the served side (engine weights bit for bit)."""

from __future__ import annotations

import pytest
import torch
from tinymodels import random_train_samples, save_tiny_qwen2

from milepost.core.config import AlgoConfig, TrainConfig
from milepost.core.train.factory import create_backend

VOCAB, LR = 31, 1e-3
S1, S2 = random_train_samples(10, 1, VOCAB), random_train_samples(9, 2, VOCAB)
MAX_ATOL = LR / 10  # Adam's first update of a near-eps gradient (test_megatron_backend.py's reason)


def _steps(path: str, cfg: TrainConfig, precision: str = "int4_qat") -> dict:
    backend = create_backend(path, cfg, AlgoConfig(), 1.0, seed=7, total_steps=10, precision=precision)
    try:
        first = backend.train_step(S1, step=1)
        weights = backend.state_dict()
        second = backend.train_step(S2, step=2)
        return {"step1": first, "w1": weights, "step2": second}
    finally:
        backend.shutdown()


def _megatron(tp: int) -> TrainConfig:
    return TrainConfig(backend="megatron", num_ranks=tp, micro_batch_size=3, lr=LR,
                       megatron={"tensor_parallel": tp, "micro_batch_tokens": 40})


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory) -> dict:
    # hidden 256, intermediate 512: each TP=2 rank of a row-parallel layer holds whole groups of 128
    path = save_tiny_qwen2(tmp_path_factory.mktemp("qwen2_256"), seed=0, vocab=VOCAB, tie_embeddings=True,
                           hidden=256, intermediate=512)
    out = {"torch": _steps(path, TrainConfig(num_ranks=1, micro_batch_size=4, lr=LR))}
    for tp in (1, 2):
        out[f"megatron_tp{tp}"] = _steps(path, _megatron(tp))
    out["megatron_fp32"] = _steps(path, _megatron(1), precision="fp32")
    return out


@pytest.mark.parametrize("name", ["megatron_tp1", "megatron_tp2"])
def test_megatron_int4_qat_steps_are_the_torch_backends(runs, name: str) -> None:
    ref, got = runs["torch"], runs[name]
    assert got["step1"]["train/loss"] == pytest.approx(ref["step1"]["train/loss"], abs=1e-6)
    assert got["step1"]["train/grad_norm"] == pytest.approx(ref["step1"]["train/grad_norm"], rel=1e-5)
    for key in ("loss/policy", "loss/entropy"):
        assert got["step1"][key] == pytest.approx(ref["step1"][key], rel=1e-5, abs=1e-6), key
    worst = max((got["w1"][k] - ref["w1"][k]).abs().max().item() for k in ref["w1"])
    assert worst <= MAX_ATOL, worst
    # after a step the weights differ in their last bits, which may move an element across a
    # rounding boundary of its int4 group: the second step agrees closely, not exactly
    assert got["step2"]["train/loss"] == pytest.approx(ref["step2"]["train/loss"], rel=1e-4, abs=1e-5)


def test_the_fake_quantisation_is_really_in_the_megatron_forward(runs) -> None:
    int4, fp32 = runs["megatron_tp1"]["step1"], runs["megatron_fp32"]["step1"]
    assert abs(int4["train/loss"] - fp32["train/loss"]) > 1e-4, (int4["train/loss"], fp32["train/loss"])
    assert torch.isfinite(torch.tensor(int4["train/grad_norm"]))


def test_a_tensor_parallel_split_that_cuts_int4_groups_is_refused_naming_the_layer(ray_cluster, tmp_path) -> None:
    path = save_tiny_qwen2(tmp_path / "qwen2_64", seed=0, vocab=VOCAB, tie_embeddings=True)  # hidden 64
    with pytest.raises(Exception, match=r"linear_proj splits its 64 input features over tensor_parallel 2 \(32 a "
                                        r"rank\), which cuts int4 groups of 128"):
        create_backend(path, _megatron(2), AlgoConfig(), 1.0, seed=7, precision="int4_qat")
