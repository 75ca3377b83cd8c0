"""RL policy losses, penalties and their reduction: pure tensor functions.

Shapes: B sequences, T token positions, V vocabulary. `mask: [B, T]` is 1 on response tokens
and 0 on padding / prompt tokens; any dtype (bool, int or float). Per-token functions return
[B, T] tensors whose values at masked-out positions are meaningless; reductions go through
`masked_sum`, which ignores them (also when they are inf or nan).

Reduction contract (docs/CONTRACTS.md): loss = sum over masked tokens / token_normalizer, so
calling `rl_loss` per micro-batch (and per rank) with the global response-token count as
`token_normalizer` and summing gives the full-batch token mean. Metrics follow the same rule.

The policy term is a plugin (`algo.loss`): a `PolicyLossFn` registered in `POLICY_LOSSES` (the
built-ins `ppo` and `gspo`) or named by import path. It sees only `PolicyLossInputs` — the
micro-batch's tensors and the clip settings — and returns per-token tensors; TIS, KL, entropy
and the reduction stay here, the same for every policy loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from milepost.core.config import AlgoConfig
from milepost.core.plugins import PluginError, Registry

KLKind = Literal["k1", "k2", "k3"]


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of x over positions where mask != 0. x, mask: [B, T] -> scalar."""
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum()


def masked_mean_per_row(x: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence mean over masked tokens (empty rows give 0). x, mask: [B, T] -> [B]."""
    m = mask.bool()
    total = torch.where(m, x, torch.zeros_like(x)).sum(dim=-1)
    return total / m.sum(dim=-1).clamp(min=1).to(x.dtype)


def ppo_clip_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-level PPO clipped surrogate with clip-higher and optional dual clip.

    ratio = exp(lp - old); loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A).
    Dual clip (when dual_clip_c is set): for A < 0, loss = min(loss, -c * A) = min(loss, c|A|).
    All inputs [B, T]. Returns (per_token_loss [B, T], clipfrac [B, T]); clipfrac is a float
    mask, 1 where the gradient is cut by either clip (a clipped branch strictly wins).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    is_clipped = clipped < unclipped
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip_c is not None:
        bound = -dual_clip_c * advantages
        is_dual = (advantages < 0) & (loss > bound)
        loss = torch.where(is_dual, bound, loss)
        is_clipped = is_clipped | is_dual
    return loss, is_clipped.to(logprobs.dtype)


def gspo_sequence_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO sequence ratio s_i = exp(mean over masked tokens of (lp - old)). [B, T] -> [B]."""
    return torch.exp(masked_mean_per_row(logprobs - old_logprobs, mask))


def gspo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, Tensor]:
    """GSPO (sequence-level ratio) in its GSPO-token form, broadcast to every token.

    s_i = exp(sum_t mask * (lp - old) / len_i); the sequence advantage A_i is the masked mean
    of `advantages` over the row (equal to any token's value when A is broadcast per sequence).
    Per token: s_it = sg(s_i) * exp(lp_t - sg(lp_t)) (value s_i, gradient s_i * d lp_t), and
    loss_it = -min(s_it * A_i, clip(s_it, 1 - clip_low, 1 + clip_high) * A_i).
    All inputs [B, T]. Returns (per_token_loss [B, T], clipfrac [B, T]) where clipfrac is 1 on
    every token of a sequence whose clipped branch strictly wins.
    """
    seq_ratio = gspo_sequence_ratio(logprobs, old_logprobs, mask).detach()  # [B]
    seq_adv = masked_mean_per_row(advantages, mask).unsqueeze(-1)  # [B, 1]
    ratio = seq_ratio.unsqueeze(-1) * torch.exp(logprobs - logprobs.detach())  # [B, T]
    unclipped = ratio * seq_adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * seq_adv
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).to(logprobs.dtype)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token KL estimator of KL(pi || ref) from sampled-token logprobs. [B, T] -> [B, T].

    k1 = lp - ref; k2 = 0.5 * (lp - ref)^2; k3 = exp(ref - lp) - (ref - lp) - 1 (no clamping).
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown kl kind `{kind}`; known: k1, k2, k3")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position. [B, T, V] -> [B, T]. -inf logits are allowed."""
    logp = torch.log_softmax(logits, dim=-1)
    safe_logp = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp.exp() * safe_logp).sum(dim=-1)


def tis_weights(old_logprobs: Tensor, engine_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance weights trainer/engine: min(exp(old - engine), cap), detached.

    [B, T] -> [B, T].
    """
    return torch.exp(old_logprobs - engine_logprobs).clamp(max=cap).detach()


def sft_loss(logprobs: Tensor, mask: Tensor, token_normalizer: float) -> Tensor:
    """Negative log-likelihood: -sum(lp * mask) / token_normalizer. [B, T] -> scalar."""
    return -masked_sum(logprobs, mask) / token_normalizer


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a policy loss sees of one micro-batch. Tensors [B, T]; `logprobs` carries the
    gradient, `old_logprobs` are the trainer's detached logprobs of the sampling policy."""

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    clip_low: float
    clip_high: float
    dual_clip_c: float | None


class PolicyLossFn(Protocol):
    """`algo.loss`: per-token policy loss [B, T] and clip fraction [B, T] (1 where a clip cut
    the gradient). Values at masked-out positions are ignored."""

    def __call__(self, inputs: PolicyLossInputs) -> tuple[Tensor, Tensor]: ...


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("algo.loss", PolicyLossFn)


@POLICY_LOSSES.register("ppo")
def ppo_policy_loss(inputs: PolicyLossInputs) -> tuple[Tensor, Tensor]:
    """PPO clip with clip-higher and dual clip (ppo_clip_token_loss)."""
    return ppo_clip_token_loss(inputs.logprobs, inputs.old_logprobs, inputs.advantages,
                               inputs.clip_low, inputs.clip_high, inputs.dual_clip_c)


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(inputs: PolicyLossInputs) -> tuple[Tensor, Tensor]:
    """GSPO, sequence-level ratio (gspo_token_loss); no dual clip."""
    return gspo_token_loss(inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask,
                           inputs.clip_low, inputs.clip_high)


def _policy_term(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: AlgoConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """(per_token_loss, clipfrac, detached token ratio), all [B, T], for cfg.loss. The ratio is
    the metric's; for GSPO it equals the sequence ratio whenever old == current logprobs, as
    in every step of this loop (one update per rollout)."""
    fn = POLICY_LOSSES.resolve(cfg.loss)
    loss, clipfrac = fn(PolicyLossInputs(logprobs, old_logprobs, advantages, mask,
                                         cfg.clip_low, cfg.clip_high, cfg.dual_clip_c))
    if loss.shape != logprobs.shape or clipfrac.shape != logprobs.shape:
        raise PluginError(f"algo.loss `{cfg.loss}` returned shapes {tuple(loss.shape)} and {tuple(clipfrac.shape)}; "
                          f"it must return (per_token_loss, clipfrac), each [B, T] = {tuple(logprobs.shape)}")
    return loss, clipfrac, torch.exp(logprobs - old_logprobs).detach()


def rl_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    engine_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: AlgoConfig,
    token_normalizer: float,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """`rl_loss_on_device` with its metrics as floats (one device-to-host copy)."""
    loss, metrics = rl_loss_on_device(logprobs, old_logprobs, engine_logprobs, advantages, mask, cfg,
                                      token_normalizer, ref_logprobs, entropy)
    return loss, floats_of(metrics)


def scalars_read(tensors: list[Tensor]) -> list[float]:
    """One-element tensors (any dtype, one device) -> floats, read back from the device in one copy."""
    if not tensors:
        return []
    values: list[float] = torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist()
    return values


def floats_of(metrics: dict[str, Tensor]) -> dict[str, float]:
    """0-dim metric tensors -> floats, read back from the device in one copy."""
    return dict(zip(metrics, scalars_read(list(metrics.values()))))


def rl_loss_on_device(
    logprobs: Tensor,
    old_logprobs: Tensor,
    engine_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: AlgoConfig,
    token_normalizer: float,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Full RL objective for one micro-batch. All tensors [B, T]; returns (scalar loss, metrics),
    each metric a 0-dim tensor on the logprobs' device. Why not floats: reading one back waits
    for the GPU, and a wait between a micro-batch's forward and its backward drains the queue the
    host had built up, so the megatron backend reads every micro-batch's metrics after the whole
    schedule (`rl_loss` reads them at once).

    per_token = policy(cfg.loss, a POLICY_LOSSES plugin) * tis + kl_coef * kl(cfg.kl_type) - entropy_coef * entropy,
    where tis = tis_weights(old, engine, cfg.tis_cap) or 1 when tis_cap is None.
    loss = masked_sum(per_token) / token_normalizer. Metrics ('loss/policy', 'loss/kl',
    'loss/entropy', 'loss/clipfrac', 'loss/tis_mean', 'loss/ratio_mean') are masked sums of
    the unscaled per-token quantities / token_normalizer, so they add across micro-batches.
    kl and entropy metrics are 0.0 when their tensors are not given.
    """
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"algo.kl_coef={cfg.kl_coef} > 0 needs ref_logprobs")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError(f"algo.entropy_coef={cfg.entropy_coef} > 0 needs entropy")
    if token_normalizer <= 0:
        raise ValueError(f"token_normalizer must be > 0; got {token_normalizer}")

    policy, clipfrac, ratio = _policy_term(logprobs, old_logprobs, advantages, mask, cfg)
    if cfg.tis_cap is not None:
        tis = tis_weights(old_logprobs, engine_logprobs, cfg.tis_cap)
        policy = policy * tis
    else:
        tis = torch.ones_like(logprobs).detach()
    per_token = policy
    kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_type) if ref_logprobs is not None else None
    if kl is not None and cfg.kl_coef > 0:
        per_token = per_token + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * entropy

    loss = masked_sum(per_token, mask) / token_normalizer

    def contrib(x: Tensor | None) -> Tensor:
        return loss.new_zeros(()) if x is None else (masked_sum(x.detach(), mask) / token_normalizer).detach()

    metrics = {
        "loss/policy": contrib(policy),
        "loss/kl": contrib(kl),
        "loss/entropy": contrib(entropy),
        "loss/clipfrac": contrib(clipfrac),
        "loss/tis_mean": contrib(tis),
        "loss/ratio_mean": contrib(ratio),
    }
    return loss, metrics
