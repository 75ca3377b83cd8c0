"""core/train/megatron/step.py `metrics_read`: a schedule's micro-batch metrics, left on the device
by `micro_batch_loss`, read back as floats after the schedule."""

from __future__ import annotations

import pytest
import torch

from milepost.core.train.megatron.step import _GAP_TOKENS, metrics_read


def test_metrics_read_turns_tensors_into_floats_in_order_and_keeps_floats() -> None:
    per_micro = [{"train/loss": torch.tensor(0.5), "loss/policy": torch.tensor(-1.25, dtype=torch.bfloat16),
                  "routing/agreement": 0.75, _GAP_TOKENS: torch.tensor(3),
                  "train/engine_logprob_diff_max": torch.tensor(0.125),
                  "train/engine_logprob_absdiff_sum": torch.tensor(0.25)},
                 {"train/loss": torch.tensor(2.0), _GAP_TOKENS: torch.tensor(1),
                  "train/engine_logprob_diff_max": torch.tensor(1.0),
                  "train/engine_logprob_absdiff_sum": torch.tensor(1.0)}]
    read = metrics_read(per_micro)
    assert read == [{"train/loss": 0.5, "loss/policy": -1.25, "routing/agreement": 0.75,
                     "train/engine_logprob_diff_max": 0.125, "train/engine_logprob_absdiff_sum": 0.25},
                    {"train/loss": 2.0, "train/engine_logprob_diff_max": 1.0,
                     "train/engine_logprob_absdiff_sum": 1.0}]
    assert all(isinstance(v, float) for m in read for v in m.values())


def test_a_micro_batch_without_loss_tokens_reports_no_logprob_gap() -> None:
    read = metrics_read([{"train/loss": torch.tensor(0.0), _GAP_TOKENS: torch.tensor(0),
                          "train/engine_logprob_diff_max": torch.tensor(0.0),
                          "train/engine_logprob_absdiff_sum": torch.tensor(0.0)}])
    assert read == [{"train/loss": 0.0}]


@pytest.mark.parametrize("per_micro", [[], [{}], [{"routing/agreement": 1.0}]])
def test_metrics_read_without_tensors(per_micro: list[dict[str, float]]) -> None:
    assert metrics_read(list(per_micro)) == [dict(m) for m in per_micro]  # type: ignore[arg-type]
