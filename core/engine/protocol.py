"""SGLang's /generate request, as the built-in engine reads and answers it: sampling params,
prompts, size limits, the response's meta_info, and the small request checks the other
routes share. Every refusal is a `BadRequest` (400 with SGLang's error shape), never a 500.
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse

from milepost.core.engine.generation import SamplingParams, Sequence
from milepost.core.engine.routing_capture import response_routes

# SGLang's SamplingParams keys (srt/sampling/sampling_params.py). Keys we do not implement
# are accepted only at their neutral value, so nothing is silently ignored.
SAMPLING_KEYS = {
    "max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
    "stop": None, "stop_token_ids": None, "ignore_eos": False, "skip_special_tokens": True,
    "n": 1, "min_new_tokens": 0, "sampling_seed": None, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "repetition_penalty": 1.0, "stop_regex": None, "regex": None,
    "json_schema": None, "ebnf": None, "structural_tag": None, "no_stop_trim": False,
    "spaces_between_special_tokens": True, "custom_params": None, "stream_interval": None,
    "logit_bias": None,
}
NEUTRAL_ONLY = {"frequency_penalty", "presence_penalty", "repetition_penalty", "stop_regex", "regex",
                "json_schema", "ebnf", "structural_tag", "logit_bias"}
NUMBER_TYPES = {"max_new_tokens": int, "top_k": int, "n": int, "min_new_tokens": int,
                "temperature": float, "top_p": float, "min_p": float}
MAX_SEQUENCES_PER_REQUEST = 16384  # prompts × n of one /generate: more is a mistake, not a batch
# /flush_cache's 200 body, byte for byte SGLang's (srt/entrypoints/http_server.py)
FLUSHED_TEXT = ("Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class BadRequest(Exception):
    """The client's mistake: answered 400 with the message (routes.py)."""


def error_response(msg: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": msg}}, status_code=status)


def parse_sampling(raw: Any) -> tuple[SamplingParams, int, bool]:
    """Validate SGLang sampling_params → (params, n, skip_special_tokens)."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object")
    for key, val in raw.items():
        if key not in SAMPLING_KEYS:
            raise BadRequest(f"unknown field `{key}`, expected one of {', '.join(SAMPLING_KEYS)}")
        if key in NEUTRAL_ONLY and val not in (None, SAMPLING_KEYS[key]):
            raise BadRequest(f"sampling param `{key}` is not supported by the built-in engine")
    v: dict[str, Any] = {k: raw.get(k) if raw.get(k) is not None else d for k, d in SAMPLING_KEYS.items()}
    for key, typ in NUMBER_TYPES.items():
        val = v[key]
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or (
                typ is int and val != int(val)):
            raise BadRequest(f"sampling param `{key}` must be a finite {typ.__name__}, got {val!r:.80}")
    stop = v["stop"] if v["stop"] is not None else []
    stop = [stop] if isinstance(stop, str) else stop
    ids = v["stop_token_ids"] or []
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("`stop` must be a string or a list of strings")
    if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        raise BadRequest("`stop_token_ids` must be a list of ints")
    seed = v["sampling_seed"]
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest("`sampling_seed` must be an int")
    if (v["temperature"] < 0 or not 0 < v["top_p"] <= 1 or not 0 <= v["min_p"] <= 1 or v["n"] < 1
            or v["max_new_tokens"] < 0 or v["min_new_tokens"] < 0 or v["top_k"] == 0 or v["top_k"] < -1):
        raise BadRequest("need temperature >= 0, 0 < top_p <= 1, 0 <= min_p <= 1, n >= 1, max_new_tokens >= 0, "
                         "min_new_tokens >= 0 and top_k -1 (off) or >= 1")
    params = SamplingParams(int(v["max_new_tokens"]), float(v["temperature"]), float(v["top_p"]),
                            int(v["top_k"]), float(v["min_p"]), list(ids), stop, bool(v["ignore_eos"]),
                            int(v["min_new_tokens"]), seed)
    return params, int(v["n"]), bool(v["skip_special_tokens"])


def parse_sampling_list(raw: Any, num_inputs: int) -> tuple[list[SamplingParams], int, bool]:
    """`sampling_params` as SGLang's GenerateReqInput takes it: one object for every input,
    or a list with one object per input (all with the same `n`, as SGLang requires).
    Returns (params per input, n, skip_special_tokens of the first)."""
    if not isinstance(raw, list):
        params, n, skip = parse_sampling(raw)
        return [params] * num_inputs, n, skip
    if len(raw) != num_inputs:
        raise BadRequest(f"`sampling_params` is a list of {len(raw)}; give one object per input ({num_inputs}) "
                         "or a single object for all")
    parsed = [parse_sampling(item) for item in raw]
    if len({n for _, n, _ in parsed}) != 1:
        raise BadRequest("every entry of a `sampling_params` list must have the same `n` (as in SGLang)")
    return [p for p, _, _ in parsed], parsed[0][1], parsed[0][2]


def read_prompts(body: dict, tokenizer: Tokenizer | None, vocab_size: int) -> tuple[list[list[int]], bool]:
    """input_ids (list or list of lists) or text → token lists, and whether it was a batch."""
    ids = body.get("input_ids")
    if ids is None:
        text = body.get("text")
        if text is None:
            raise BadRequest("need `input_ids` or `text`")
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer: send `input_ids`")
        texts = [text] if isinstance(text, str) else text
        if not (isinstance(texts, list) and all(isinstance(t, str) for t in texts)):
            raise BadRequest("`text` must be a string or a list of strings")
        rows = [tokenizer.encode(t) for t in texts]
        if not rows or not all(rows):
            raise BadRequest("`text` tokenized to an empty prompt")
        return rows, not isinstance(text, str)
    batched = isinstance(ids, list) and len(ids) > 0 and isinstance(ids[0], list)
    rows = ids if batched else [ids]
    ok = isinstance(ids, list) and all(isinstance(r, list) and r and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in r) for r in rows)
    if not ok:
        raise BadRequest(f"`input_ids` must be a non-empty list (or list of lists) of ints in [0, {vocab_size})")
    return rows, batched


def check_size(prompts: list[list[int]], params: SamplingParams, n: int, context_len: int | None) -> None:
    """Refuse what the engine cannot or should not run: more sequences than
    MAX_SEQUENCES_PER_REQUEST, or prompt + max_new_tokens beyond the model's context length
    (SGLang answers 400 to the latter too)."""
    if len(prompts) * n > MAX_SEQUENCES_PER_REQUEST:
        raise BadRequest(f"{len(prompts)} prompts × n={n} is more than {MAX_SEQUENCES_PER_REQUEST} sequences "
                         "in one request: split it")
    longest = max(len(p) for p in prompts)
    if context_len is not None and longest + params.max_new_tokens > context_len:
        raise BadRequest(f"requested {longest} prompt tokens + max_new_tokens {params.max_new_tokens}, more than "
                         f"the model's maximum context length of {context_len} tokens: shorten the prompt or "
                         "lower max_new_tokens")


def response(s: Sequence, tokenizer: Tokenizer | None, body: dict, skip_special: bool, t0: float,
             version: str) -> dict:
    """One sequence's /generate answer, SGLang's shape: text, output_ids, meta_info."""
    meta: dict[str, Any] = {
        "id": s.rid, "finish_reason": s.finish_reason, "prompt_tokens": len(s.prompt_ids),
        "completion_tokens": len(s.output_ids), "cached_tokens": 0, "weight_version": version,
        "e2e_latency": time.time() - t0,
    }
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.output_logprobs, s.output_ids)]
        if s.logprob_start_len >= 0:
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in
                                            zip(s.input_logprobs, s.prompt_ids[s.logprob_start_len:])]
    if body.get("return_routed_experts"):
        meta["routed_experts"] = response_routes(s, body.get("routed_experts_start_len", 0))
    text = tokenizer.decode(s.output_ids, skip_special_tokens=skip_special) if tokenizer else ""
    return {"text": text, "output_ids": list(s.output_ids), "meta_info": meta}


def read_push_id(body: dict) -> str | None:
    """The optional `push_id` of a pause or continue (Scheduler's ordering guard)."""
    push_id = body.get("push_id")
    if push_id is not None and not (isinstance(push_id, str) and 0 < len(push_id) <= 128):
        raise BadRequest("`push_id` must be a string of 1 to 128 characters")
    return push_id


async def read_json(request: Request) -> dict:
    try:
        body = await request.json()
    except Exception as exc:  # noqa: BLE001 - malformed JSON is the client's fault: 400, never 500
        raise BadRequest(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body

