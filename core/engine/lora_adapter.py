"""LoRA adapters on the built-in engine: SGLang's `/load_lora_adapter`, `/unload_lora_adapter`
and `/generate`'s `lora_path`, with SGLang's launch flags (`--enable-lora`, `--max-lora-rank`,
`--lora-target-modules`, `--lora-paths`) and error texts (srt/lora/lora_manager.py,
lora_registry.py, tokenizer_control_mixin.py of sglang 0.5.23).

An adapter is a PEFT folder (core/train/lora.py writes them). The base weights stay as they
are; a forward hook on each adapted Linear adds `lora_B(lora_A(x)) * alpha / r`, the same
ops in the same order as the trainer's `LoraLinear`, so engine and trainer logprobs agree.

Concurrency: the scheduler thread runs one batch at a time and every sequence of a batch
uses the same adapter (`take_batch`), which it makes `current` for the batch. Load and unload
run on request threads and only change the registry: a batch that started with an adapter
keeps its own reference to it until the batch ends, so an unload never lands mid-batch.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from milepost.core.train.lora import PEFT_PREFIX, matches, read_adapter

if TYPE_CHECKING:  # types only: the scheduler imports the parts of the engine
    from milepost.core.engine.scheduler import Scheduler

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


@dataclass
class Adapter:
    name: str
    path: str
    scaling: float
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name → (A [r, in], B [out, r])


class EngineLora:
    """The adapters one engine holds, and the hooks that apply the batch's adapter."""

    def __init__(self, enabled: bool = False, max_rank: int | None = None,
                 target_modules: list[str] | None = None) -> None:
        self.enabled, self.max_rank, self.target_modules = enabled, max_rank, target_modules
        self.adapters: dict[str, Adapter] = {}
        self.current: Adapter | None = None  # set by the scheduler thread for its batch
        self._lock = threading.Lock()
        self._hooked: set[str] = set()

    def load(self, model: torch.nn.Module, name: str, path: str) -> tuple[bool, str]:
        """Register adapter `name` from the PEFT folder `path`; (success, message)."""
        if not self.enabled:
            return False, NOT_ENABLED
        with self._lock:
            if name in self.adapters:
                return False, f"Failed to load LoRA adapter {name} because it is already loaded"
        try:
            adapter = self._read(model, name, path)
        except Exception as exc:  # noqa: BLE001 - a bad adapter file (safetensors' own errors included) is a 400
            return False, f"Failed to load LoRA adapter {name} from {path}: {type(exc).__name__}: {exc}"
        with self._lock:
            if name in self.adapters:
                return False, f"Failed to load LoRA adapter {name} because it is already loaded"
            for module_name in adapter.layers.keys() - self._hooked:
                model.get_submodule(module_name).register_forward_hook(self._hook(module_name))
                self._hooked.add(module_name)
            self.adapters[name] = adapter
        return True, f"loaded LoRA adapter {name} ({len(adapter.layers)} layers) from {path}"

    def unload(self, name: str) -> tuple[bool, str]:
        if not self.enabled:
            return False, NOT_ENABLED
        with self._lock:
            if self.adapters.pop(name, None) is None:
                return False, f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}"
        return True, f"unloaded LoRA adapter {name}"

    def loaded(self) -> dict[str, str]:
        with self._lock:
            return {n: a.path for n, a in self.adapters.items()}

    def check_requested(self, names: list[str | None]) -> None:
        """Raise ValueError (SGLang's text) when a request names an adapter that is not loaded."""
        with self._lock:
            missing = sorted({n for n in names if n is not None and n not in self.adapters})
            loaded = list(self.adapters)
        if missing and not self.enabled:
            raise ValueError(NOT_ENABLED)
        if missing:
            raise ValueError(f"The following requested LoRA adapters are not loaded: {', '.join(missing)}\n"
                             f"Loaded adapters: {loaded}.")

    @contextmanager
    def active(self, name: str | None) -> Iterator[None]:
        """The scheduler thread's batch runs with adapter `name` (None: the base model). Raises
        when the adapter was unloaded after its requests were admitted: they must not silently
        run on the base model (the scheduler aborts the batch with this message)."""
        with self._lock:
            if name is not None and name not in self.adapters:
                raise ValueError(f"LoRA adapter {name} was unloaded before its requests ran; load it again")
            self.current = self.adapters.get(name) if name is not None else None
        try:
            yield
        finally:
            self.current = None

    def _hook(self, module_name: str) -> Any:
        def apply(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> Any:
            adapter = self.current
            if adapter is None or module_name not in adapter.layers:
                return None
            a, b = adapter.layers[module_name]
            return output + F.linear(F.linear(inputs[0], a), b) * adapter.scaling
        return apply

    def _read(self, model: torch.nn.Module, name: str, path: str) -> Adapter:
        config, tensors = read_adapter(path)
        if config.get("peft_type") != "LORA" or config.get("use_dora"):
            raise ValueError(f"peft_type {config.get('peft_type')!r} (dora {config.get('use_dora')}): only LoRA")
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        if self.max_rank is not None and rank > self.max_rank:
            raise ValueError(f"rank {rank} is more than --max-lora-rank {self.max_rank}")
        targets = config.get("target_modules") or []
        if self.target_modules and not set(targets) <= set(self.target_modules):
            raise ValueError(f"target modules {targets} are not all in --lora-target-modules {self.target_modules}")
        linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key in tensors:
            if not key.endswith(".lora_A.weight"):
                continue
            module = key[len(PEFT_PREFIX):-len(".lora_A.weight")] if key.startswith(PEFT_PREFIX) else ""
            if module not in linears or not matches(module, targets):
                raise ValueError(f"tensor {key} names no adapted Linear layer of this model")
            a, b = tensors[key], tensors[key.replace(".lora_A.", ".lora_B.")]
            base = linears[module].weight
            if a.shape != (rank, base.shape[1]) or b.shape != (base.shape[0], rank):
                raise ValueError(f"{key}: shapes {tuple(a.shape)}, {tuple(b.shape)} do not fit {tuple(base.shape)}")
            layers[module] = (a.to(base.dtype).contiguous(), b.to(base.dtype).contiguous())
        if not layers or 2 * len(layers) != len(tensors):
            raise ValueError(f"expected pairs of lora_A/lora_B tensors, got {sorted(tensors)[:4]}")
        return Adapter(name, path, alpha / rank, layers)


def take_batch(queue: deque, max_size: int) -> list[Any]:
    """Up to `max_size` queued sequences that use the first one's adapter, in queue order; the
    others keep their places. (One adapter per batch: the hooks apply one at a time.)"""
    name = queue[0].lora_name
    if all(s.lora_name == name for s in queue):
        return [queue.popleft() for _ in range(min(max_size, len(queue)))]
    batch: list[Any] = []
    rest: deque[Any] = deque()
    while queue:
        s = queue.popleft()
        (batch if s.lora_name == name and len(batch) < max_size else rest).append(s)
    queue.extend(rest)
    return batch


def requested_adapters(body: dict[str, Any], num_inputs: int) -> list[str | None]:
    """`lora_path` of a /generate: one name for every input, a list with one per input, or none."""
    value = body.get("lora_path")
    if value is None or isinstance(value, str):
        return [value] * num_inputs
    if isinstance(value, list) and len(value) == num_inputs and all(v is None or isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"`lora_path` must be an adapter name, or a list of {num_inputs} names (or nulls)")


def add_lora_routes(app: FastAPI, sched: Scheduler) -> None:
    """SGLang's adapter routes (admin endpoints: the guard asks for the admin key)."""

    async def reply(ok: bool, message: str) -> JSONResponse:
        body = {"success": ok, "error_message": None if ok else message, "loaded_adapters": sched.lora.loaded()}
        return JSONResponse(body, status_code=200 if ok else 400)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Any:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            return await reply(False, "`lora_name` and `lora_path` (strings) are required")
        import asyncio
        ok, message = await asyncio.to_thread(sched.lora.load, sched.model, name, path)
        return await reply(ok, message)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Any:
        name = (await request.json()).get("lora_name")
        if not isinstance(name, str):
            return await reply(False, "`lora_name` (string) is required")
        return await reply(*sched.lora.unload(name))
