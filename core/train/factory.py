"""Chooses the train backend named by the recipe (train.backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from milepost.core.config import AlgoConfig, TrainConfig
from milepost.core.quant.modes import sent_weight_format
from milepost.core.train.backend import TrainBackend

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


def create_backend(model_path: str, train_cfg: TrainConfig, algo_cfg: AlgoConfig, temperature: float, seed: int,
                   total_steps: int | None = None, placement_group: PlacementGroup | None = None,
                   precision: str = "fp32", rank_gpus: list[float] | None = None,
                   rollout_precision: str = "fp32") -> TrainBackend:
    """A started TrainBackend: TorchBackend for "torch", MegatronBackend for "megatron".
    `placement_group` (core/placement.py) places the ranks on their bundles, each asking
    `rank_gpus[r]` GPUs of it (Placement.rank_gpus; the torch backend trains on CPU);
    `precision` is precision.train (core/train/precision.py); `rollout_precision`,
    precision.rollout, sets what weight sync sends (modes.sent_weight_format)."""
    weight_format = sent_weight_format(rollout_precision)
    if train_cfg.backend == "megatron":
        from milepost.core.train.megatron.backend import MegatronBackend
        return MegatronBackend.create(model_path, train_cfg, algo_cfg, temperature, seed, total_steps,
                                      placement_group=placement_group, precision=precision, rank_gpus=rank_gpus,
                                      weight_format=weight_format)
    if train_cfg.backend == "torch":
        from milepost.core.train.torch_backend import TorchBackend
        return TorchBackend.create(model_path, train_cfg, algo_cfg, temperature, seed, total_steps,
                                   placement_group=placement_group, precision=precision,
                                   weight_format=weight_format)
    raise ValueError(f"train.backend={train_cfg.backend!r} is unknown; use torch or megatron")
