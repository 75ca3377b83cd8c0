"""Rollout functions: prompts → samples, token in / token out, over the engine protocol.

A rollout function receives narrow arguments (`RolloutRequest`) and a `GenerationClient` (the
router's `generate`); it returns one `Sample` per generated response. It is named in the recipe by a
registered name or an import path and checked against `RolloutFn` at start-up.

Determinism: in sync mode the prompts of a step are sent as one batched `/generate` per
engine with fixed seeds, so the same step always yields the same tokens whichever engine
serves it.

Seed rule (one for SGLang and the built-in engine): never `n > 1` with one seed. SGLang
copies the params into every sample, so with --enable-deterministic-inference the group's
samples come out identical (zero GRPO variance) and without it the seed is ignored. Instead
each of the n samples is its own request with `n = 1` and seed s + j (j = 0 … n-1): input
i of that request is sample j of prompt i of the chunk. The request is batched over the
chunk's prompts with one `sampling_params` object (sglang-router 0.3.2 refuses a list of
them: measured 422), so every input of it uses seed s + j, on both engines: prompts share
seeds, their samples differ by the prompt. These are the tokens the built-in engine drew
before this rule (sample j of a prompt used s + j), and the n requests go out at once.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from milepost.core.config import RolloutConfig
from milepost.core.fleet.client import GenerationClient
from milepost.core.partial_rollout import PartialResponse, continue_cut_responses
from milepost.core.plugins import Registry
from milepost.core.types import Prompt, Sample


@dataclass(frozen=True)
class RolloutRequest:
    prompts: list[Prompt]
    num_samples_per_prompt: int
    sampling_params: dict[str, Any]  # SGLang key names
    sampling_seed: int
    num_engines: int
    decode: Callable[[list[int]], str]
    continue_cut_responses: bool = True  # see partial_rollout; False: cut responses come back as `abort`
    # MoE: ask for SGLang's routed_experts (the client must reach engines directly: the router drops it)
    return_routed_experts: bool = False


class RolloutFn(Protocol):
    def __call__(self, request: RolloutRequest, router: GenerationClient) -> list[Sample]: ...


def sampling_params_from(cfg: RolloutConfig, stop_token_ids: list[int], greedy: bool = False,
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


ROLLOUT_FUNCTIONS: Registry[RolloutFn] = Registry("rollout.function", RolloutFn)


@ROLLOUT_FUNCTIONS.register("default")
def default_rollout(request: RolloutRequest, router: GenerationClient) -> list[Sample]:
    n = request.num_samples_per_prompt
    chunks = _chunks(request.prompts, max(1, request.num_engines))
    offsets = [sum(len(c) for c in chunks[:i]) for i in range(len(chunks))]
    routing: dict[str, Any] = {"return_routed_experts": True} if request.return_routed_experts else {}

    def generate(chunk_index: int) -> list[PartialResponse]:
        chunk = chunks[chunk_index]
        seed = request.sampling_seed + offsets[chunk_index] * n
        with ThreadPoolExecutor(max_workers=n) as samples:  # the n requests go out at once
            per_seed = list(samples.map(lambda j: sample(chunk, seed + j), range(n)))
        outputs = [per_seed[j][i] for i in range(len(chunk)) for j in range(n)]  # prompt-major
        responses = [PartialResponse(chunk[j // n], offsets[chunk_index] + j // n, seed + j,
                                     request.sampling_params["max_new_tokens"], want_routes=bool(routing))
                     for j in range(len(outputs))]
        for response, output in zip(responses, outputs):
            response.absorb(output)
        if request.continue_cut_responses:
            continue_cut_responses(responses, request.sampling_params, continuation)
        return responses

    def sample(chunk: list[Prompt], seed: int) -> list[dict[str, Any]]:
        """One sample of every prompt of `chunk`, all seeded `seed` (seed rule above)."""
        reply = router.generate(input_ids=[p.prompt_ids for p in chunk],
                                sampling_params=dict(request.sampling_params, n=1, sampling_seed=seed),
                                return_logprob=True, **routing)
        outputs = reply if isinstance(reply, list) else [reply]
        if len(outputs) != len(chunk):
            raise RuntimeError(f"engine returned {len(outputs)} outputs for {len(chunk)} inputs")
        return outputs

    def continuation(input_ids: list[list[int]], params: dict[str, Any]) -> list[dict[str, Any]]:
        reply = router.generate(input_ids=input_ids, sampling_params=params, return_logprob=True, **routing)
        return reply if isinstance(reply, list) else [reply]

    with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
        responses = [r for per_chunk in pool.map(generate, range(len(chunks))) for r in per_chunk]
    return [Sample(prompt_index=r.prompt.index, group_index=r.group_index, prompt_ids=list(r.prompt.prompt_ids),
                   response_ids=r.output_ids, engine_logprobs=r.logprobs, loss_mask=[1] * len(r.output_ids),
                   finish_reason=r.finish_reason, weight_version=r.weight_version, label=r.prompt.label,
                   response_text=request.decode(r.output_ids), weight_version_spans=r.spans,
                   routed_experts=r.routes_text())
            for r in responses]


def resolve_rollout_fn(spec: str) -> RolloutFn:
    """A registered name or an import path; the signature is checked now, not mid-campaign."""
    return ROLLOUT_FUNCTIONS.resolve(spec)
