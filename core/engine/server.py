"""The built-in rollout engine: SGLang's HTTP protocol (../shared/SGLANG-PROTOCOL.md) over
`generation.Generator`, so the same client and sglang-router drive it or real SGLang.

Run: python -m milepost.core.engine.server --model-path P --host 127.0.0.1 --port N
         [--admin-api-key-file F | --admin-api-key K] [--max-request-body-mb M]

Admin endpoints need the admin key when one is set, exactly as SGLang's --admin-api-key
(rules in http_guard.py). Prefer --admin-api-key-file: a key on the command line is visible
to every user of the machine through `ps`.

This module is the process: flags (SGLang's names) and start-up. The parts: scheduler.py
(queue, batches, pause), routes.py (the HTTP API), protocol.py (reading requests, shaping
answers), disk_load.py (weights and tokenizer from disk).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from milepost.core.engine.fast_path import DECODE_PATHS
from milepost.core.engine.http_guard import DEFAULT_MAX_BODY_MB, guard
from milepost.core.engine.lora_adapter import EngineLora
from milepost.core.engine.quantized import QUANTIZATIONS
from milepost.core.engine.routes import create_app
from milepost.core.engine.scheduler import Scheduler, load_engine
from milepost.core.engine_wire import BUILTIN_ENGINE_MODULE, LOAD_FAILED_EXIT, LOAD_FAILED_LINE, read_key_file


def serve(model_path: str, host: str, port: int, weight_version: str = "0", max_batch_size: int = 512,
          weight_update_timeout_s: float = 300.0, admin_api_key: str | None = None,
          max_body_mb: float = DEFAULT_MAX_BODY_MB, deterministic: bool = False,
          lora: EngineLora | None = None, routed_experts: bool = False,
          device_options: dict[str, Any] | None = None,
          load: Callable[[Scheduler], None] = load_engine) -> None:
    """Bind at once (health answers 503), load the model in the background, serve forever.
    `admin_api_key`: admin endpoints need it (http_guard.py); None leaves them open.
    `deterministic`: outputs that do not depend on the batch (generation.Generator).
    `device_options`: Scheduler attributes of the device and the fast path (fast_path.py):
    device, dtype, decode_path, context_length, mem_fraction_static, disable_cuda_graph.
    `load`: loads the model in the background thread (main's exits when the load fails)."""
    sched = Scheduler(model_path, weight_version, max_batch_size, weight_update_timeout_s, deterministic)
    sched.lora = lora or sched.lora
    sched.routed_experts = routed_experts
    for key, value in (device_options or {}).items():
        if not hasattr(sched, key):
            raise ValueError(f"unknown device option {key!r}")
        setattr(sched, key, value)
    threading.Thread(target=load, args=(sched,), daemon=True, name="engine-load").start()
    app = guard(create_app(sched), admin_api_key, int(max_body_mb * 2**20))
    uvicorn.run(app, host=host, port=port, log_level="warning")


def admin_key_from_args(key: str | None, key_file: str | None) -> str | None:
    """The admin key of --admin-api-key (SGLang's flag) or --admin-api-key-file (preferred)."""
    if key and key_file:
        raise SystemExit("give --admin-api-key or --admin-api-key-file, not both")
    return read_key_file(key_file) if key_file else (key or None)


# SGLang launch flags the built-in engine cannot honour, with their only accepted value (the
# launcher renders SGLang's flags for both engines: core/fleet/launcher.py).
REFUSED_FLAGS = {"tp_size": 1, "dp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0, "base_gpu_id": 0,
                 "dist_init_addr": None, "nccl_port": None}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=BUILTIN_ENGINE_MODULE,
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
                    help="SGLang's flag; the built-in engine's values: int4, Linears served as group-wise int4 "
                         "quantised from the loaded and pushed weights (--dtype float32 or bfloat16, the "
                         "trainer's); fp8, Linears stored as block-wise fp8 (128 x 128 scales, SGLang's format), "
                         "pushed in that format "
                         "and dequantised to --dtype for each matmul (quantized.py)")
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

    def load_or_exit(sched: Scheduler) -> None:
        # A failed load ends the process (exit LOAD_FAILED_EXIT) instead of answering 503
        # forever: whoever owns the process sees it gone, with this line last in its log.
        time.sleep(a.load_delay_s)
        load_engine(sched)
        if sched.load_error:
            print(f"{LOAD_FAILED_LINE}: {sched.load_error}", flush=True)
            os._exit(LOAD_FAILED_EXIT)

    serve(a.model_path, a.host, a.port, a.weight_version, a.max_batch_size, a.weight_update_timeout_s,
          admin_key_from_args(a.admin_api_key, a.admin_api_key_file), a.max_request_body_mb,
          a.enable_deterministic_inference, EngineLora(a.enable_lora, a.max_lora_rank, a.lora_target_modules),
          a.enable_return_routed_experts,
          {"device": a.device, "dtype": a.dtype, "quantization": a.quantization, "decode_path": a.decode_path,
           "context_length": a.context_length, "mem_fraction_static": a.mem_fraction_static,
           "disable_cuda_graph": a.disable_cuda_graph}, load=load_or_exit)


if __name__ == "__main__":
    main()
