"""Sample filters: drop groups that teach nothing and samples outside length limits."""

from __future__ import annotations

from milepost.core.config import FilterConfig
from milepost.core.types import Sample


def filter_groups(samples: list[Sample], cfg: FilterConfig) -> tuple[list[Sample], dict[str, float]]:
    dropped_groups = 0
    kept = samples
    if cfg.drop_zero_variance_groups:
        groups: dict[int, list[float]] = {}
        for s in samples:
            groups.setdefault(s.group_index, []).append(s.reward)
        flat = {g for g, rewards in groups.items() if max(rewards) == min(rewards)}
        dropped_groups = len(flat)
        kept = [s for s in kept if s.group_index not in flat]
    before = len(kept)
    lo = cfg.min_response_tokens or 0
    hi = cfg.max_response_tokens
    kept = [s for s in kept if len(s.response_ids) >= lo and (hi is None or len(s.response_ids) <= hi)]
    return kept, {"filter/dropped_zero_variance_groups": float(dropped_groups),
                  "filter/dropped_length": float(before - len(kept)), "filter/kept": float(len(kept))}
