"""Whether a recipe's model is a mixture of experts, without importing torch.

An MoE model's engines capture routing (`--enable-return-routed-experts`), its rollout asks
the engines for it directly (the router drops the field), and its trainer can replay it
(`algo.routing_replay`). A dense model does none of these.
"""

from __future__ import annotations

import json
from pathlib import Path

from milepost.core.config import Recipe
from milepost.core.errors import UserError

MOE_BUILTINS = ("builtin:tiny-arith-moe",)
DENSE_BUILTINS = ("builtin:tiny-arith", "builtin:gpu-arith")
# config.json keys that count routed experts, by architecture family (Qwen3-MoE / Qwen2-MoE,
# DeepSeek-V3, Mixtral).
EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def moe_from_config(doc: dict) -> bool:
    """An HF config (config.json as a dict) with routed experts."""
    return any(isinstance(doc.get(k), int) and doc[k] > 1 for k in EXPERT_KEYS)


def is_moe_model(path: str) -> bool | None:
    """True/False for a builtin model or a local HF folder; None when it cannot be told here
    (a remote URL, a folder without a readable config.json)."""
    if path in MOE_BUILTINS:
        return True
    if path in DENSE_BUILTINS:
        return False
    config = Path(path.removeprefix("file://")) / "config.json"
    if "://" in path.removeprefix("file://") or not config.is_file():
        return None
    try:
        return moe_from_config(json.loads(config.read_text()))
    except (OSError, ValueError):
        return None


def check_routing_replay(recipe: Recipe) -> None:
    """`algo.routing_replay: true` needs an MoE model: refuse it on a model known to be dense.
    An MoE model with `train.lora` is refused too: its rollout goes to the engines directly
    (core/fleet/direct.py), which does not name the adapter yet."""
    moe = is_moe_model(recipe.model.path)
    if moe and recipe.train.lora is not None:
        raise UserError(f"train.lora with the MoE model `{recipe.model.path}` is not supported yet (MoE rollouts "
                        "ask engines directly for their routes and do not name an adapter); remove train.lora")
    if recipe.algo.routing_replay and recipe.train.backend == "megatron":
        _check_megatron_replay(recipe.train.megatron.pipeline_parallel, recipe.train.megatron.recompute)
    if recipe.algo.routing_replay and moe is False:
        raise UserError(f"algo.routing_replay: true needs a mixture-of-experts model, and model.path "
                        f"`{recipe.model.path}` is dense (its config has no {'/'.join(EXPERT_KEYS)}); set "
                        "algo.routing_replay=false, or use an MoE model such as builtin:tiny-arith-moe")


def _check_megatron_replay(pipeline_parallel: int, recompute: str) -> None:
    """What the megatron backend's replay (core/train/megatron/routing.py) does not handle yet."""
    if pipeline_parallel > 1:
        raise UserError(f"algo.routing_replay: true with train.megatron.pipeline_parallel={pipeline_parallel} is not "
                        "supported yet (routes are set per micro-batch on one stage's routers); set "
                        "train.megatron.pipeline_parallel=1 or algo.routing_replay=false")
    if recompute != "none":
        raise UserError(f"algo.routing_replay: true with train.megatron.recompute={recompute} is not supported (the "
                        "recomputed forward would route without the recorded experts); set "
                        "train.megatron.recompute=none or algo.routing_replay=false")
