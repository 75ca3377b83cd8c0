"""algo.advantage: GRPO's group-normalised advantage, written out (= built-in `grpo`)."""
from torch import Tensor


def grpo(rewards: Tensor) -> Tensor:
    """rewards [G, n] -> advantages [G, n]: (r - group mean) / (group std + 1e-6)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + 1e-6)
