"""From `Sample`s to padded tensors, and how a step's samples split over ranks and micro-batches.

Layout: each row is prompt + response, right-padded to L. Response-aligned tensors are
[B, T] with T = the longest response. The logits at position p predict token p + 1, so the
logprob of response token t of row i is read at `logit_index[i, t] = len(prompt_i) - 1 + t`,
for the token `target_ids[i, t]`. Positions past a row's response have loss_mask 0 (and
point at position 0 / `pad_id`, which are valid but ignored).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from milepost.core.types import Sample


def _check(s: Sample) -> None:
    if not s.prompt_ids:
        raise ValueError(f"sample of prompt {s.prompt_index} has an empty prompt; the first "
                         "response token needs a prompt token to be predicted from")
    n = len(s.response_ids)
    if len(s.engine_logprobs) != n or len(s.loss_mask) != n:
        raise ValueError(f"sample of prompt {s.prompt_index}: response_ids ({n}), engine_logprobs "
                         f"({len(s.engine_logprobs)}) and loss_mask ({len(s.loss_mask)}) differ in length")


def collate(samples: list[Sample], pad_id: int) -> dict[str, Tensor]:
    """Pad a micro-batch. Returns input_ids / attention_mask / position_ids [B, L] and
    logit_index / target_ids / response_mask / loss_mask / engine_logprobs / advantages [B, T]."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    for s in samples:
        _check(s)
    b = len(samples)
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    t_max = max(1, max(len(s.response_ids) for s in samples))
    # Rows are padded into one flat Python list per field, then one tensor each: small tensor
    # ops per sample, or nested lists, cost more than a small model's forward.
    rows: dict[str, list[Any]] = {k: [] for k in (
        "input_ids", "attention_mask", "logit_index", "target_ids", "response_mask", "loss_mask",
        "engine_logprobs", "advantages")}
    for s in samples:
        p, n = len(s.prompt_ids), len(s.response_ids)
        pad, t_pad = width - p - n, t_max - n
        rows["input_ids"].extend(s.prompt_ids + s.response_ids + [pad_id] * pad)
        rows["attention_mask"].extend([1] * (p + n) + [0] * pad)
        rows["logit_index"].extend(list(range(p - 1, p - 1 + n)) + [0] * t_pad)
        rows["target_ids"].extend(s.response_ids + [pad_id] * t_pad)
        rows["response_mask"].extend([1.0] * n + [0.0] * t_pad)
        rows["loss_mask"].extend([float(m) for m in s.loss_mask] + [0.0] * t_pad)
        rows["engine_logprobs"].extend([float(x) for x in s.engine_logprobs] + [0.0] * t_pad)
        rows["advantages"].extend([float(s.advantage)] * n + [0.0] * t_pad)
    longs = ("input_ids", "attention_mask", "logit_index", "target_ids")
    out = {k: torch.tensor(v, dtype=torch.long if k in longs else torch.float32).view(b, -1)
           for k, v in rows.items()}
    out["loss_mask"] = out["loss_mask"] * out["response_mask"]
    out["position_ids"] = torch.arange(width, dtype=torch.long).unsqueeze(0).expand(b, width).contiguous()
    return out


def split_micro_batches(samples: list[Sample], micro_batch_size: int) -> list[list[Sample]]:
    """Consecutive chunks of at most micro_batch_size samples, in order (empty in, empty out)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1; got {micro_batch_size}")
    return [samples[i:i + micro_batch_size] for i in range(0, len(samples), micro_batch_size)]


def shard_by_rank(samples: list[Sample], world_size: int) -> list[list[Sample]]:
    """Consecutive, balanced shards by position: rank r gets the r-th block; sizes differ by <= 1."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    base, extra = divmod(len(samples), world_size)
    shards, start = [], 0
    for r in range(world_size):
        size = base + (1 if r < extra else 0)
        shards.append(samples[start:start + size])
        start += size
    return shards


def num_micro_batches(shards: list[list[Sample]], micro_batch_size: int) -> int:
    """Micro-batches every rank runs: the most any rank needs (at least 1)."""
    return max(1, max(-(-len(s) // micro_batch_size) for s in shards))


def count_loss_tokens(samples: list[Sample]) -> int:
    """Tokens that carry loss: sum of loss_mask over all responses."""
    return int(sum(sum(1 for m in s.loss_mask if m) for s in samples))


def padding_sample(pad_id: int) -> Sample:
    """A one-token sample with no loss tokens: fills a rank's missing micro-batches so every
    rank runs the same number of forward/backward passes (DDP allreduces line up)."""
    return Sample(prompt_index=-1, group_index=-1, prompt_ids=[pad_id], response_ids=[pad_id],
                  engine_logprobs=[0.0], loss_mask=[0], finish_reason="abort",
                  weight_version="", label="")
