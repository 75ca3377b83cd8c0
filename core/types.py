"""Data that crosses component boundaries: token in, token out, never re-tokenized."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Prompt:
    """One dataset row as the loop sees it."""

    index: int  # position in the dataset file (stable across shuffles and resumes)
    text: str
    label: str
    prompt_ids: list[int]


@dataclass
class Sample:
    """One generated response with everything training needs.

    `engine_logprobs[i]` is the engine's log-probability of `response_ids[i]` under the
    temperature-scaled distribution (log_softmax(logits / T), or of raw logits when T == 0).
    """

    prompt_index: int
    group_index: int  # which group (prompt) of the step this sample belongs to
    prompt_ids: list[int]
    response_ids: list[int]
    engine_logprobs: list[float]
    loss_mask: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str
    label: str
    response_text: str = ""
    reward: float = 0.0
    advantage: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    # [first response-token index, version] per run of tokens from one policy version (a
    # response continued across a weight push has several; see core/partial_rollout.py)
    weight_version_spans: list[list[Any]] = field(default_factory=list)
    # MoE: the engine's routed experts, SGLang's `routed_experts` encoding (base64 of int32
    # [prompt + response - 1, layers, top_k]; core/algo/routing_replay.py); None for dense models
    routed_experts: str | None = None

    def oldest_version(self) -> int | None:
        """The oldest numeric policy version that produced any of its tokens."""
        versions = [str(v) for _, v in self.weight_version_spans] or [self.weight_version]
        numeric = [int(v) for v in versions if v.isdigit()]
        return min(numeric) if numeric else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Sample:
        return cls(**row)
