"""LoRA on the megatron backend at TP=2 (CPU, gloo) against the torch backend (DDP, 2 ranks):
same base, same adapter initialisation, same samples; after each step, how far apart are the
two adapters, and does a megatron backend restored from its checkpoint step bitwise again?

    python bench/lora_megatron_parity.py [--steps 3]

Prints one JSON line: the initial adapters' digests (equal: same init), per step both losses
and the largest |torch - megatron| adapter element, and the resume check.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import ray
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from tinymodels import random_train_samples, save_tiny_qwen2  # noqa: E402

from milepost.core.config import AlgoConfig, LoraConfig, TrainConfig  # noqa: E402
from milepost.core.train.factory import create_backend  # noqa: E402

VOCAB = 31
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"])


def config(backend: str) -> TrainConfig:
    megatron = {"tensor_parallel": 2, "pack_sequences": False} if backend == "megatron" else {}
    return TrainConfig(backend=backend, num_ranks=2, micro_batch_size=4, lr=1e-2, lora=LORA, megatron=megatron)


def torch_adapter(backend) -> dict[str, torch.Tensor]:
    """Rank 0's adapter, PEFT-named (what the megatron backend's state_dict returns with LoRA)."""
    from milepost.core.train import lora
    return ray.get(backend.actors[0].__ray_call__.remote(
        lambda w: {k: v.clone() for k, v in lora.adapter_state(w.module).items()}))


def largest_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lora-megatron-"))
    base = save_tiny_qwen2(work / "base", 0, vocab=VOCAB, tie_embeddings=True)
    batches = [random_train_samples(12, seed=s, vocab=VOCAB) for s in range(1, a.steps + 2)]
    ray.init(num_cpus=4, include_dashboard=False)
    out: dict[str, object] = {"steps": []}
    try:
        torch_b = create_backend(base, config("torch"), AlgoConfig(), 1.0, seed=5)
        mega = create_backend(base, config("megatron"), AlgoConfig(), 1.0, seed=5)
        out["initial_sha_equal"] = torch_b.weights_sha256() == mega.weights_sha256()
        for step, batch in enumerate(batches[:-1], start=1):
            mt, mm = torch_b.train_step(batch, step), mega.train_step(batch, step)
            out["steps"].append({"step": step, "loss_torch": mt["train/loss"], "loss_megatron": mm["train/loss"],
                                 "grad_norm_torch": mt["train/grad_norm"], "grad_norm_megatron": mm["train/grad_norm"],
                                 "adapter_max_abs_gap": largest_gap(torch_adapter(torch_b), mega.state_dict())})
        mega.save_state(str(work / "ckpt"))
        saved_sha = mega.weights_sha256()
        mega.export_hf(str(work / "export"))
        out["export_files"] = sorted(p.name for p in (work / "export").iterdir())
        last = mega.train_step(batches[-1], a.steps + 1)
        sha = mega.weights_sha256()
        torch_b.shutdown()
        mega.shutdown()
        again = create_backend(base, config("megatron"), AlgoConfig(), 1.0, seed=5)
        again.load_state(str(work / "ckpt"))
        out["loaded_sha_equal"] = again.weights_sha256() == saved_sha
        resumed = again.train_step(batches[-1], a.steps + 1)
        out["resume_bitwise"] = again.weights_sha256() == sha and resumed["train/loss"] == last["train/loss"]
        again.shutdown()
    finally:
        ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
