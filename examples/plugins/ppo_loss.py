"""algo.loss: PPO's clipped surrogate with clip-higher and dual clip, written out (= built-in `ppo`)."""
import torch
from torch import Tensor

from milepost.core.algo.losses import PolicyLossInputs


def ppo_loss(inputs: PolicyLossInputs) -> tuple[Tensor, Tensor]:
    """Per-token loss [B, T] and clip fraction [B, T]."""
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
    unclipped = ratio * inputs.advantages
    clipped = torch.clamp(ratio, 1.0 - inputs.clip_low, 1.0 + inputs.clip_high) * inputs.advantages
    is_clipped = clipped < unclipped
    loss = -torch.minimum(unclipped, clipped)
    if inputs.dual_clip_c is not None:  # for A < 0 the loss is at most c * |A|
        bound = -inputs.dual_clip_c * inputs.advantages
        is_dual = (inputs.advantages < 0) & (loss > bound)
        loss = torch.where(is_dual, bound, loss)
        is_clipped = is_clipped | is_dual
    return loss, is_clipped.to(inputs.logprobs.dtype)
