"""hooks: append what each event shows to hook_events.jsonl, in the folder milepost runs in."""
import json
from collections.abc import Mapping, Sequence

from milepost.core.hooks import BlockInfo, CommittedCheckpoint
from milepost.core.step_context import StepContext
from milepost.core.types import Sample


def _log(event: str, **fields: object) -> None:
    with open("hook_events.jsonl", "a") as f:
        f.write(json.dumps({"event": event, **fields}) + "\n")


def on_rollout(samples: Sequence[Sample], context: StepContext) -> None:
    _log("on_rollout", step=context.step, rewards=[s.reward for s in samples])


def on_step_end(metrics: Mapping[str, object], context: StepContext) -> None:
    _log("on_step_end", step=context.step, reward_mean=metrics["rollout/reward_mean"])


def on_checkpoint(checkpoint: CommittedCheckpoint, context: StepContext) -> None:
    _log("on_checkpoint", step=checkpoint.step, model_sha256=checkpoint.model_sha256)


def on_block_end(block: BlockInfo, context: StepContext) -> None:
    _log("on_block_end", block=block.block, last_step=block.last_step, model_sha256=block.model_sha256)
