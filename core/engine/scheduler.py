"""The built-in engine's scheduler: owns the model, the request queue and the pause state;
one background thread runs the batches (rules in `Scheduler`'s docstring)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from milepost.core.engine.disk_load import checkpoint_files, load_tokenizer, read_checkpoint
from milepost.core.engine.fast_path import (
    ContinuousDriver,
    build_generator,
    fast_path_problem,
    model_dtype,
    serving_device,
)
from milepost.core.engine.generation import Generator, Sequence
from milepost.core.engine.lora_adapter import EngineLora, take_batch
from milepost.core.engine.memory import MemoryOccupation
from milepost.core.engine.quantized import load_model
from milepost.core.engine.weight_receiver import WeightReceiver
from milepost.core.model.moe_routing import RouterTap

log = logging.getLogger("milepost.engine")

NUM_CONTINUED_PUSHES = 256  # push ids remembered by the pause/continue ordering guard
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
        self.ready = False
        self.load_error: str | None = None  # why the model failed to load (load_engine)
        self.vocab_size = 0  # the model's, once loaded
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
        self.tokenizer = load_tokenizer(self.model_path)
        cfg: Any = self.model.config  # a transformers PretrainedConfig
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
            s.on_done = lambda _s, f=f: _call_soon(loop, f)
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
                s.finished()

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
            def hit(s: Sequence) -> bool:
                return rid == "all" or s.rid == rid

            for s in self._running:
                if hit(s):
                    s.abort_message = message
            dropped = [s for s in self._queue if hit(s)]
            self._queue = deque(s for s in self._queue if not hit(s))
        for s in dropped:
            s.finish_reason = {"type": "abort", "message": message}
            s.finished()

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
        files = checkpoint_files(path)
        if not files:
            return False, f"no *.safetensors in {path}"
        if abort_all:
            self.abort("all", "aborted for weight update")
        state = read_checkpoint(files, self.model, path)
        if isinstance(state, str):  # validated first, so a bad checkpoint leaves the model untouched
            return False, state
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


def _call_soon(loop: asyncio.AbstractEventLoop, done: asyncio.Future[None]) -> None:
    """Resolve `done` on its event loop (called from the scheduler's thread)."""
    loop.call_soon_threadsafe(done.set_result, None)


def load_engine(sched: Scheduler) -> None:
    """Load the model in the background; a failure is kept in `load_error` (/health stays 503)."""
    try:
        sched.load()
    except Exception as exc:
        sched.load_error = repr(exc)
        log.exception("model load failed")

