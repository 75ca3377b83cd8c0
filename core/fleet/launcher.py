"""The one seam every rollout engine is launched through (`rollout.engine: builtin | sglang`).

An `EngineCommand` holds an engine's launch parameters, typed; `argv()` renders the command
line with SGLang's flag names (sglang 0.5.23, `srt/arg_groups/fields/*.py`: a field `x_y` is
the flag `--x-y`), for SGLang's `python -m sglang.launch_server` and for the built-in engine
(`python -m milepost.core.engine.server`), which takes the same flags and refuses those it
cannot honour (`BUILTIN_UNSUPPORTED`). `render()` quotes every value for a shell.

Values known only on the engine's node (its IP, free ports, the admin-key config written
there) are `Deferred` in a template (`engine_command`): the dry run prints the template, the
engine actor `resolve`s it and runs exactly that argv.

Admin key: never on argv (`ps` shows argv to every user). SGLang reads `--config FILE.yaml`
(`srt/server_args.py` `prepare_server_args` → `utils/server_args_config_parser.py`: a YAML
mapping of flag names, the file name must end in .yaml/.yml), so the actor writes an
owner-only `admin-api-key: …` YAML (`write_admin_config`) and passes its path; the built-in
engine reads the same file the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from milepost.core.config import LoraConfig, RolloutConfig
from milepost.core.engine_wire import BUILTIN_ENGINE_MODULE
from milepost.core.model.moe import is_moe_model
from milepost.core.quant.modes import engine_flags

ENGINE_MODULES = {"builtin": BUILTIN_ENGINE_MODULE, "sglang": "sglang.launch_server"}
# What the built-in engine cannot honour: a value other than the neutral one is refused, by
# `check_supported` here (before any launch) and by the server's own argument parser.
BUILTIN_UNSUPPORTED = {"tp_size": 1, "dp_size": None, "ep_size": None, "nnodes": 1, "node_rank": 0,
                       "dist_init_addr": None, "extra_args": ()}


class Deferred(str):
    """A value decided on the engine's node at launch (`{node_ip}`, `{free_port}`): rendered
    as is, unquoted, in a template; `EngineCommand.resolve` replaces it."""


def _word(value: object) -> str:
    """str(value), keeping a `Deferred` one a `Deferred` (str() of a str subclass is a str)."""
    return value if isinstance(value, str) else str(value)


class LaunchError(ValueError):
    pass


@dataclass(frozen=True)
class EngineCommand:
    """Typed launch parameters of one engine process (one node of it)."""

    engine: str  # "builtin" | "sglang"
    model_path: str
    host: str
    port: int | Deferred
    weight_version: str
    max_running_requests: int
    nccl_port: int | Deferred | None = None  # SGLang only: its own torch.distributed init
    tp_size: int = 1
    dp_size: int | None = None
    ep_size: int | None = None
    base_gpu_id: int = 0  # the actor's CUDA_VISIBLE_DEVICES (set by Ray) start at 0
    mem_fraction_static: float | None = None
    dtype: str | None = None  # --dtype, SGLang's spelling (precision.rollout: core/quant/modes.py)
    quantization: str | None = None  # --quantization (the built-in engine's int4)
    enable_memory_saver: bool = False
    enable_return_routed_experts: bool = False
    enable_deterministic_inference: bool = False
    skip_server_warmup: bool = True  # readiness is gated on /health_generate instead
    dist_init_addr: str | None = None  # multi-node engines: node 0's host:port
    nnodes: int = 1
    node_rank: int = 0
    config_path: str | Deferred | None = None  # owner-only YAML holding admin_api_key
    load_delay_s: float = 0.0  # built-in engine, tests only: a slow cold start
    max_lora_rank: int | None = None  # set: --enable-lora, adapters up to this rank (train.lora)
    lora_target_modules: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    python: str = field(default_factory=lambda: sys.executable)

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_MODULES:
            raise LaunchError(f"unknown engine {self.engine!r}; rollout.engine is one of {sorted(ENGINE_MODULES)}")
        if not self.model_path or not self.host:
            raise LaunchError("an engine needs a model path and a host (an IP literal)")
        for name in ("model_path", "host", "weight_version", "python", *(["config_path"] if self.config_path else [])):
            value = getattr(self, name)
            if any(c in value for c in "\n\r\0"):
                raise LaunchError(f"engine launch parameter {name}={value!r} contains a newline or NUL")
        for name in ("port", "nccl_port"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool) and not 0 < value < 65536:
                raise LaunchError(f"engine {name}={value} is not a TCP port (1-65535)")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise LaunchError(f"an engine on {self.nnodes} nodes needs dist_init_addr (its node 0's host:port)")
        if self.load_delay_s and self.engine != "builtin":
            raise LaunchError("load_delay_s (a test hook) exists only for the built-in engine")

    # --- rendering ---------------------------------------------------------------------
    def argv(self) -> list[str]:
        """The engine's command line, SGLang's flag names, nothing implicit."""
        a: list[str] = [self.python, "-m", ENGINE_MODULES[self.engine], "--model-path", self.model_path,
                        "--host", self.host, "--port", _word(self.port)]
        if self.nccl_port is not None:
            a += ["--nccl-port", _word(self.nccl_port)]
        a += ["--tp-size", str(self.tp_size)]
        if self.dp_size is not None:
            a += ["--dp-size", str(self.dp_size)]
        if self.ep_size is not None:
            a += ["--ep-size", str(self.ep_size)]
        a += ["--base-gpu-id", str(self.base_gpu_id)]
        if self.mem_fraction_static is not None:
            a += ["--mem-fraction-static", repr(float(self.mem_fraction_static))]
        a += ["--max-running-requests", str(self.max_running_requests)]
        if self.dtype is not None:
            a += ["--dtype", self.dtype]
        if self.quantization is not None:
            a += ["--quantization", self.quantization]
        a += ["--weight-version", self.weight_version]
        for flag in ("enable_memory_saver", "skip_server_warmup", "enable_return_routed_experts",
                     "enable_deterministic_inference"):
            if getattr(self, flag):
                a.append("--" + flag.replace("_", "-"))
        if self.max_lora_rank is not None:  # SGLang needs rank and targets to load adapters at run time
            a += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
                  "--lora-target-modules", *self.lora_target_modules]
        if self.nnodes > 1:
            a += ["--dist-init-addr", str(self.dist_init_addr), "--nnodes", str(self.nnodes),
                  "--node-rank", str(self.node_rank)]
        if self.config_path is not None:
            a += ["--config", self.config_path]
        if self.load_delay_s:
            a += ["--load-delay-s", repr(float(self.load_delay_s))]
        return a + list(self.extra_args)

    def render(self) -> str:
        """argv as one shell line: every value quoted, `Deferred` placeholders left as they are."""
        return " ".join(w if isinstance(w, Deferred) else shlex.quote(w) for w in self.argv())

    def resolve(self, **values: Any) -> EngineCommand:
        """This command with its `Deferred` values replaced (host, port, nccl_port, config_path, python)."""
        cmd = dataclasses.replace(self, **values)
        left = [n for n in ("host", "port", "nccl_port", "config_path", "python")
                if isinstance(getattr(cmd, n), Deferred)]
        if left:
            raise LaunchError(f"engine command still has placeholders for {left}")
        return cmd

    def check_supported(self) -> None:
        """Raise if the built-in engine cannot honour a parameter (SGLang takes all of them)."""
        if self.engine != "builtin":
            return
        bad = [f"{k}={getattr(self, k)!r}" for k, neutral in BUILTIN_UNSUPPORTED.items() if getattr(self, k) != neutral]
        if bad:
            raise LaunchError(f"the built-in engine cannot honour {', '.join(bad)}: it runs one process on one "
                              "device; use rollout.engine: sglang on a GPU cluster, or leave these unset")


# Placeholders of a template: what the engine actor fills in on its node.
NODE_IP, FREE_PORT, FREE_NCCL_PORT, ADMIN_CONFIG, PYTHON = (
    Deferred("{node_ip}"), Deferred("{free_port}"), Deferred("{free_nccl_port}"), Deferred("{admin_config_yaml}"),
    Deferred("python"))
PLACEHOLDERS = {
    str(NODE_IP): "the engine node's IP literal (Ray's node IP)",
    str(FREE_PORT): "a free TCP port on that node, picked at launch",
    str(FREE_NCCL_PORT): "another free port, for SGLang's own torch.distributed init",
    str(ADMIN_CONFIG): "an owner-only YAML `admin-api-key: …` the engine actor writes from the campaign's "
                       "key file, deleted once the engine listens",
    str(PYTHON): "the Python of the engine's Ray worker (its sys.executable)",
}


def engine_command(cfg: RolloutConfig, model_path: str, weight_version: str, *, colocated: bool,
                   host: str | None = None, admin_key: bool = False, load_delay_s: float = 0.0,
                   python: str | None = None, lora: LoraConfig | None = None, moe: bool | None = None,
                   precision: str = "fp32", int4_dtype: str = "float32") -> EngineCommand:
    """The launch template of one engine of `cfg` (rollout section). `host` None: the node's IP
    (`{node_ip}` until launch); ports are picked free on the node at launch; `admin_key`: the
    engine gets `--config` with the admin key (written by the actor on its node); `precision`:
    precision.rollout, as --dtype (and --quantization) flags; `int4_dtype`: int4's --dtype, the
    int4_qat trainer's (core/quant/modes.py int4_dtype)."""
    s = cfg.sglang
    flags = engine_flags(precision, int4_dtype)
    common: dict[str, Any] = dict(engine=cfg.engine, model_path=model_path, host=host or NODE_IP, port=FREE_PORT,
                  dtype=flags["dtype"], quantization=flags.get("quantization"),
                  weight_version=str(weight_version), max_running_requests=cfg.max_batch_size,
                  config_path=ADMIN_CONFIG if admin_key else None, load_delay_s=load_delay_s,
                  python=python or PYTHON, max_lora_rank=lora.rank if lora else None,
                  lora_target_modules=tuple(lora.target_modules) if lora else ())
    # MoE models' engines return their routing (the rollout asks for it: MoE routing replay).
    # `moe` None: told from the model folder (a template's placeholder path says nothing).
    routed = s.enable_return_routed_experts or bool(is_moe_model(str(model_path)) if moe is None else moe)
    if cfg.engine == "builtin":
        cmd = EngineCommand(**common, tp_size=cfg.engine_tensor_parallel, enable_return_routed_experts=routed,
                            enable_deterministic_inference=cfg.deterministic_inference)
    else:
        cmd = EngineCommand(**common, nccl_port=FREE_NCCL_PORT, tp_size=cfg.engine_tensor_parallel,
                            dp_size=s.dp_size, ep_size=s.ep_size, mem_fraction_static=s.mem_fraction_static,
                            enable_memory_saver=colocated,
                            enable_return_routed_experts=routed,
                            enable_deterministic_inference=cfg.deterministic_inference,
                            extra_args=tuple(s.extra_args))
    cmd.check_supported()
    return cmd


def engine_gpus(cfg: RolloutConfig, gpus: bool = False) -> int:
    """GPUs one engine takes: SGLang TP=k takes k; the built-in one where the cluster has GPUs
    (its fast path, core/engine/fast_path.py), else none."""
    if cfg.engine == "sglang":
        return cfg.engine_tensor_parallel
    return 1 if gpus else 0


def write_admin_config(key: str, directory: str, name: str = "engine-admin.yaml") -> str:
    """An owner-only YAML `admin-api-key: <key>` in `directory` (made 0700); its path.

    SGLang turns each YAML key into `--<key as written>` (`ConfigArgumentMerger`), so the key
    is spelled with dashes (`admin_api_key` would become the unknown `--admin_api_key`), and
    the value becomes one argv word: one starting with `-` would read as a flag. JSON string
    quoting is valid YAML, so any other key survives the round trip."""
    if not key or key.startswith("-") or any(c in key for c in "\n\r\0"):
        raise LaunchError("the engine admin key must be non-empty, on one line, and not start with '-' (SGLang "
                          "reads it from --config as a command-line word); rotate the campaign's engine_admin_key")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"admin-api-key: {json.dumps(key)}\n")
    return path
