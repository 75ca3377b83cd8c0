"""The train backend contract the loop talks to; `torch_backend.TorchBackend` and
`megatron.backend.MegatronBackend` implement it."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from milepost.core.types import Sample
from milepost.core.weight_sync.base import WeightSource


@runtime_checkable
class TrainBackend(WeightSource, Protocol):
    """Trains the policy, checkpoints it, and (as a WeightSource) hands its weights to the
    tensor and distributed transports."""

    def train_step(self, samples: list[Sample], step: int) -> dict[str, float]:
        """One optimizer step on this rollout batch. Returns metrics: 'train/loss',
        'train/grad_norm' (before clipping), 'train/lr' (used this step), 'train/num_tokens',
        and rl_loss's 'loss/*' metrics (full-batch token means)."""
        ...

    def save_state(self, path: str) -> None:
        """Model, optimizer, LR scheduler and every rank's RNG states into folder `path`."""
        ...

    def load_state(self, path: str) -> None:
        """Restore exactly what save_state wrote (resumed training is bitwise identical)."""
        ...

    def export_hf(self, path: str) -> None:
        """HF folder (config.json, model.safetensors, tokenizer files of the base model)."""
        ...

    def weights_sha256(self) -> str:
        """sha256 over the policy weights: sorted names, each name then its raw fp32 bytes."""
        ...

    def shutdown(self) -> None:
        """Destroy process groups and release the workers."""
        ...
