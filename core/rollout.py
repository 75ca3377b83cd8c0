"""Rollout functions: prompts → samples, token in / token out, over the engine protocol.

A rollout function receives narrow arguments (`RolloutRequest`) and an `EngineClient` for the
router; it returns one `Sample` per generated response. It is named in the recipe by a
registered name or an import path and checked against `RolloutFn` at start-up.

Determinism: in sync mode the prompts of a step are sent as one batched `/generate` per
engine with a fixed `sampling_seed`, so the same step always yields the same tokens
whichever engine serves it.
"""

from __future__ import annotations

import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from milepost.core.engine.client import EngineClient
from milepost.core.plugins import load_object
from milepost.core.types import Prompt, Sample


@dataclass(frozen=True)
class RolloutRequest:
    prompts: list[Prompt]
    num_samples_per_prompt: int
    sampling_params: dict[str, Any]  # SGLang key names
    sampling_seed: int
    num_engines: int
    decode: Callable[[list[int]], str]


class RolloutFn(Protocol):
    def __call__(self, request: RolloutRequest, router: EngineClient) -> list[Sample]: ...


def sampling_params_from(cfg: Any, stop_token_ids: list[int], greedy: bool = False,
                         max_new_tokens: int | None = None) -> dict[str, Any]:
    return {
        "temperature": 0.0 if greedy else cfg.temperature,
        "top_p": 1.0 if greedy else cfg.top_p,
        "top_k": -1 if greedy else cfg.top_k,
        "max_new_tokens": max_new_tokens or cfg.max_new_tokens,
        "stop_token_ids": stop_token_ids,
    }


def _chunks(items: list[Prompt], num: int) -> list[list[Prompt]]:
    size = -(-len(items) // num)
    return [items[i:i + size] for i in range(0, len(items), size)]


def _finish_type(meta: dict[str, Any]) -> str:
    reason = meta.get("finish_reason") or {}
    return reason.get("type", "length") if isinstance(reason, dict) else str(reason)


def default_rollout(request: RolloutRequest, router: EngineClient) -> list[Sample]:
    n = request.num_samples_per_prompt
    chunks = _chunks(request.prompts, max(1, request.num_engines))
    offsets = [sum(len(c) for c in chunks[:i]) for i in range(len(chunks))]

    def generate(chunk_index: int) -> list[dict[str, Any]]:
        chunk = chunks[chunk_index]
        params = dict(request.sampling_params, n=n,
                      sampling_seed=request.sampling_seed + offsets[chunk_index] * n)
        reply = router.generate(input_ids=[p.prompt_ids for p in chunk], sampling_params=params,
                                return_logprob=True)
        outputs = reply if isinstance(reply, list) else [reply]
        if len(outputs) != len(chunk) * n:
            raise RuntimeError(f"engine returned {len(outputs)} outputs for {len(chunk) * n} requests")
        return outputs

    with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
        per_chunk = list(pool.map(generate, range(len(chunks))))

    samples: list[Sample] = []
    for chunk_index, outputs in enumerate(per_chunk):
        for j, out in enumerate(outputs):
            prompt = chunks[chunk_index][j // n]
            meta = out["meta_info"]
            response_ids = list(out["output_ids"])
            logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
            assert len(logprobs) == len(response_ids), "engine logprobs must align with output ids"
            samples.append(Sample(
                prompt_index=prompt.index,
                group_index=offsets[chunk_index] + j // n,
                prompt_ids=list(prompt.prompt_ids),
                response_ids=response_ids,
                engine_logprobs=logprobs,
                loss_mask=[1] * len(response_ids),
                finish_reason=_finish_type(meta),
                weight_version=str(meta.get("weight_version")),
                label=prompt.label,
                response_text=request.decode(response_ids),
            ))
    return samples


ROLLOUT_FUNCTIONS: dict[str, RolloutFn] = {"default": default_rollout}


def resolve_rollout_fn(spec: str) -> RolloutFn:
    """A registered name or an import path; the signature is checked now, not mid-campaign."""
    fn = ROLLOUT_FUNCTIONS.get(spec) or load_object(spec, what="rollout.function",
                                                   known=sorted(ROLLOUT_FUNCTIONS))
    try:
        inspect.signature(fn).bind("request", "router")
    except TypeError as e:
        raise ValueError(f"rollout.function `{spec}` must accept (request, router): {e}") from None
    return fn
