"""The built-in rollout engine: SGLang's HTTP protocol (../shared/SGLANG-PROTOCOL.md) over
`generation.Generator`, so the same client and sglang-router drive it or real SGLang.

Run: python -m milepost.core.engine.server --model-path P --host 127.0.0.1 --port N
         [--admin-api-key-file F | --admin-api-key K] [--max-request-body-mb M]

Admin endpoints need the admin key when one is set, exactly as SGLang's --admin-api-key
(rules in http_guard.py). Prefer --admin-api-key-file: a key on the command line is visible
to every user of the machine through `ps`.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import logging
import math
import os
import threading
import time
import uuid
from collections import OrderedDict, deque
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from safetensors.torch import load_file
from transformers import AutoTokenizer

from milepost.core.engine.http_guard import DEFAULT_MAX_BODY_MB, guard, read_key_file
from milepost.core.engine.checkpoint_layout import live_layout
from milepost.core.engine.fast_path import (
    DECODE_PATHS,
    ContinuousDriver,
    build_generator,
    fast_path_problem,
    model_dtype,
    serving_device,
)
from milepost.core.engine.routing_capture import check_start_len, response_routes
from milepost.core.engine.generation import Generator, SamplingParams, Sequence, make_sequences
from milepost.core.engine.lora_adapter import EngineLora, add_lora_routes, requested_adapters, take_batch
from milepost.core.engine.memory import MemoryOccupation, parse_tags
from milepost.core.engine.quantized import QUANTIZATIONS, add_weights_route, load_model
from milepost.core.model.moe_routing import RouterTap
from milepost.core.engine.weight_receiver import WeightReceiver
from milepost.core.engine.weight_routes import add_weight_routes, client_gone
from milepost.core.weight_sync.groups import MAX_GLOO_STREAMS
from milepost.core.weight_sync.wire import SHM_FORMAT

log = logging.getLogger("milepost.engine")

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
NUM_CONTINUED_PUSHES = 256  # push ids remembered by the pause/continue ordering guard
# /flush_cache's 200 body, byte for byte SGLang's (srt/entrypoints/http_server.py)
FLUSHED_TEXT = ("Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n")
MAX_FLUSH_WAIT_S = 300.0
BATCH_GATHER_S, BATCH_GATHER_MAX_S = 0.02, 0.2  # Scheduler._gather's batching window


class Scheduler:
    """Owns the model and the request queue; one background thread runs the batches.

    Concurrency: queue, running batch and pause state change only under `_cv`. Weights are
    guarded by `model_lock`, held by the generator around each forward and by a weight update
    while it swaps tensors in (`_updating` keeps new batches from starting meanwhile); `model_lock` is
    never taken while `_cv` is held, nor the reverse. A batch takes every queued
    sequence (up to max_batch_size) once arrivals pause (`_gather`'s short window);
    requests that arrive while it runs wait for the next batch.
    While paused nothing new is scheduled; `abort` / `retract` pauses return once the running
    batch has ended, `in_place` returns at once and parks the batch between steps.
    Session weight updates (begin → buckets → version → end) are staged by `receiver` and
    swapped in under `model_lock` at their end (rules in WeightReceiver).

    Pause/continue ordering guard (optional; SGLang's clients send no push id and get
    SGLang's behaviour): a pause and the continue of one weight push may carry the same
    `push_id`. A continue records its id; a pause whose id was already continued is stale
    (it waited in a socket, e.g. while the engine was stopped, and arrived after the
    cleanup's continue of its own push) and is ignored, so it can never leave the engine
    paused. The check and the record both happen under `_cv`: whichever of the two is
    handled first, the engine ends unpaused. The last NUM_CONTINUED_PUSHES ids are kept.
    """

    def __init__(self, model_path: str, weight_version: str = "0", max_batch_size: int = 512,
                 weight_update_timeout_s: float = 300.0, deterministic: bool = False) -> None:
        self.model_path, self.weight_version, self.max_batch_size = model_path, weight_version, max_batch_size
        self.deterministic = deterministic  # --enable-deterministic-inference: batch-invariant outputs
        self.ready, self.load_error = False, None
        self.model_lock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._paused: str | None = None
        self._continued: OrderedDict[str, None] = OrderedDict()  # push ids whose continue arrived
        self._updating = False
        self.receiver = WeightReceiver(self, weight_update_timeout_s)
        self.memory = MemoryOccupation(self)
        self.lora = EngineLora()  # serve() enables it with --enable-lora
        self.routed_experts = False  # --enable-return-routed-experts: routes captured (routing_capture.py)
        # device and fast path (fast_path.py); serve() sets them from the flags
        self.device, self.dtype, self.decode_path = "auto", "auto", "auto"
        self.quantization: str | None = None  # --quantization (quantized.py)
        self.context_length: int | None = None
        self.mem_fraction_static: float | None = None
        self.disable_cuda_graph = False
        self.driver: ContinuousDriver | None = None

    def load(self) -> None:
        device = serving_device(self.device)
        dtype = model_dtype(self.dtype, device, self.model_path)
        self.model = load_model(self.model_path, device, dtype, self.quantization, lambda: self.receiver.generation)
        self.tokenizer = _load_tokenizer(self.model_path)
        cfg = self.model.config
        gen_cfg = getattr(self.model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None) or cfg.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        decode = self.tokenizer.decode if self.tokenizer else None
        self.vocab_size = cfg.vocab_size
        self.context_len = self.context_length or getattr(cfg, "max_position_embeddings", None)
        self.generator = Generator(self.model, eos, cfg.pad_token_id or 0, decode, batch_invariant=self.deterministic)
        slow_reason = fast_path_problem(self, self.model)
        if slow_reason is None:
            fast = build_generator(self, self.model, eos, decode)
            self.context_len, self.driver = fast.max_len, ContinuousDriver(self, fast)
        # printed, not logged: the engine's log (the fleet keeps its stdout) says where it serves
        print(f"engine on {device}, {dtype}, " + (f"fast path: {self.driver.gen.num_slots} slots x "
              f"{self.driver.gen.max_len} tokens" if self.driver else f"HF path ({slow_reason})"), flush=True)
        if self.routed_experts:
            self.generator.route_tap = RouterTap.install(self.model)
            if self.generator.route_tap is None:
                raise ValueError(f"--enable-return-routed-experts needs an MoE model; {self.model_path} has no "
                                 "top-k router (drop the flag for a dense model)")
        threading.Thread(target=self._loop, daemon=True, name="engine-scheduler").start()
        self.ready = True

    async def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences and wait until all are finished (or aborted)."""
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in seqs]
        for s, f in zip(seqs, futs):
            s.on_done = lambda _s, f=f: loop.call_soon_threadsafe(f.set_result, None)
        with self._cv:
            self._queue.extend(seqs)
            self._cv.notify_all()
        await asyncio.gather(*futs)

    def _loop(self) -> None:
        if self.driver is not None:
            return self.driver.loop()
        while True:
            with self._cv:
                while not self._queue or self._paused or self._updating:
                    self._cv.wait()
                self._gather()
                if not self._queue or self._paused or self._updating:
                    continue
                batch = take_batch(self._queue, self.max_batch_size)  # one LoRA adapter per batch
                self._running = batch
            try:
                with self.lora.active(batch[0].lora_name):
                    done = self.generator.run_batch(batch, self.model_lock, self._step_hook)
            except Exception as exc:  # never kill the scheduler: fail this batch only
                log.exception("batch failed")
                for s in batch:
                    s.finish_reason = {"type": "abort", "message": f"engine error: {exc}"}
                done = True
            with self._cv:
                self._running = []
                if not done:  # retracted: recomputed from scratch after continue
                    self._queue.extendleft(reversed(batch))
                self._cv.notify_all()
            for s in batch if done else []:
                s.on_done(s)

    def _gather(self) -> None:
        """Batching window (caller holds `_cv`): wait while sequences keep arriving, each
        within BATCH_GATHER_S of the last, for at most BATCH_GATHER_MAX_S in all. Why: a
        batch runs to its end before the next starts, and the rollout sends one request per
        sample seed (rollout.py's seed rule) all at once; without the window the first
        request would run alone and the others wait for it. Outputs do not depend on the
        batch a sequence runs in (generation.py), only latency does."""
        end = time.monotonic() + BATCH_GATHER_MAX_S
        while len(self._queue) < self.max_batch_size and not (self._paused or self._updating):
            seen = len(self._queue)
            self._cv.wait(timeout=BATCH_GATHER_S)
            if len(self._queue) == seen or time.monotonic() >= end:
                return

    def _step_hook(self) -> bool:
        with self._cv:
            while self._paused == "in_place":
                self._cv.wait()
            return self._paused == "retract"

    def pause(self, mode: str, push_id: str | None = None) -> bool:
        """Pause (see the class docstring); False if `push_id` was already continued (ignored)."""
        with self._cv:
            if push_id is not None and push_id in self._continued:
                return False
            self._paused = mode
            self._cv.notify_all()
        if mode == "abort":
            self.abort("all", "paused (abort)")
        if mode in ("abort", "retract"):
            with self._cv:
                self._cv.wait_for(lambda: not self._running)
        return True

    def resume(self, push_id: str | None = None) -> None:
        with self._cv:
            if push_id is not None:
                self._continued[push_id] = None
                self._continued.move_to_end(push_id)
                while len(self._continued) > NUM_CONTINUED_PUSHES:
                    self._continued.popitem(last=False)
            self._paused = None
            self._cv.notify_all()

    def abort(self, rid: str, message: str) -> None:
        """Abort running and queued sequences of one rid (or "all")."""
        with self._cv:
            hit = lambda s: rid == "all" or s.rid == rid
            for s in self._running:
                if hit(s):
                    s.abort_message = message
            dropped = [s for s in self._queue if hit(s)]
            self._queue = deque(s for s in self._queue if not hit(s))
        for s in dropped:
            s.finish_reason = {"type": "abort", "message": message}
            s.on_done(s)

    def busy_reason(self) -> str | None:
        """Why the engine is not idle (requests running or queued), or None."""
        with self._cv:
            running, queued = len(self._running), len(self._queue)
        if running or queued:
            return (f"{running} requests running and {queued} queued: pause generation or let "
                    "them finish first")
        return None

    def flush_problem(self) -> str | None:
        """Why the cache cannot be flushed now, or None. As SGLang's scheduler
        (`is_fully_idle(ignore_waiting=paused)`): running requests always block a flush,
        queued ones only while generation is not paused."""
        with self._cv:
            running, queued, paused = len(self._running), len(self._queue), self._paused is not None
        if running or (queued and not paused):
            return (f"Cache not flushed because there are pending requests. #queue-req: {queued}, "
                    f"#running-req: {running}")
        return None

    def num_running(self) -> int:
        with self._cv:
            return len(self._running)

    def device_type(self) -> str:
        """"cuda" or "cpu": where the weights live (before the load: where they will)."""
        model = getattr(self, "model", None)
        return next(model.parameters()).device.type if model is not None else serving_device(self.device).type

    def num_tokens(self) -> int:
        with self._cv:
            seqs = list(self._running) + list(self._queue)
        return sum(len(s.prompt_ids) + len(s.output_ids) for s in seqs)

    def update_weights(self, path: str, version: str | None, flush_cache: bool,
                       abort_all: bool) -> tuple[bool, str]:
        """Copy safetensors weights from an HF folder into the live model, in place."""
        problem = self.memory.update_problem()
        if problem:
            return False, problem
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            return False, f"no *.safetensors in {path}"
        if abort_all:
            self.abort("all", "aborted for weight update")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        state = live_layout(state, self.model, path)  # a saved MoE's per-expert tensors, fused as live
        problem = self._check_state(state)
        if problem:  # validated first, so a bad checkpoint leaves the model untouched
            return False, problem
        with self._cv:
            if abort_all:
                self._cv.wait_for(lambda: not self._running, timeout=60)
            if flush_cache and self._running:
                return False, "cannot flush cache while requests are running: pause first"
            self._updating = True  # no new batch starts; _cv is free for submit() meanwhile
        try:  # fresh tensors are swapped in, never copied into live ones (they may be shared)
            problem = self.receiver.adopt(state)
        finally:
            with self._cv:
                self._updating = False
                self._cv.notify_all()
        if problem:
            return False, problem
        self.model_path = path
        if version is not None:
            self.weight_version = str(version)
        return True, f"loaded {len(state)} tensors from {path}"

    def _check_state(self, state: dict[str, torch.Tensor]) -> str | None:
        """Names and shapes must match the live model (a tied lm_head may be absent)."""
        own = self.model.state_dict()
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        missing = [k for k in own if k not in state and not (tied and k == "lm_head.weight")]
        unexpected = [k for k in state if k not in own]
        shapes = [k for k in state if k in own and state[k].shape != own[k].shape]
        if missing or unexpected or shapes:
            return f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}, " \
                   f"shape mismatch {shapes[:5]}"
        return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _load_tokenizer(path: str) -> Any:
    """The model's tokenizer, or None for a bare checkpoint (input_ids only). transformers 5
    builds an empty tokenizer from config.json alone, so look for tokenizer files first."""
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:
        return None


def load_engine(sched: Scheduler) -> None:
    try:
        sched.load()
    except Exception as exc:
        sched.load_error = repr(exc)
        log.exception("model load failed")


class BadRequest(Exception):
    pass


def _error(msg: str, status: int = 400) -> JSONResponse:
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
    v = {k: raw.get(k) if raw.get(k) is not None else d for k, d in SAMPLING_KEYS.items()}
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


def _prompts(body: dict, sched: Scheduler) -> tuple[list[list[int]], bool]:
    """input_ids (list or list of lists) or text → token lists, and whether it was a batch."""
    ids = body.get("input_ids")
    if ids is None:
        text = body.get("text")
        if text is None:
            raise BadRequest("need `input_ids` or `text`")
        if sched.tokenizer is None:
            raise BadRequest("this model has no tokenizer: send `input_ids`")
        texts = [text] if isinstance(text, str) else text
        if not (isinstance(texts, list) and all(isinstance(t, str) for t in texts)):
            raise BadRequest("`text` must be a string or a list of strings")
        rows = [sched.tokenizer.encode(t) for t in texts]
        if not rows or not all(rows):
            raise BadRequest("`text` tokenized to an empty prompt")
        return rows, not isinstance(text, str)
    batched = isinstance(ids, list) and len(ids) > 0 and isinstance(ids[0], list)
    rows = ids if batched else [ids]
    ok = isinstance(ids, list) and all(isinstance(r, list) and r and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < sched.vocab_size for t in r) for r in rows)
    if not ok:
        raise BadRequest(f"`input_ids` must be a non-empty list (or list of lists) of ints in [0, {sched.vocab_size})")
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


def _response(s: Sequence, sched: Scheduler, body: dict, skip_special: bool, t0: float, version: str) -> dict:
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
    text = sched.tokenizer.decode(s.output_ids, skip_special_tokens=skip_special) if sched.tokenizer else ""
    return {"text": text, "output_ids": list(s.output_ids), "meta_info": meta}


async def _memory_call(request: Request, call: Any) -> JSONResponse:
    tags = parse_tags(await _json(request) if await request.body() else {})
    if isinstance(tags, str):
        raise BadRequest(tags)
    status, message = await asyncio.to_thread(call, tags)
    return JSONResponse({"success": status == 200, "message": message}, status_code=status)


def _push_id(body: dict) -> str | None:
    """The optional `push_id` of a pause or continue (Scheduler's ordering guard)."""
    push_id = body.get("push_id")
    if push_id is not None and not (isinstance(push_id, str) and 0 < len(push_id) <= 128):
        raise BadRequest("`push_id` must be a string of 1 to 128 characters")
    return push_id


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except Exception as exc:  # malformed JSON is the client's fault: 400, never 500
        raise BadRequest(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def create_app(sched: Scheduler) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # only the protocol's routes

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(str(exc))

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body, t0 = await _json(request), time.time()
        if not sched.ready:
            return _error("model is loading", 503)
        if problem := sched.memory.serving_problem():
            return _error(problem, 503)
        if body.get("stream"):
            raise BadRequest("streaming is not supported by the built-in engine")
        prompts, batched = _prompts(body, sched)
        per_input, n, skip = parse_sampling_list(body.get("sampling_params"), len(prompts))
        check_size(prompts, max(per_input, key=lambda p: p.max_new_tokens), n, sched.context_len)
        start = body.get("logprob_start_len", -1)
        if not isinstance(start, int) or isinstance(start, bool) or not -1 <= start < min(len(p) for p in prompts):
            raise BadRequest("`logprob_start_len` must be an int in [-1, prompt length)")
        rid = body.get("rid") or uuid.uuid4().hex
        seqs = [s for p, params in zip(prompts, per_input) for s in make_sequences(p, params, n, str(rid), start)]
        try:
            check_start_len(body, prompts, sched.routed_experts)
            adapters = requested_adapters(body, len(prompts))
            sched.lora.check_requested(adapters)
        except ValueError as exc:  # SGLang's texts: an unknown adapter, LoRA not enabled; routes not enabled
            raise BadRequest(str(exc)) from None
        for i, s in enumerate(seqs):
            s.lora_name = adapters[i // n]
        await sched.submit(seqs)
        out = [_response(s, sched, body, skip, t0, sched.weight_version) for s in seqs]
        return out if (batched or n > 1) else out[0]

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request) -> Any:
        body = await _json(request)
        if not isinstance(body.get("model_path"), str):
            raise BadRequest("`model_path` (str) is required")
        if sched.receiver.in_session():
            raise BadRequest("a weight-update session is open: end it before loading from disk")
        ok, msg = await asyncio.to_thread(
            sched.update_weights, body["model_path"], body.get("weight_version"),
            bool(body.get("flush_cache", True)), bool(body.get("abort_all_requests", False)))
        return JSONResponse({"success": ok, "message": msg}, status_code=200 if ok else 400)

    @app.post("/pause_generation")
    async def pause(request: Request) -> Any:
        body = await _json(request)
        mode, push_id = body.get("mode", "abort"), _push_id(body)
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest("`mode` must be abort, retract or in_place")
        if await client_gone(request):  # its caller timed out (e.g. we were stopped) and may
            raise BadRequest("client went away")  # already have sent continue: do not pause
        if not await asyncio.to_thread(sched.pause, mode, push_id):
            return JSONResponse({"success": False, "message": f"ignored: push {push_id} was already continued "
                                 "(a stale pause)"}, status_code=409)
        return {"success": True, "message": f"paused ({mode})"}

    @app.post("/continue_generation")
    async def resume(request: Request) -> Any:
        sched.resume(_push_id(await _json(request) if await request.body() else {}))
        return {"success": True, "message": "continued"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush(timeout: float = 0.0) -> Any:
        """SGLang's reply exactly (srt/entrypoints/http_server.py `flush_cache`): plain text,
        200 once nothing runs (queued requests count only while not paused), else 400 with
        the reason; `?timeout=` waits up to that many seconds for the engine to be idle."""
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout >= 0):
            return Response("`timeout` must be a finite number >= 0\n", status_code=400)
        deadline = time.monotonic() + min(timeout, MAX_FLUSH_WAIT_S)
        while (problem := sched.flush_problem()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if problem is None:
            return Response(FLUSHED_TEXT, status_code=200)
        return Response(problem + "\n", status_code=400)

    @app.post("/update_weight_version")
    async def update_version(request: Request) -> Any:
        body = await _json(request)
        if not isinstance(body.get("new_version"), (str, int)):
            raise BadRequest("`new_version` is required")
        if body.get("abort_all_requests", True):
            sched.abort("all", "weight version updated")
        if sched.receiver.stage_version(str(body["new_version"])):
            return {"success": True, "message": f"weight_version {body['new_version']} takes effect at "
                                                "/end_weight_update, with the session's weights"}
        sched.weight_version = str(body["new_version"])
        return {"success": True, "message": f"weight_version={sched.weight_version}"}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Any:
        body = await _json(request)
        sched.abort("all" if body.get("abort_all") else str(body.get("rid", "")), "aborted by request")
        return {"success": True, "message": "ok"}

    add_weight_routes(app, sched, sched.receiver)
    add_lora_routes(app, sched)
    add_weights_route(app, sched)

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request) -> Any:
        return await _memory_call(request, sched.memory.release)

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request) -> Any:
        return await _memory_call(request, sched.memory.resume)

    @app.get("/health")
    async def health() -> Any:
        return JSONResponse({}, status_code=200) if sched.ready else _error("model is loading", 503)

    @app.get("/health_generate")
    async def health_generate() -> Any:
        if not sched.ready:
            return _error("model is loading", 503)
        if problem := sched.memory.serving_problem():
            return _error(problem, 503)
        await sched.submit(make_sequences([0], SamplingParams(max_new_tokens=1, temperature=0.0), 1, "health"))
        return JSONResponse({}, status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Any:
        return {"model_path": sched.model_path, "weight_version": sched.weight_version,
                "is_generation": True, "tokenizer_path": sched.model_path if sched.tokenizer else None}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Any:
        return {"model_path": sched.model_path, "served_model_name": sched.model_path, "dp_size": 1,
                "tp_size": 1, "device": sched.device_type(),  # the weight-update group: gloo on cpu (groups.py)
                "decode_path": "fast" if sched.driver else "hf", "context_length": sched.context_len,
                "weight_version": sched.weight_version, "max_batch_size": sched.max_batch_size,
                "enable_deterministic_inference": sched.deterministic,
                "enable_return_routed_experts": sched.routed_experts,
                "max_gloo_streams": MAX_GLOO_STREAMS,  # /init_weights_update_group takes `gloo_streams`
                "accepts_push_id": True,  # /pause_generation and /continue_generation take `push_id`
                "end_weight_update_abort": True,  # /end_weight_update takes `abort` (discards the session)
                # /update_weights_from_tensor also takes milepost's shm descriptor (beside SGLang's pickle)
                "tensor_formats": [SHM_FORMAT], "enable_lora": sched.lora.enabled,
                "max_lora_rank": sched.lora.max_rank, "lora_target_modules": sched.lora.target_modules,
                "quantization": sched.quantization}

    @app.get("/get_load")
    async def get_load() -> Any:
        return [{"num_tokens": sched.num_tokens()}]

    return app


def serve(model_path: str, host: str, port: int, weight_version: str = "0", max_batch_size: int = 512,
          weight_update_timeout_s: float = 300.0, admin_api_key: str | None = None,
          max_body_mb: float = DEFAULT_MAX_BODY_MB, deterministic: bool = False,
          lora: EngineLora | None = None, routed_experts: bool = False,
          device_options: dict[str, Any] | None = None) -> None:
    """Bind at once (health answers 503), load the model in the background, serve forever.
    `admin_api_key`: admin endpoints need it (http_guard.py); None leaves them open.
    `deterministic`: outputs that do not depend on the batch (generation.Generator).
    `device_options`: Scheduler attributes of the device and the fast path (fast_path.py):
    device, dtype, decode_path, context_length, mem_fraction_static, disable_cuda_graph."""
    sched = Scheduler(model_path, weight_version, max_batch_size, weight_update_timeout_s, deterministic)
    sched.lora = lora or sched.lora
    sched.routed_experts = routed_experts
    for key, value in (device_options or {}).items():
        if not hasattr(sched, key):
            raise ValueError(f"unknown device option {key!r}")
        setattr(sched, key, value)
    threading.Thread(target=load_engine, args=(sched,), daemon=True, name="engine-load").start()
    app = guard(create_app(sched), admin_api_key, int(max_body_mb * 2**20))
    uvicorn.run(app, host=host, port=port, log_level="warning")


def admin_key_from_args(key: str | None, key_file: str | None) -> str | None:
    """The admin key of --admin-api-key (SGLang's flag) or --admin-api-key-file (preferred)."""
    if key and key_file:
        raise SystemExit("give --admin-api-key or --admin-api-key-file, not both")
    return read_key_file(key_file) if key_file else (key or None)


# SGLang launch flags the built-in engine cannot honour, with their only accepted value (the
# launcher renders SGLang's flags for both engines: core/engine/launcher.py).
REFUSED_FLAGS = {"tp_size": 1, "dp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0, "base_gpu_id": 0,
                 "dist_init_addr": None, "nccl_port": None}
LOAD_FAILED_EXIT = 3  # exit status of an engine whose model failed to load


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="milepost.core.engine.server",
                                 description="milepost built-in rollout engine (SGLang protocol and launch flags)")
    ap.add_argument("--model-path", "--model", required=True)
    ap.add_argument("--host", default="127.0.0.1", help="address to bind: loopback unless a cluster-internal "
                                                        "address is given (never 0.0.0.0 unless meant)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--weight-version", default="0")
    ap.add_argument("--max-running-requests", "--max-batch-size", dest="max_batch_size", type=int, default=512,
                    help="most sequences decoded at once (SGLang's --max-running-requests)")
    ap.add_argument("--weight-update-timeout-s", type=float, default=300.0,
                    help="idle time after which a weight-update session is stale; also the "
                         "timeout of the weight-update group's rendezvous and broadcasts")
    ap.add_argument("--admin-api-key", default=None,
                    help="SGLang's flag: admin endpoints need `Authorization: Bearer KEY`. Visible in `ps`: "
                         "prefer --config FILE.yaml (`admin_api_key: KEY`) or --admin-api-key-file")
    ap.add_argument("--admin-api-key-file", default=None, help="a file holding the admin key")
    ap.add_argument("--config", default=None,
                    help="a YAML file of flag values (SGLang's --config): `admin_api_key: KEY`, …; "
                         "flags given on the command line win")
    ap.add_argument("--max-request-body-mb", type=float, default=DEFAULT_MAX_BODY_MB,
                    help="larger request bodies get 413")
    ap.add_argument("--load-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: a slow cold start
    # SGLang's flags that need nothing here: the built-in engine never warms up, and always
    # implements /release_memory_occupation and /resume_memory_occupation.
    ap.add_argument("--skip-server-warmup", action="store_true", help="accepted (no warm-up here)")
    ap.add_argument("--enable-memory-saver", action="store_true", help="accepted (memory release is always on)")
    # SGLang's flags accepted only at their neutral value (REFUSED_FLAGS).
    for flag, kind in (("--tp-size", int), ("--dp-size", int), ("--ep-size", int), ("--nnodes", int),
                       ("--node-rank", int), ("--base-gpu-id", int), ("--dist-init-addr", str),
                       ("--nccl-port", int)):
        ap.add_argument(flag, type=kind, default=REFUSED_FLAGS[flag[2:].replace("-", "_")], help=argparse.SUPPRESS)
    # Device and fast path (fast_path.py); SGLang's names where SGLang has the flag.
    ap.add_argument("--device", default="auto", help="auto (cuda when visible) | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", help="SGLang's flag: auto | half | float16 | bfloat16 | float | "
                                                    "float32 (auto: float32 on CPU, 16-bit on CUDA)")
    ap.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                    help="SGLang's flag; the built-in engine's value int4: Linears served as group-wise int4 "
                         "quantised from the loaded and pushed weights (quantized.py; needs --dtype float32)")
    ap.add_argument("--decode-path", default="auto", choices=DECODE_PATHS,
                    help="auto: the static-cache fast path on CUDA, the HF path on CPU; static: the fast path "
                         "anywhere; hf: the HF path")
    ap.add_argument("--context-length", type=int, default=None,
                    help="SGLang's flag: longest prompt + output (sizes the fast path's KV cache)")
    ap.add_argument("--mem-fraction-static", type=float, default=None,
                    help="SGLang's flag: share of GPU memory for weights + KV cache (fast path, CUDA)")
    ap.add_argument("--disable-cuda-graph", action="store_true", help="SGLang's flag: decode without CUDA graphs")
    ap.add_argument("--enable-return-routed-experts", action="store_true",
                    help="SGLang's flag: /generate answers `return_routed_experts` (MoE models only)")
    ap.add_argument("--enable-lora", action="store_true", help="SGLang's flag: /load_lora_adapter and lora_path")
    ap.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank accepted")
    ap.add_argument("--lora-target-modules", nargs="*", default=None, help="layers adapters may adapt")
    ap.add_argument("--max-loras-per-batch", type=int, default=8, help="accepted (one adapter per batch here)")
    ap.add_argument("--enable-deterministic-inference", action="store_true",
                    help="SGLang's flag: outputs and logprobs that do not depend on the batch a request "
                         "runs in (each sequence decoded alone; slower)")
    return ap


def config_argv(path: str, ap: argparse.ArgumentParser) -> list[str]:
    """The argv words of a --config YAML, as SGLang reads it (keys are flag names, `-` or `_`;
    true adds a store_true flag, false leaves it out). A key this engine has no flag for is an error."""
    import yaml

    if not path.endswith((".yaml", ".yml")):
        raise SystemExit(f"--config {path}: must be a .yaml or .yml file (as SGLang requires)")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: must hold a mapping of flag names to values")
    known = {opt: a for a in ap._actions for opt in a.option_strings}
    words: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = known.get(flag)
        if action is None or flag in ("--config", "--help"):
            raise SystemExit(f"--config {path}: unknown option {key!r} for the built-in engine")
        if isinstance(action, argparse._StoreTrueAction):
            words += [flag] if value else []
        else:
            words += [flag, str(value)]
    return words


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse (with --config merged in, command line winning) and refuse what cannot be honoured."""
    import sys

    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    first = ap.parse_args(argv)
    a = ap.parse_args(config_argv(first.config, ap) + argv) if first.config else first
    bad = [f"--{k.replace('_', '-')} {getattr(a, k)}" for k, neutral in REFUSED_FLAGS.items()
           if getattr(a, k) != neutral]
    if bad:
        ap.error(f"the built-in engine cannot honour {', '.join(bad)}: it runs one process on one device "
                 "without GPU memory management or expert parallelism; use SGLang (rollout.engine: sglang)")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    global load_engine
    load = load_engine

    def load_or_exit(sched: Scheduler) -> None:
        # A failed load ends the process (exit LOAD_FAILED_EXIT) instead of answering 503
        # forever: whoever owns the process sees it gone, with this line last in its log.
        time.sleep(a.load_delay_s)
        load(sched)
        if sched.load_error:
            print(f"model load failed: {sched.load_error}", flush=True)
            os._exit(LOAD_FAILED_EXIT)

    load_engine = load_or_exit
    serve(a.model_path, a.host, a.port, a.weight_version, a.max_batch_size, a.weight_update_timeout_s,
          admin_key_from_args(a.admin_api_key, a.admin_api_key_file), a.max_request_body_mb,
          a.enable_deterministic_inference, EngineLora(a.enable_lora, a.max_lora_rank, a.lora_target_modules),
          a.enable_return_routed_experts,
          {"device": a.device, "dtype": a.dtype, "quantization": a.quantization, "decode_path": a.decode_path,
           "context_length": a.context_length, "mem_fraction_static": a.mem_fraction_static,
           "disable_cuda_graph": a.disable_cuda_graph})


if __name__ == "__main__":
    main()
