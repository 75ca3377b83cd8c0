"""Sample filters: a chain of `FilterFn`s between reward and advantages.

The chain is the built-ins the `filters` section switches on — `zero_variance_groups` (drop
groups whose rewards are all equal: they teach nothing) when `drop_zero_variance_groups`, then
the response-length bounds — followed by `filters.functions` in order: registered names or
import paths of functions with the `FilterFn` signature. Each filter returns the samples it
keeps and its metrics (path-like keys); the chain adds `filter/kept`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from milepost.core.config import FilterConfig
from milepost.core.plugins import PluginError, Registry
from milepost.core.step_context import StepContext
from milepost.core.types import Sample


class FilterFn(Protocol):
    """`filters.functions`: the samples to keep (a subset, in order) and metrics to record."""

    def __call__(self, samples: list[Sample], context: StepContext) -> tuple[list[Sample], dict[str, float]]: ...


FILTERS: Registry[FilterFn] = Registry("filters.functions", FilterFn)


@FILTERS.register("zero_variance_groups")
def drop_zero_variance_groups(samples: list[Sample], context: StepContext) -> tuple[list[Sample], dict[str, float]]:
    """Drops whole groups whose rewards are all equal (every advantage would be 0)."""
    groups: dict[int, list[float]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s.reward)
    flat = {g for g, rewards in groups.items() if max(rewards) == min(rewards)}
    return [s for s in samples if s.group_index not in flat], {"filter/dropped_zero_variance_groups": float(len(flat))}


@dataclass(frozen=True)
class ResponseLength:
    """Keeps responses of min_tokens..max_tokens tokens, both inclusive (None: unbounded).
    A built-in configured by `filters.min_response_tokens` / `max_response_tokens`, not a name:
    a registered name carries no settings."""

    min_tokens: int | None
    max_tokens: int | None

    def __call__(self, samples: list[Sample], context: StepContext) -> tuple[list[Sample], dict[str, float]]:
        lo, hi = self.min_tokens or 0, self.max_tokens
        kept = [s for s in samples if len(s.response_ids) >= lo and (hi is None or len(s.response_ids) <= hi)]
        return kept, {"filter/dropped_length": float(len(samples) - len(kept))}


class FilterError(PluginError):
    """A filter broke the chain's contract (a user error: the same samples fail the same way)."""


@dataclass(frozen=True)
class FilterChain:
    """The step's filters in order, each with the recipe value that named it (for errors)."""

    filters: tuple[tuple[str, FilterFn], ...]

    @classmethod
    def from_config(cls, cfg: FilterConfig) -> FilterChain:
        """Resolves every filter now: a bad name or signature fails at start-up."""
        chain: list[tuple[str, FilterFn]] = []
        if cfg.drop_zero_variance_groups:
            chain.append(("zero_variance_groups", FILTERS.resolve("zero_variance_groups")))
        chain.append(("response length bounds", ResponseLength(cfg.min_response_tokens, cfg.max_response_tokens)))
        chain += [(spec, FILTERS.resolve(spec)) for spec in cfg.functions]
        return cls(tuple(chain))

    def __call__(self, samples: list[Sample], context: StepContext) -> tuple[list[Sample], dict[str, float]]:
        # The built-ins' keys are always present (0 when off), as before filters were plugins.
        metrics = {"filter/dropped_zero_variance_groups": 0.0, "filter/dropped_length": 0.0}
        kept = samples
        for spec, fn in self.filters:
            before = {id(s) for s in kept}
            kept, more = fn(kept, context)
            if not all(id(s) in before for s in kept):
                raise FilterError(f"filters.functions `{spec}` returned samples it was not given; a filter "
                                  "returns a subset of its input (change a sample's fields in a hook or "
                                  "the reward, not in a filter)")
            metrics.update(more)
        metrics["filter/kept"] = float(len(kept))
        return kept, metrics


def filter_groups(samples: list[Sample], cfg: FilterConfig,
                  context: StepContext | None = None) -> tuple[list[Sample], dict[str, float]]:
    """One pass of the chain `cfg` describes (tests and callers without a loop)."""
    return FilterChain.from_config(cfg)(samples, context or StepContext(step=0, policy_version=0, last_step=0, seed=0))
