"""filters.functions: drop groups whose rewards are all equal (= built-in `zero_variance_groups`)."""
from milepost.core.step_context import StepContext
from milepost.core.types import Sample


def drop_flat_groups(samples: list[Sample], context: StepContext) -> tuple[list[Sample], dict[str, float]]:
    """The samples to keep, and metrics for the step's row."""
    rewards: dict[int, list[float]] = {}
    for s in samples:
        rewards.setdefault(s.group_index, []).append(s.reward)
    flat = {g for g, r in rewards.items() if max(r) == min(r)}
    return [s for s in samples if s.group_index not in flat], {"filter/flat_groups": float(len(flat))}
