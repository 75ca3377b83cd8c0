"""The megatron backend's rank worker on one GPU (NCCL, world size 1), against the HF model.

Run through the device tool: `python -m pytest -q -m gpu tests/gpu/test_megatron_gpu.py`.
One worker per process (megatron's parallel state is global), so everything is one test.
"""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch

pytestmark = pytest.mark.gpu

VOCAB = 1000


def make_samples(n: int, seed: int) -> list:
    from milepost.core.types import Sample
    rng = random.Random(seed)
    out = []
    for i in range(n):
        resp = [rng.randrange(2, VOCAB) for _ in range(rng.randint(4, 40))]
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 30))]
        out.append(Sample(prompt_index=i, group_index=i // 2, prompt_ids=prompt, response_ids=resp,
                          engine_logprobs=[-6.9] * len(resp), loss_mask=[1] * len(resp), finish_reason="stop",
                          weight_version="0", label="", advantage=rng.uniform(-1, 1)))
    return out


def tiny_qwen3(folder, num_layers: int) -> None:
    """A random fp32 Qwen3 saved to `folder`, the worker importable without Ray (the GPU test
    machine may lack it; the worker itself does not need it)."""
    if "ray" not in sys.modules:
        try:
            import ray  # noqa: F401
        except ImportError:
            sys.modules["ray"] = types.ModuleType("ray")
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=num_layers, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=32, intermediate_size=512, tie_word_embeddings=False,
                      pad_token_id=0, eos_token_id=1, bos_token_id=1)
    Qwen3ForCausalLM(cfg).float().save_pretrained(folder)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_worker_on_gpu_matches_hf_and_round_trips(tmp_path):
    model_dir = tmp_path / "model"
    tiny_qwen3(model_dir, num_layers=3)
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    from milepost.core.algo.losses import rl_loss
    from milepost.core.config import AlgoConfig, TrainConfig
    from milepost.core.train.batch import collate
    from milepost.core.train.logprobs import response_logprobs_and_entropy
    from milepost.core.train.megatron.converter import write_index
    from milepost.core.train.megatron.worker import MegatronRankWorker

    hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    samples = make_samples(6, seed=1)
    algo = AlgoConfig()
    normalizer = float(sum(len(s.response_ids) for s in samples))
    batch = {k: v.cuda() for k, v in collate(samples, 0).items()}
    lp, ent = response_logprobs_and_entropy(hf, batch, 1.0)
    loss, _ = rl_loss(lp, lp.detach(), batch["engine_logprobs"], batch["advantages"], batch["loss_mask"], algo,
                      normalizer, entropy=ent.detach())
    loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1e9).item()
    # the reference update: clip to train.grad_clip (1.0), then torch AdamW (megatron's Adam, made fused on GPU)
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).step()
    stepped = {k: v.detach().cpu() for k, v in hf.state_dict().items()}

    train = TrainConfig(backend="megatron", num_ranks=1, micro_batch_size=2, lr=1e-4, grad_clip=1.0,
                        megatron={"pack_sequences": True, "micro_batch_tokens": 64})
    w = MegatronRankWorker(0, 1, str(model_dir), train, algo, temperature=1.0, seed=0, total_steps=None)
    w.setup(w.free_port())
    try:
        got = w.logprobs(samples)
        for i, row in enumerate(got):
            n = len(samples[i].response_ids)
            assert max(abs(a - b) for a, b in zip(row, lp[i, :n].tolist())) < 1e-4
        result = w.train(samples, normalizer)
        assert result["metrics"]["train/loss"] == pytest.approx(loss.item(), abs=1e-5)
        assert result["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
        export = tmp_path / "export"
        export.mkdir()
        write_index(str(export), w.export_shards(str(export), 2**30))
        exported = load_file(str(export / "model.safetensors"))
        trained = w.hf_state_dict()
        assert set(exported) == set(load_file(str(model_dir / "model.safetensors")))
        assert all(torch.equal(exported[k], trained[k]) for k in trained)
        # Adam's first update is lr * g / (|g| + eps): an element with |g| near eps moves by a
        # rounding-dependent fraction of lr (seen: 1.3e-5 of 1e-4 for one element), so every
        # element within lr and the bulk within 1e-6; a wrong update moves whole tensors by ~lr
        diffs = torch.cat([(trained[k] - stepped[k]).abs().flatten() for k in trained])
        close = (diffs < 1e-6).float().mean()
        assert diffs.max() < 1e-4 and close > 0.999, (diffs.max(), close)
    finally:
        w.shutdown()
