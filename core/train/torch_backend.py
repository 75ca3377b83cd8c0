"""Torch DDP train backend: one Ray actor per rank, gloo on CPU, fp32 parameters
(precision.train bf16: autocast; int4_qat: fake-quantised Linears; core/train/precision.py).

Gradient arithmetic: every micro-batch's loss is rl_loss(..., token_normalizer = GLOBAL loss
tokens of the step), so summing over micro-batches and ranks gives the full-batch token mean.
DDP averages gradients over ranks, so each rank backpropagates loss * world_size. Every rank
runs the same number of micro-batches (short ranks run zero-loss padding micro-batches) so
the DDP allreduce of the last one lines up; the others run under no_sync. Metrics add up
over micro-batches and ranks, except keys ending in `_max`, which reduce by max; the driver
turns `train/engine_logprob_absdiff_sum` into `train/engine_logprob_diff_mean` (per loss token).

Non-finite steps (core/train/nonfinite.py): a NaN/inf loss on any rank, or a NaN/inf global
gradient norm, skips the optimizer AND scheduler step on every rank (agreed by one all-reduce),
reported as `train/skipped_nonfinite` and logged by the driver; save refuses non-finite weights.

Checkpoint folder (save_state): model.pt + scheduler.pt (rank 0), optim_rank{r}.pt and
rng_rank{r}.pt (each rank), meta.json (driver).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import random
import shutil
import socket
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist

from milepost.core.algo import routing_replay
from milepost.core.algo.losses import rl_loss
from milepost.core.algo.routing_replay import RankReplay
from milepost.core.config import AlgoConfig, TrainConfig
from milepost.core.placement import actor_strategy
from milepost.core.tcp_store import bound_store
from milepost.core.train import lora
from milepost.core.train.batch import (
    collate,
    count_loss_tokens,
    num_micro_batches,
    padding_sample,
    shard_by_rank,
    split_micro_batches,
)
from milepost.core.train.logprobs import response_logprobs, response_logprobs_and_entropy
from milepost.core.train.nonfinite import (
    SKIPPED_METRIC,
    NonFiniteWeightsError,
    agree_to_skip,
    first_nonfinite,
    nonfinite_weights_message,
)
from milepost.core.train.precision import autocast, prepare_model
from milepost.core.train.schedule import lr_lambda
from milepost.core.train.weight_sender import WeightSender, pack_parameters
from milepost.core.train.weight_source import Rank0WeightSource, SenderRank
from milepost.core.types import Sample

log = logging.getLogger(__name__)

RANK_NUM_CPUS = 0.25  # logical CPUs a rank actor reserves (threads: train_cfg.num_threads_per_rank)
PG_TIMEOUT = datetime.timedelta(minutes=10)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over sorted names, each name's utf-8 bytes then its raw contiguous fp32 bytes."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class RankWorker(SenderRank):
    """One DDP rank (runs inside a Ray actor)."""

    def __init__(self, rank: int, world_size: int, model_path: str, train_cfg: TrainConfig,
                 algo_cfg: AlgoConfig, temperature: float, seed: int, total_steps: int | None,
                 precision: str = "fp32", weight_format: str | None = None) -> None:
        torch.set_num_threads(train_cfg.num_threads_per_rank)
        self.weight_format = weight_format
        self.rank, self.world_size, self.model_path, self.precision = rank, world_size, model_path, precision
        self.train_cfg, self.algo_cfg, self.temperature = train_cfg, algo_cfg, temperature
        self.seed, self.total_steps = seed, total_steps

    def free_port(self) -> int:
        return _free_port()

    def setup(self, port: int) -> None:
        """Join the gloo group, load the model (fp32, prepared for precision.train), wrap in DDP,
        build optimizer and schedule."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        from milepost.core.model.loading import load_causal_lm
        store = bound_store("127.0.0.1", port, self.world_size, self.rank == 0, PG_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size, timeout=PG_TIMEOUT)
        random.seed(self.seed + self.rank)
        np.random.seed((self.seed + self.rank) % 2**32)
        torch.manual_seed(self.seed)
        self.module = prepare_model(load_causal_lm(self.model_path, torch.float32).eval(), self.precision)
        if self.train_cfg.lora is not None:  # base frozen; only the adapter trains and is sent (disk)
            lora.inject(self.module, self.train_cfg.lora, self.seed)
        elif self.rank == 0:  # the rank that sends weights: buckets become spans (no copy to send)
            pack_parameters(self.module)
        self.pad_id = int(self.module.config.pad_token_id or 0)
        self.replay = RankReplay.attach(self.module, self.algo_cfg.routing_replay)  # None: dense model
        self.model = DDP(self.module)
        self.ref = (prepare_model(load_causal_lm(self.model_path, torch.float32).eval(), self.precision)
                    if self.algo_cfg.kl_coef > 0 else None)
        if self.ref is not None:
            self.ref.requires_grad_(False)
        cfg = self.train_cfg
        trained = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, self.total_steps))

    def _micro_batch(self, samples: list[Sample], normalizer: float) -> tuple[float, dict[str, float]]:
        """Forward + backward of one micro-batch; returns (loss, rl_loss metrics)."""
        batch = collate(samples, self.pad_id)
        routes = self.replay.routes(samples, batch) if self.replay else None  # MoE: the engine's experts
        with self.replay.applied(routes) if self.replay else nullcontext(), autocast(self.precision):
            logprobs, entropy = response_logprobs_and_entropy(self.model, batch, self.temperature)
        if self.algo_cfg.entropy_coef == 0:
            entropy = entropy.detach()
        ref = None
        if self.ref is not None:
            with torch.no_grad(), autocast(self.precision):
                ref = response_logprobs(self.ref, batch, self.temperature)
        loss, metrics = rl_loss(logprobs, logprobs.detach(), batch["engine_logprobs"], batch["advantages"],
                                batch["loss_mask"], self.algo_cfg, normalizer, ref_logprobs=ref,
                                entropy=entropy)
        (loss * self.world_size).backward()
        mask = batch["loss_mask"].bool()
        if mask.any():  # engine vs trainer logprobs of the same weights: TIS and on-policy hinge on it
            gap = (logprobs.detach() - batch["engine_logprobs"]).abs()[mask]
            metrics["train/engine_logprob_diff_max"] = float(gap.max())
            metrics["train/engine_logprob_absdiff_sum"] = float(gap.sum())
        if self.replay is not None and routes is not None:  # agreement, and the gap with and without replay
            def forward() -> torch.Tensor:
                with autocast(self.precision):
                    return response_logprobs(self.module, batch, self.temperature)
            metrics.update(self.replay.compare(logprobs.detach(), batch, routes, forward))
        return float(loss.detach()), metrics

    def train(self, samples: list[Sample], n_micro: int, normalizer: float) -> dict[str, float]:
        """Accumulate n_micro micro-batches (padded), clip, one optimizer + scheduler step, or
        none on any rank when a loss or the gradient is non-finite (module doc)."""
        chunks = split_micro_batches(samples, self.train_cfg.micro_batch_size)
        chunks += [[padding_sample(self.pad_id)]] * (n_micro - len(chunks))
        totals: dict[str, float] = {"train/loss": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        losses_finite = True
        for i, chunk in enumerate(chunks):
            with self.model.no_sync() if i < len(chunks) - 1 else nullcontext():
                loss, metrics = self._micro_batch(chunk, normalizer)
            losses_finite = losses_finite and math.isfinite(loss)
            totals["train/loss"] += loss
            for k, v in metrics.items():
                totals[k] = max(totals.get(k, v), v) if k.endswith("_max") else totals.get(k, 0.0) + v
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.train_cfg.grad_clip))
        skip = agree_to_skip(not (losses_finite and math.isfinite(grad_norm)))
        totals["train/grad_norm"] = grad_norm
        totals["train/lr"] = float(self.scheduler.get_last_lr()[0])
        totals[SKIPPED_METRIC] = float(skip)
        if not skip:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return totals

    def save(self, path: str) -> None:
        """Write this rank's files; refuses (before writing any) when its weights are non-finite."""
        bad = first_nonfinite(self.module.state_dict().items())
        if bad is not None:
            raise NonFiniteWeightsError(nonfinite_weights_message(bad, f"torch backend rank {self.rank}"))
        folder = Path(path)
        if self.rank == 0:  # with LoRA the adapter only: the base never changes
            torch.save(self._policy_state(), folder / "model.pt")
            torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")
        torch.save(self.optimizer.state_dict(), folder / f"optim_rank{self.rank}.pt")
        torch.save(_rng_state(), folder / f"rng_rank{self.rank}.pt")

    def load(self, path: str) -> None:
        folder = Path(path)
        state = torch.load(folder / "model.pt", weights_only=True)
        if self.train_cfg.lora is not None:
            lora.load_adapter_state(self.module, state)
        else:
            self.module.load_state_dict(state)
        optim = folder / f"optim_rank{self.rank}.pt"
        optim = optim if optim.exists() else folder / "optim_rank0.pt"  # DDP ranks hold equal states
        self.optimizer.load_state_dict(torch.load(optim, weights_only=True))
        self.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
        rng = folder / f"rng_rank{self.rank}.pt"
        if rng.exists():
            _set_rng_state(torch.load(rng, weights_only=False))

    def _policy_state(self) -> dict[str, torch.Tensor]:
        """What defines the policy beyond the base model: every weight, or the adapter's."""
        return lora.adapter_state(self.module) if self.train_cfg.lora is not None else self.module.state_dict()

    def export(self, path: str) -> None:
        if self.train_cfg.lora is not None:  # a PEFT adapter folder (core/train/lora.py)
            lora.save_adapter(path, self._policy_state(), self.train_cfg.lora, self.model_path)
            return
        self.module.save_pretrained(path, max_shard_size="1000GB")
        for name in TOKENIZER_FILES:
            src = Path(self.model_path) / name
            if src.is_file() and not (Path(path) / name).exists():
                shutil.copy2(src, Path(path) / name)

    def sha256(self) -> str:
        return state_sha256(self._policy_state())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    # ---- weight sync (tensor / distributed transports, milepost.core.weight_sync): rank 0 sends ----
    def _weight_sender(self) -> Any:
        if getattr(self, "_sender", None) is None:
            self._sender = WeightSender(self.module, weight_format=self.weight_format)
        return self._sender

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def engine_gap_mean(metrics: dict[str, float], num_tokens: int) -> dict[str, float]:
    """`train/engine_logprob_absdiff_sum` (summed over ranks) as the mean |trainer - engine|
    logprob per loss token, `train/engine_logprob_diff_mean`: the precision modes' mismatch."""
    out = dict(metrics)
    total = out.pop("train/engine_logprob_absdiff_sum", None)
    if total is not None:
        out["train/engine_logprob_diff_mean"] = total / max(1, num_tokens)
    return out


def log_skipped_step(step: int, metrics: dict[str, float]) -> None:
    log.warning("step %d: non-finite loss or gradient (train/loss=%s, train/grad_norm=%s): the optimizer step was "
                "skipped on every rank; weights, optimizer state and LR schedule are unchanged (%s=1)", step,
                metrics.get("train/loss"), metrics.get("train/grad_norm"), SKIPPED_METRIC)


class TorchBackend(Rank0WeightSource):
    """Driver side: shards each step's samples by position and drives the rank actors."""

    def __init__(self, actors: list[Any], train_cfg: TrainConfig) -> None:
        self.actors, self.train_cfg = actors, train_cfg

    @classmethod
    def create(cls, model_path: str, train_cfg: TrainConfig, algo_cfg: AlgoConfig, temperature: float,
               seed: int, total_steps: int | None = None, placement_group: Any = None,
               precision: str = "fp32", weight_format: str | None = None) -> TorchBackend:
        """`placement_group` (core/placement.py): rank r runs on its bundle r. `precision`:
        precision.train (fp32, bf16, int4_qat). `weight_format`: what weight sync sends
        (weight_sender.WeightSender)."""
        world = train_cfg.num_ranks
        actor_cls = ray.remote(num_cpus=RANK_NUM_CPUS)(RankWorker)
        actors: list[Any] = [actor_cls.options(**actor_strategy(placement_group, r)).remote(
                      r, world, model_path, train_cfg, algo_cfg, temperature, seed, total_steps, precision,
                      weight_format=weight_format)
                  for r in range(world)]
        backend = cls(actors, train_cfg)
        try:
            port = ray.get(actors[0].free_port.remote())
            ray.get([a.setup.remote(port) for a in actors])
        except Exception:
            backend.shutdown()
            raise
        return backend

    def train_step(self, samples: list[Sample], step: int) -> dict[str, float]:
        shards = shard_by_rank(samples, len(self.actors))
        n_micro = num_micro_batches(shards, self.train_cfg.micro_batch_size)
        num_tokens = count_loss_tokens(samples)
        normalizer = float(max(1, num_tokens))
        per_rank = ray.get([a.train.remote(s, n_micro, normalizer) for a, s in zip(self.actors, shards)])
        keys = {k for m in per_rank for k in m}
        metrics = {k: (max if k.endswith("_max") else sum)(m[k] for m in per_rank if k in m) for k in keys}
        metrics["train/grad_norm"] = per_rank[0]["train/grad_norm"]  # equal on every rank
        metrics["train/lr"] = per_rank[0]["train/lr"]
        metrics[SKIPPED_METRIC] = per_rank[0][SKIPPED_METRIC]  # agreed by every rank
        if metrics[SKIPPED_METRIC]:
            log_skipped_step(step, metrics)
        metrics = routing_replay.finish_metrics(metrics)
        metrics = engine_gap_mean(metrics, num_tokens)
        metrics["train/num_tokens"] = float(num_tokens)
        metrics["train/num_micro_batches"] = float(n_micro)
        metrics["train/step"] = float(step)
        return metrics

    def save_state(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        try:
            ray.get([a.save.remote(path) for a in self.actors])
        except NonFiniteWeightsError as e:  # the rank's own error, without Ray's wrapping
            raise getattr(e, "cause", e) from None
        meta = {"world_size": len(self.actors), "format": "milepost-torch-ddp-v1"}
        Path(path, "meta.json").write_text(json.dumps(meta))

    def load_state(self, path: str) -> None:
        if not Path(path, "model.pt").is_file():
            raise FileNotFoundError(f"{path} holds no train state (no model.pt); written by save_state?")
        ray.get([a.load.remote(path) for a in self.actors])

    def export_hf(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        ray.get(self.actors[0].export.remote(path))

    def weights_sha256(self) -> str:
        return ray.get(self.actors[0].sha256.remote())

    def rank_weights_sha256(self) -> list[str]:
        """The digest on every rank (DDP keeps them identical)."""
        return ray.get([a.sha256.remote() for a in self.actors])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0's weights, copied to the driver (tests, small models)."""
        return ray.get(self.actors[0].state_dict.remote())
