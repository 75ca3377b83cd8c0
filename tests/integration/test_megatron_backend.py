"""MegatronBackend on real Ray + gloo + megatron-core (CPU): parity with the torch backend,
TP=2 == TP=1, HF -> megatron -> HF bit-exact, and dist_checkpointing resume across TP sizes.

One sequence of backends (each costs ~20 s to start on 2 cores) feeds every test:
  torch (1 rank)        step 1 on batch s1                          -> reference loss / grad norm / weights
  megatron TP=1 (1 rk)  logprobs, export, step 1 (s1), save ckpt1, step 2 (s2)
  megatron TP=2 (2 rk)  logprobs, export, step 1 (s1), save ckpt2, step 2 (s2)
  megatron TP=1         load ckpt2 (written at TP=2), step 2 (s2)
  megatron TP=2         load ckpt1 (written at TP=1), step 2 (s2)
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tinymodels import random_train_samples, save_tiny_qwen2

from milepost.core.config import AlgoConfig, TrainConfig
from milepost.core.model.loading import load_causal_lm
from milepost.core.quant.fp8 import FP8_DTYPE, quantize_fp8_blockwise, scale_name, served_in_fp8
from milepost.core.train.backend import TrainBackend
from milepost.core.train.batch import collate
from milepost.core.train.factory import create_backend
from milepost.core.train.logprobs import response_logprobs
from milepost.core.types import Sample

VOCAB = 31  # padded to 128 inside megatron: export must drop the padding
TEMPERATURE = 0.7
LR = 1e-3
# Comparing weights after Adam steps: Adam's first update is lr * g / (|g| + eps), so an
# element whose gradient is near eps (1e-8) moves by a fraction of lr that rounding noise in g
# changes (measured: 1-2 elements of 4096 differ by up to 1.8e-5 between backends / TP sizes /
# micro-batch layouts). A lost optimizer state or a wrong shard moves whole tensors by ~lr
# (measured 1.7e-3 when Adam's moments were not restored). So: every element within lr / 10,
# and 99.9 % of the elements within 1e-6.
MAX_ATOL, BULK_ATOL, BULK_FRACTION = LR / 10, 1e-6, 0.999


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), seed=0, vocab=VOCAB, tie_embeddings=True)


def make_samples(n: int, seed: int) -> list[Sample]:
    return random_train_samples(n, seed, VOCAB)


S1, S2 = make_samples(10, seed=1), make_samples(9, seed=2)


def megatron_cfg(tp: int, pack: bool = True) -> TrainConfig:
    return TrainConfig(backend="megatron", num_ranks=tp, micro_batch_size=3, lr=LR, lr_schedule="linear",
                       warmup_steps=1, megatron={"tensor_parallel": tp, "pack_sequences": pack,
                                                 "micro_batch_tokens": 40})


def create(path: str, cfg: TrainConfig):
    return create_backend(path, cfg, AlgoConfig(), TEMPERATURE, seed=7, total_steps=10)


def read_shm_buckets(backend) -> dict:
    """Every tensor the `tensor` weight transport would send, read back from its /dev/shm
    buckets (small buckets, so tensors of one megatron tensor land in different buckets)."""
    import os

    from milepost.core.weight_sync import wire
    got = {}
    for i, bucket in enumerate(backend.weight_buckets(0.02)):
        desc = wire.decode_shm_descriptor(backend.named_tensors_to_shm([s["name"] for s in bucket], i, 0))
        fd = os.open(wire.shm_path(desc["shm_name"]), os.O_RDWR)
        try:
            buf = wire.map_fd(fd)
            got.update({t["name"]: wire.view(buf, t["offset"], t).clone() for t in desc["tensors"]})
        finally:
            os.close(fd)
    backend.release_weight_buffers()
    return got


@pytest.fixture(scope="module")
def runs(ray_cluster, model_path, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("megatron_runs")
    out: dict = {}
    torch_backend = create(model_path, TrainConfig(num_ranks=1, micro_batch_size=4, lr=LR, lr_schedule="linear",
                                                   warmup_steps=1))
    try:
        out["torch_sha0"] = torch_backend.weights_sha256()
        out["torch_step1"] = torch_backend.train_step(S1, step=1)
        out["torch_w1"] = torch_backend.state_dict()
    finally:
        torch_backend.shutdown()
    # TP=1 packs sequences, TP=2 pads rows: the two micro-batch layouts must agree too
    for tp, pack in ((1, True), (2, False)):
        b = create(model_path, megatron_cfg(tp, pack))
        try:
            assert isinstance(b, TrainBackend)
            out[f"tp{tp}_sha0"] = b.weights_sha256()
            out[f"tp{tp}_logprobs"] = b.logprobs(S1)
            b.export_hf(str(tmp / f"export_tp{tp}"))
            out[f"tp{tp}_export"] = str(tmp / f"export_tp{tp}")
            out[f"tp{tp}_step1"] = b.train_step(S1, step=1)
            out[f"tp{tp}_w1"] = b.state_dict()
            out[f"tp{tp}_shm_w1"] = read_shm_buckets(b)
            b.save_state(str(tmp / f"ckpt_tp{tp}"))
            out[f"tp{tp}_step2"] = b.train_step(S2, step=2)
            out[f"tp{tp}_w2"] = b.state_dict()
            if tp == 1:  # the staged views and the kept q/k/v tensors, read again after a step
                out["tp1_shm_w2"] = read_shm_buckets(b)
        finally:
            b.shutdown()
    b = create_backend(model_path, megatron_cfg(2, False), AlgoConfig(), TEMPERATURE, seed=7, total_steps=10,
                       rollout_precision="fp8")
    try:  # precision.rollout fp8: the gathered HF tensors, block-quantised on sync
        out["tp2_fp8_shm_w0"] = read_shm_buckets(b)
    finally:
        b.shutdown()
    b = create(model_path, TrainConfig(backend="megatron", num_ranks=2, micro_batch_size=3, lr=LR, lr_schedule="linear",
                                       warmup_steps=1, megatron={"pipeline_parallel": 2, "micro_batch_tokens": 40}))
    try:  # two pipeline stages: the schedule's p2p path, the tied embedding on both ends, export per stage
        out["pp2_sha0"] = b.weights_sha256()
        out["pp2_step1"] = b.train_step(S1, step=1)
        out["pp2_w1"] = b.state_dict()
        b.export_hf(str(tmp / "export_pp2"))
        out["pp2_export"] = str(tmp / "export_pp2")
    finally:
        b.shutdown()
    for tp, ckpt_tp in ((1, 2), (2, 1)):
        b = create(model_path, megatron_cfg(tp))
        try:
            b.load_state(str(tmp / f"ckpt_tp{ckpt_tp}"))
            out[f"resume_tp{ckpt_tp}_at_tp{tp}_step2"] = b.train_step(S2, step=2)
            out[f"resume_tp{ckpt_tp}_at_tp{tp}_w2"] = b.state_dict()
        finally:
            b.shutdown()
    return out


def assert_weights_close(a: dict, b: dict) -> None:
    """See MAX_ATOL (the bulk fraction is over all elements together). k_proj biases are
    skipped: their gradient is exactly zero in exact arithmetic (a constant added to every
    key shifts all scores of a query equally), so every element of them is the near-eps case."""
    assert set(a) == set(b)
    total = off = 0
    for name in a:
        if name.endswith("k_proj.bias"):
            continue
        diff = (a[name] - b[name]).abs()
        assert diff.max().item() <= MAX_ATOL, (name, diff.max().item())
        total, off = total + diff.numel(), off + int((diff > BULK_ATOL).sum())
    assert off <= (1 - BULK_FRACTION) * total, f"{off} of {total} weights differ by more than {BULK_ATOL}"


def test_logprobs_match_hf_model(runs, model_path):
    hf = load_causal_lm(model_path).eval()
    with torch.no_grad():
        batch = collate(S1, pad_id=0)
        ref = response_logprobs(hf, batch, TEMPERATURE)
    for tp in (1, 2):
        got = runs[f"tp{tp}_logprobs"]
        assert [len(r) for r in got] == [len(s.response_ids) for s in S1]
        for i, row in enumerate(got):
            diff = (torch.tensor(row) - ref[i, :len(row)]).abs().max().item()
            assert diff < 1e-5, (tp, i, diff)


def test_first_step_matches_torch_backend(runs, model_path):
    ref = runs["torch_step1"]
    initial = load_causal_lm(model_path).state_dict()
    assert max((runs["torch_w1"][k] - initial[k]).abs().max().item() for k in initial) > 5e-4  # a real step
    for tp in (1, 2):
        got = runs[f"tp{tp}_step1"]
        assert got["train/num_tokens"] == ref["train/num_tokens"]
        assert got["train/loss"] == pytest.approx(ref["train/loss"], abs=1e-6)
        assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-5)
        for key in ("loss/policy", "loss/entropy", "loss/tis_mean", "train/lr"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
        assert_weights_close(runs[f"tp{tp}_w1"], runs["torch_w1"])


def test_a_step_reports_its_train_time_split_by_phase(runs):
    for tp in (1, 2):
        got = runs[f"tp{tp}_step1"]
        phases = [got[f"timing/train_{p}_s"] for p in ("batch", "forward_backward", "optimizer")]
        assert all(p >= 0.0 for p in phases) and phases[1] > 0.0, got


def test_tp2_equals_tp1_over_two_steps(runs):
    for step in (1, 2):
        a, b = runs[f"tp1_step{step}"], runs[f"tp2_step{step}"]
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-6)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
        assert_weights_close(runs[f"tp2_w{step}"], runs[f"tp1_w{step}"])


def test_weights_sha256_is_the_torch_backends(runs):
    """Same weights, same digest (HF names, the tied lm_head included), so checkpoints
    record comparable model_sha256 whichever backend trained."""
    assert runs["tp1_sha0"] == runs["tp2_sha0"] == runs["pp2_sha0"] == runs["torch_sha0"]


def test_pipeline_parallel_2_matches_torch_backend(runs):
    got, ref = runs["pp2_step1"], runs["torch_step1"]
    assert got["train/loss"] == pytest.approx(ref["train/loss"], abs=1e-6)
    assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-5)
    assert_weights_close(runs["pp2_w1"], runs["torch_w1"])
    exported = load_causal_lm(runs["pp2_export"]).state_dict()  # two stage files + index
    for name, t in runs["pp2_w1"].items():
        assert torch.equal(exported[name], t), name


def test_hf_megatron_hf_round_trip_is_bit_exact(runs, model_path):
    source = load_file(f"{model_path}/model.safetensors")
    for tp in (1, 2):
        exported = load_file(f"{runs[f'tp{tp}_export']}/model.safetensors")
        assert set(exported) == set(source)
        for name, t in source.items():
            assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), (tp, name)
        assert load_causal_lm(runs[f"tp{tp}_export"]) is not None  # a loadable HF folder


@pytest.mark.parametrize("tp,step", [(2, 1), (1, 1), (1, 2)])
def test_tensor_weight_sync_sends_gathered_hf_tensors(runs, tp, step):
    """TP=2: each bucket's tensors are gathered across the TP ranks and sent under HF names;
    the tied lm_head travels once, as the embedding (as the torch backend sends it). TP=1
    stages views of the parameters and q/k/v in the last push's tensors: a push after another
    step sends that step's weights, not the last push's."""
    sent, trained = runs[f"tp{tp}_shm_w{step}"], runs[f"tp{tp}_w{step}"]
    assert set(sent) == set(trained) - {"lm_head.weight"}
    for name, t in sent.items():
        assert torch.equal(t, trained[name]), name
    if step == 2:
        assert any(not torch.equal(sent[n], runs["tp1_shm_w1"][n]) for n in sent if "q_proj" in n)


def test_fp8_rollout_sends_the_gathered_tensors_block_quantised(runs, model_path):
    """TP=2 with precision.rollout fp8: every tensor the fp8 engine holds, the decoder Linears
    as e4m3 values and 128 x 128 scales quantised from the gathered weights, the rest as they are."""
    source, sent = load_file(f"{model_path}/model.safetensors"), runs["tp2_fp8_shm_w0"]
    picked = [n for n, t in source.items() if served_in_fp8(n, t.shape)]
    assert picked and set(sent) == (set(source) - {"lm_head.weight"}) | {scale_name(n) for n in picked}
    for name, t in source.items():
        if name in picked:
            q, scale = quantize_fp8_blockwise(t)
            assert sent[name].dtype == FP8_DTYPE and torch.equal(sent[name].float(), q.float()), name
            assert torch.equal(sent[scale_name(name)], scale), name
        elif name != "lm_head.weight":
            assert torch.equal(sent[name], t), name


@pytest.mark.parametrize("ckpt_tp,tp", [(2, 1), (1, 2)])
def test_dist_checkpoint_resumes_at_other_tp(runs, ckpt_tp, tp):
    resumed = runs[f"resume_tp{ckpt_tp}_at_tp{tp}_step2"]
    uninterrupted = runs[f"tp{ckpt_tp}_step2"]
    assert resumed["train/lr"] == uninterrupted["train/lr"]  # the LR schedule position was restored
    assert resumed["train/loss"] == pytest.approx(uninterrupted["train/loss"], abs=1e-6)
    assert resumed["train/grad_norm"] == pytest.approx(uninterrupted["train/grad_norm"], rel=1e-5)
    # the optimizer moments were restored too: a fresh Adam would move weights by ~lr, not ~1e-6
    assert_weights_close(runs[f"resume_tp{ckpt_tp}_at_tp{tp}_w2"], runs[f"tp{ckpt_tp}_w2"])
    w1, w2 = runs[f"tp{ckpt_tp}_w1"], runs[f"tp{ckpt_tp}_w2"]
    assert max((w2[k] - w1[k]).abs().max().item() for k in w1) > 10 * BULK_ATOL  # step 2 moved weights
