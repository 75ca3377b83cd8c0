"""Choosing and driving the built-in engine's fast path (continuous.py) from the scheduler.

Which path serves (`decode_path`):
- `auto` (default): the fast path on a CUDA device for a model it supports, the HF path
  (generation.Generator) otherwise — CPU runs keep the HF path, whose samples the CPU
  recipes' published numbers come from.
- `static`: the fast path on any device (CPU tests of the same code, without CUDA graphs);
  an unsupported model is a load error.
- `hf`: always the HF path.
LoRA adapters and routed-expert capture are served by the HF path only.

Sizing (SGLang's flags): `--context-length` caps prompt + output (default: the model's
max_position_embeddings, at most DEFAULT_CONTEXT); `--mem-fraction-static` is the share of
the device's memory the weights and the KV cache may take together (default
DEFAULT_MEM_FRACTION); the cache gets what the weights leave, less WORKSPACE_BYTES for
activations and graphs, and holds min(max_running_requests, what fits) sequences. On CPU
the cache gets CPU_CACHE_BYTES unless --mem-fraction-static is given (a share of the RAM).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from milepost.core.engine.continuous import ContinuousGenerator
from milepost.core.engine.generation import Sequence
from milepost.core.engine.static_model import kv_bytes_per_token, unsupported_reason

if TYPE_CHECKING:
    from milepost.core.engine.scheduler import Scheduler

log = logging.getLogger("milepost.engine")

DECODE_PATHS = ("auto", "static", "hf")
DEFAULT_CONTEXT = 4096
DEFAULT_MEM_FRACTION = 0.85
WORKSPACE_BYTES = 3 * 2**30
CPU_CACHE_BYTES = 2**30


def serving_device(name: str) -> torch.device:
    """`--device`: auto (cuda when visible) | cpu | cuda | cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is visible here (use --device cpu)")
    return device


def model_dtype(name: str, device: torch.device, model_path: str) -> torch.dtype:
    """`--dtype` (SGLang's values). auto: float32 on CPU (the CPU recipes' numbers are fp32);
    on CUDA the checkpoint's own 16-bit dtype, bfloat16 for a float32 checkpoint."""
    named = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "float": torch.float32, "float32": torch.float32}
    if name != "auto":
        if name not in named:
            raise ValueError(f"--dtype {name}: use auto, {', '.join(named)}")
        return named[name]
    if device.type != "cuda":
        return torch.float32
    from transformers import AutoConfig
    saved = getattr(AutoConfig.from_pretrained(model_path), "dtype", None)
    return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16


def fast_path_problem(sched: Scheduler, model: torch.nn.Module) -> str | None:
    """Why the HF path serves instead (None: the fast path)."""
    if sched.decode_path == "hf":
        return "--decode-path hf"
    device = next(model.parameters()).device
    if sched.decode_path == "auto" and device.type != "cuda":
        return "a CPU device (the fast path is the default on CUDA)"
    problem: str | None
    if sched.lora.enabled or sched.routed_experts:
        problem = "LoRA adapters" if sched.lora.enabled else "routed-expert capture"
    else:
        problem = unsupported_reason(model)
    if problem and sched.decode_path == "static":
        raise ValueError(f"--decode-path static cannot serve this engine: {problem} (use --decode-path auto)")
    return problem


def build_generator(sched: Scheduler, model: torch.nn.Module, eos: list[int], decode) -> ContinuousGenerator:
    """The fast path's generator, its cache sized from the flags (ValueError when nothing fits)."""
    cfg = model.config
    max_len = sched.context_length or min(getattr(cfg, "max_position_embeddings", DEFAULT_CONTEXT), DEFAULT_CONTEXT)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    per_seq = kv_bytes_per_token(cfg, dtype) * max_len
    budget = _cache_budget(model, device, sched.mem_fraction_static)
    slots = min(sched.max_batch_size, budget // per_seq)
    if slots < 1:
        raise ValueError(f"no room for a KV cache: {budget / 2**30:.1f} GiB left for it, one sequence of "
                         f"{max_len} tokens needs {per_seq / 2**30:.2f} GiB; raise --mem-fraction-static "
                         "or lower --context-length")
    gen = ContinuousGenerator(model, eos, int(slots), max_len, decode, use_graphs=not sched.disable_cuda_graph,
                              batch_invariant=sched.deterministic)
    log.info("fast path: %d slots × %d tokens, KV cache %.2f GiB, CUDA graphs %s", slots, max_len,
             slots * per_seq / 2**30, gen.decoder.use_graphs)
    return gen


def _cache_budget(model: torch.nn.Module, device: torch.device, fraction: float | None) -> int:
    """Bytes for the KV cache. On CPU (tests of the fast path) without a fraction: CPU_CACHE_BYTES."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * (fraction or DEFAULT_MEM_FRACTION)) - weights - WORKSPACE_BYTES
    if fraction is None:
        return CPU_CACHE_BYTES
    import psutil
    return int(psutil.virtual_memory().total * fraction) - weights


class ContinuousDriver:
    """Runs the scheduler's queue through a ContinuousGenerator (the scheduler's `_loop` on
    the fast path). Sequences join the running batch between steps and leave as they
    finish; the rules on `_cv`, pausing and weight updates are the scheduler's."""

    def __init__(self, sched: Scheduler, gen: ContinuousGenerator) -> None:
        self.sched, self.gen = sched, gen
        self._epoch = sched.receiver.epoch

    def loop(self) -> None:
        s = self.sched
        while True:
            with s._cv:
                while not s._queue or s._paused or s._updating:
                    s._cv.wait()
            try:
                served = self.gen.run(self._admit, self._finished, s.model_lock, self._between_steps)
            except Exception as exc:  # never kill the scheduler: fail the running sequences only
                log.exception("batch failed")
                self.gen.take_live()
                with s._cv:
                    running = list(s._running)
                self._fail(running, f"engine error: {exc}")
                continue
            if not served:  # retracted: recomputed from scratch after continue
                live = self.gen.take_live()
                with s._cv:
                    s._running = [x for x in s._running if x not in live]
                    s._queue.extendleft(reversed(live))
                    s._cv.notify_all()

    def _between_steps(self) -> bool:
        """The scheduler's step hook, and the graphs' check that weights did not move."""
        retract = self.sched._step_hook()
        self._see_new_weights()
        return retract

    def _see_new_weights(self) -> None:
        epoch = self.sched.receiver.epoch
        if epoch != self._epoch:  # weight tensors were replaced, not copied into: recapture, refuse
            self.gen.decoder.drop_graphs()
            self._epoch = epoch

    def _admit(self, free: int) -> list[Sequence]:
        # also here: a weight update while idle is followed by an admission and its prefill,
        # with no step in between (seen in CI: the prefill used the old fused weights)
        self._see_new_weights()
        s = self.sched
        with s._cv:
            if free <= 0 or s._paused or s._updating:
                return []
            if not s._running:
                s._gather()
            taken = [s._queue.popleft() for _ in range(min(free, len(s._queue)))]
            s._running.extend(taken)
            return taken

    def _finished(self, seq: Sequence) -> None:
        with self.sched._cv:
            self.sched._running.remove(seq)
            self.sched._cv.notify_all()
        seq.finished()

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            seq.finish_reason = {"type": "abort", "message": message}
            self._finished(seq)
