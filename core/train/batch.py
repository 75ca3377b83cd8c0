"""From `Sample`s to padded tensors, and how a step's samples split over ranks and micro-batches.

Layout: each row is prompt + response, right-padded to L. Response-aligned tensors are
[B, T] with T = the longest response. The logits at position p predict token p + 1, so the
logprob of response token t of row i is read at `logit_index[i, t] = len(prompt_i) - 1 + t`,
for the token `target_ids[i, t]`. Positions past a row's response have loss_mask 0 (and
point at position 0 / `pad_id`, which are valid but ignored).
"""

from __future__ import annotations

import numpy as np
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
    # Each row is written into one numpy array per field, straight from the sample's lists:
    # numpy converts a list ~3x faster than torch.tensor does, and nothing is built per element
    # in Python (16 x 2048 tokens on the 2-core CI machine: 2.5 ms, against 14 ms for flat
    # Python lists through torch.tensor; per-sample tensor ops cost more than either).
    input_ids = np.full((b, width), pad_id, dtype=np.int64)
    attention_mask = np.zeros((b, width), dtype=np.int64)
    logit_index = np.zeros((b, t_max), dtype=np.int64)
    target_ids = np.full((b, t_max), pad_id, dtype=np.int64)
    response_mask, loss_mask, engine_logprobs, advantages = (np.zeros((b, t_max), dtype=np.float32)
                                                             for _ in range(4))
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, :p] = s.prompt_ids
        input_ids[i, p:p + n] = s.response_ids
        attention_mask[i, :p + n] = 1
        logit_index[i, :n] = np.arange(p - 1, p - 1 + n)
        target_ids[i, :n] = s.response_ids
        response_mask[i, :n] = 1.0
        loss_mask[i, :n] = s.loss_mask
        engine_logprobs[i, :n] = s.engine_logprobs
        advantages[i, :n] = float(s.advantage)
    out = {k: torch.from_numpy(v) for k, v in (
        ("input_ids", input_ids), ("attention_mask", attention_mask), ("logit_index", logit_index),
        ("target_ids", target_ids), ("response_mask", response_mask), ("loss_mask", loss_mask),
        ("engine_logprobs", engine_logprobs), ("advantages", advantages))}
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
