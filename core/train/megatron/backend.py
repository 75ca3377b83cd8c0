"""Megatron-core train backend: one Ray actor per rank (`worker.MegatronRankWorker`).

Layout: world = train.num_ranks = data_parallel * tensor_parallel * pipeline_parallel *
context_parallel. The driver shards each step's samples by data-parallel rank (consecutive,
balanced: `batch.shard_by_rank`); the TP / PP / CP peers of a replica get the same shard.
Loss metrics come from one rank per replica (TP rank 0 of the last pipeline stage) and are
summed over replicas, as the torch backend sums over its ranks.

Checkpoint folder (save_state): dist/ (megatron `dist_checkpointing`: model + optimizer,
resharded on load, so a TP=2 checkpoint resumes at TP=1 and back), scheduler.json,
rng_rank{r}.pt, meta.json. Export: HF safetensors written by the TP-rank-0 of each pipeline
stage, tensor by tensor, then one index (or a single model.safetensors).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import ray
import torch

from milepost.core.algo import routing_replay
from milepost.core.config import AlgoConfig, TrainConfig
from milepost.core.train.batch import count_loss_tokens, shard_by_rank
from milepost.core.train.megatron.converter import write_index
from milepost.core.train.megatron.worker import MegatronRankWorker
from milepost.core.train.nonfinite import SKIPPED_METRIC, NonFiniteWeightsError
from milepost.core.train.torch_backend import (
    RANK_NUM_CPUS,
    TOKENIZER_FILES,
    engine_gap_mean,
    log_skipped_step,
    state_sha256,
)
from milepost.core.train.weight_source import Rank0WeightSource
from milepost.core.types import Sample

log = logging.getLogger(__name__)
MAX_SHARD_BYTES = 5 * 2**30
HF_SIDE_FILES = ("config.json",) + TOKENIZER_FILES


class MegatronBackend(Rank0WeightSource):
    """Driver side of the megatron backend (a TrainBackend and a WeightSource)."""

    def __init__(self, actors: list[Any], infos: list[dict[str, int]], train_cfg: TrainConfig, model_path: str) -> None:
        self.actors, self.infos, self.train_cfg, self.model_path = actors, infos, train_cfg, model_path
        # Read now: the start folder may be an older checkpoint that is pruned while we train.
        self.side_files = {name: (Path(model_path) / name).read_bytes() for name in HF_SIDE_FILES
                           if (Path(model_path) / name).is_file()}
        m = train_cfg.megatron
        self.dp_size = train_cfg.num_ranks // (m.tensor_parallel * m.pipeline_parallel * m.context_parallel)

    @classmethod
    def create(cls, model_path: str, train_cfg: TrainConfig, algo_cfg: AlgoConfig, temperature: float,
               seed: int, total_steps: int | None = None, placement_group: Any = None,
               precision: str = "fp32", rank_gpus: list[float] | None = None,
               weight_format: str | None = None) -> MegatronBackend:
        """`placement_group` (core/placement.py): rank r runs on its bundle r (CPU bundles:
        those ranks ask for no GPU); without one, a rank takes a GPU when the cluster has one each.
        `precision`: precision.train; `weight_format`: what weight sync sends (WeightSender)."""
        from milepost.core.placement import actor_strategy
        world = train_cfg.num_ranks
        gpus = 1 if placement_group is None and ray.cluster_resources().get("GPU", 0) >= world else 0
        actor_cls = ray.remote(num_cpus=RANK_NUM_CPUS, num_gpus=gpus)(MegatronRankWorker)

        def gpus_of(r: int) -> dict[str, float]:  # Placement.rank_gpus: a share of a bundle's GPU
            return {"num_gpus": rank_gpus[r]} if placement_group is not None and rank_gpus else {}

        actors: list[Any] = [actor_cls.options(**actor_strategy(placement_group, r), **gpus_of(r)).remote(
                      r, world, model_path, train_cfg, algo_cfg, temperature, seed, total_steps, precision,
                      weight_format=weight_format)
                  for r in range(world)]
        backend = cls(actors, [], train_cfg, model_path)
        try:
            port = ray.get(actors[0].free_port.remote())
            backend.infos = ray.get([a.setup.remote(port) for a in actors])
            log.info("megatron: %d rank(s) on %s; packed attention: %s", world,
                     sorted({i["device"] for i in backend.infos}),
                     ", ".join(sorted({str(i.get("packed_attention", "?")) for i in backend.infos})))
        except Exception:
            backend.shutdown()
            raise
        return backend

    # ---- TrainBackend ----
    def train_step(self, samples: list[Sample], step: int) -> dict[str, float]:
        shards = shard_by_rank(samples, self.dp_size)
        num_tokens = count_loss_tokens(samples)
        normalizer = float(max(1, num_tokens))
        results = ray.get([a.train.remote(shards[info["dp_rank"]], normalizer)
                           for a, info in zip(self.actors, self.infos)])
        reported = [r["metrics"] for r in results if r["reporter"]]
        keys = {k for m in reported for k in m}
        metrics = {k: (max if k.endswith("_max") else sum)(m[k] for m in reported if k in m) for k in keys}
        metrics["train/grad_norm"] = results[0]["grad_norm"]  # the global norm, equal on every rank
        metrics["train/lr"] = results[0]["lr"]
        metrics[SKIPPED_METRIC] = results[0]["skipped_nonfinite"]  # agreed by every rank
        if metrics[SKIPPED_METRIC]:
            log_skipped_step(step, metrics)
        metrics = engine_gap_mean(metrics, num_tokens)
        metrics = routing_replay.finish_metrics(metrics)  # MoE: agreement, gaps with / without replay
        metrics["train/num_tokens"] = float(num_tokens)
        metrics["train/num_micro_batches"] = float(max(r["num_micro_batches"] for r in results))
        for phase in ("batch", "forward_backward", "optimizer"):  # the slowest rank's, each synced on its device
            metrics[f"timing/train_{phase}_s"] = max(r["phases_s"][phase] for r in results)
        metrics["train/step"] = float(step)
        return metrics

    def save_state(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        try:
            ray.get([a.save.remote(path) for a in self.actors])
        except NonFiniteWeightsError as e:  # the rank's own error, without Ray's wrapping
            raise getattr(e, "cause", e) from None
        m = self.train_cfg.megatron
        meta = {"format": "milepost-megatron-dist-v1", "world_size": len(self.actors),
                "tensor_parallel": m.tensor_parallel, "pipeline_parallel": m.pipeline_parallel}
        Path(path, "meta.json").write_text(json.dumps(meta))

    def load_state(self, path: str) -> None:
        if self.train_cfg.lora is not None and Path(path, "adapter.pt").is_file():  # megatron/lora.py
            ray.get([a.load.remote(path) for a in self.actors])
            return
        if not Path(path, "dist").is_dir():
            raise FileNotFoundError(f"{path} holds no megatron train state (no dist/ folder); was it written by the "
                                    "megatron backend's save_state? (torch backend checkpoints cannot be resumed "
                                    "with train.backend=megatron)")
        ray.get([a.load.remote(path) for a in self.actors])

    def export_hf(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        if self.train_cfg.lora is not None:  # a PEFT adapter folder, as the torch backend writes
            ray.get([a.export_adapter.remote(path) for a in self.actors])
            return
        written: dict[str, tuple[str, int]] = {}
        for part in ray.get([a.export_shards.remote(path, MAX_SHARD_BYTES) for a in self.actors]):
            written.update(part)
        write_index(path, written)
        for name, data in self.side_files.items():
            Path(path, name).write_bytes(data)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The HF-named weights gathered to the driver, the tied lm_head included as HF's
        state_dict has it (tests, small models)."""
        # every TP rank of replica 0 joins the gathers; TP rank 0 of each pipeline stage reports
        group = [(a, i) for a, i in zip(self.actors, self.infos) if i["dp_rank"] == 0]
        state: dict[str, torch.Tensor] = {}
        for (_, info), part in zip(group, ray.get([a.hf_state_dict.remote() for a, _ in group])):
            if info["tp_rank"] == 0:
                state.update(part)
        if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def weights_sha256(self) -> str:
        """Same digest as the torch backend's for the same weights (HF names, fp32 bytes)."""
        return state_sha256(self.state_dict())

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Response logprobs under the current weights (pipeline_parallel 1; tests)."""
        if self.train_cfg.megatron.pipeline_parallel > 1:
            raise ValueError("MegatronBackend.logprobs needs pipeline_parallel 1")
        return ray.get([a.logprobs.remote(samples) for a in self.actors])[0]

    # ---- WeightSource (tensor / distributed transports): rank 0 sends, after gathering ----
    def _stage(self, names: list[str] | None, timeout_s: float) -> None:
        if self.train_cfg.megatron.pipeline_parallel > 1:
            raise NotImplementedError("tensor/distributed weight sync with pipeline_parallel > 1 is not built yet; "
                                      "use sync.transport=disk")
        group = [a for a, i in zip(self.actors, self.infos) if i["dp_rank"] == 0]  # rank 0's TP group
        ray.get([a.stage_weights.remote(names) for a in group], timeout=timeout_s)
