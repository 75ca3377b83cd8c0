"""Trainer-side logprobs of response tokens, under the engine's convention.

Convention (docs/CONTRACTS.md): log_softmax(logits / T) with T = rollout temperature (raw
logits when T == 0), computed in fp32, with explicit position_ids (0..len-1 per row), so a
full forward here matches what the engine reported during incremental decoding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from milepost.core.algo.losses import entropy_from_logits


def response_logits(model: torch.nn.Module, batch: dict[str, Tensor], temperature: float) -> Tensor:
    """Temperature-scaled fp32 logits at the positions that predict response tokens: [B, T, V]."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False)
    logits = out.logits
    rows = torch.arange(logits.shape[0]).unsqueeze(-1)
    picked = logits[rows, batch["logit_index"]].float()
    return picked / temperature if temperature > 0 else picked


def response_logprobs_and_entropy(model: torch.nn.Module, batch: dict[str, Tensor],
                                  temperature: float) -> tuple[Tensor, Tensor]:
    """(logprobs [B, T] of target_ids, entropy [B, T] of the scaled distribution)."""
    scaled = response_logits(model, batch, temperature)
    logp = torch.log_softmax(scaled, dim=-1)
    lp = logp.gather(-1, batch["target_ids"].unsqueeze(-1)).squeeze(-1)
    return lp, entropy_from_logits(scaled)


def response_logprobs(model: torch.nn.Module, batch: dict[str, Tensor], temperature: float) -> Tensor:
    """log_softmax(logits / T) gathered at the response tokens: [B, T] (0-mask padding is junk)."""
    scaled = response_logits(model, batch, temperature)
    return torch.log_softmax(scaled, dim=-1).gather(-1, batch["target_ids"].unsqueeze(-1)).squeeze(-1)
