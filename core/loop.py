"""The RL loop (synchronous, `loop.max_staleness = 0`), as named phases with timing spans.

rollout → reward → filter → advantages → train → weight sync → metrics → checkpoint

Ordering rule: a step's rollout only starts after the previous step's weights are served by
every engine (sync mode), so every sample's `weight_version` equals the policy version the
step trains from. The checkpoint is the unit of truth: state restored from it (step, policy
version, data cursor, metrics) makes a resumed run continue bitwise where it stopped.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from milepost.core.algo.advantages import compute_advantages
from milepost.core.checkpoint import CheckpointManager
from milepost.core.config import Recipe
from milepost.core.data.source import PromptSource
from milepost.core.engine.client import EngineClient
from milepost.core.filters import filter_groups
from milepost.core.reward import RewardEvaluator
from milepost.core.rollout import RolloutFn, RolloutRequest, sampling_params_from
from milepost.core.types import Sample
from milepost.core.weight_sync import WeightTransport


@dataclass
class LoopState:
    step: int = 0
    policy_version: int = 0
    cursor: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    model_sha256: str = ""


@contextmanager
def span(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[f"timing/{name}_s"] = time.perf_counter() - start


def assign_advantages(samples: list[Sample], estimator: str) -> None:
    """Group baselines per prompt group (ragged after filtering); REINFORCE++ normalises globally."""
    if not samples:
        return
    if estimator == "reinforce_pp":
        values = compute_advantages(estimator, torch.tensor([[s.reward for s in samples]]))[0]
        for s, a in zip(samples, values.tolist()):
            s.advantage = a
        return
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    for members in groups.values():
        values = compute_advantages(estimator, torch.tensor([[s.reward for s in members]]))[0]
        for s, a in zip(members, values.tolist()):
            s.advantage = a


def summarize_rollout(samples: list[Sample]) -> dict[str, float]:
    n = max(1, len(samples))
    return {
        "rollout/reward_mean": sum(s.reward for s in samples) / n,
        "rollout/response_len_mean": sum(len(s.response_ids) for s in samples) / n,
        "rollout/num_samples": float(len(samples)),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / n,
    }


class RLLoop:
    def __init__(self, recipe: Recipe, *, backend: Any, router: EngineClient,
                 engines: list[EngineClient], source: PromptSource, rollout_fn: RolloutFn,
                 rewards: RewardEvaluator, transport: WeightTransport,
                 checkpoints: CheckpointManager, exports_dir: Path, stop_token_ids: list[int],
                 decode: Callable[[list[int]], str], state: LoopState,
                 on_metrics: Callable[[dict[str, Any]], None]) -> None:
        self.recipe, self.backend, self.router, self.engines = recipe, backend, router, engines
        self.source, self.rollout_fn, self.rewards = source, rollout_fn, rewards
        self.transport, self.checkpoints, self.exports_dir = transport, checkpoints, exports_dir
        self.stop_token_ids, self.decode, self.state = stop_token_ids, decode, state
        self.on_metrics = on_metrics

    def run_until(self, last_step: int) -> None:
        while self.state.step < last_step:
            step = self.state.step + 1
            row = self.run_step(step)
            self.state.metrics.append(row)
            self.on_metrics(row)
            if step % self.recipe.checkpoint.every_steps == 0 or step == last_step:
                self.save_checkpoint()

    def run_step(self, step: int) -> dict[str, Any]:
        r = self.recipe
        timings: dict[str, float] = {}
        with span(timings, "rollout"):
            prompts = self.source.next_batch(r.rollout.prompts_per_step)
            request = RolloutRequest(
                prompts=prompts, num_samples_per_prompt=r.rollout.num_samples_per_prompt,
                sampling_params=sampling_params_from(r.rollout, self.stop_token_ids),
                sampling_seed=(r.seed * 1_000_003 + step * 7919) % (2**31),
                num_engines=r.rollout.num_engines, decode=self.decode)
            samples = self.rollout_fn(request, self.router)
        with span(timings, "reward"):
            self.rewards.score(samples)
        rollout_metrics = summarize_rollout(samples)
        with span(timings, "filter"):
            kept, filter_metrics = filter_groups(samples, r.filters)
        with span(timings, "advantages"):
            assign_advantages(kept, r.algo.advantage)
        with span(timings, "train"):
            train_metrics = self.backend.train_step(kept, step) if kept else {"train/skipped": 1.0}
        with span(timings, "weight_sync"):
            sync_metrics = self.sync_weights(step)
        return {"step": step, "policy_version": self.state.policy_version,
                "data/prompt_indices": [p.index for p in prompts],
                **rollout_metrics, **filter_metrics, **train_metrics, **sync_metrics, **timings}

    def sync_weights(self, step: int) -> dict[str, float]:
        export = self.exports_dir / f"{step:08d}"
        self.backend.export_hf(str(export))
        version = str(self.state.policy_version + 1)
        metrics = self.transport.push(self.engines, str(export), version)
        self.state.policy_version += 1
        self.state.step = step
        self.state.cursor = self.source.cursor.to_dict()
        self._prune_exports(keep=export)
        return {k: v for k, v in metrics.items() if not k.endswith("seconds")}

    def _prune_exports(self, keep: Path) -> None:
        import shutil
        for old in self.exports_dir.glob("*"):
            if old != keep and old.name.isdigit():
                shutil.rmtree(old, ignore_errors=True)

    def save_checkpoint(self) -> None:
        self.state.model_sha256 = self.backend.weights_sha256()

        def payload(folder: Path) -> None:
            self.backend.save_state(str(folder / "trainer"))
            self.backend.export_hf(str(folder / "hf"))

        state = {"step": self.state.step, "policy_version": self.state.policy_version,
                 "cursor": self.state.cursor, "metrics": self.state.metrics,
                 "model_sha256": self.state.model_sha256}
        self.checkpoints.save(self.state.step, state, payload)
