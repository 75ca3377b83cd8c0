"""What each precision mode (`precision.train`, `precision.rollout`) runs on, what it asks of
the engines, and the start-up refusal of a mode the device cannot run.

| mode            | torch backend (trains on CPU)    | megatron backend                    | built-in engine        | SGLang engine         |
| --------------- | -------------------------------- | ----------------------------------- | ---------------------- | --------------------- |
| fp32            | yes                              | yes                                 | `--dtype float32`      | `--dtype float32`     |
| bf16            | bf16 autocast, fp32 weights      | GPU: bf16 params, fp32 master (its  | `--dtype bfloat16`     | `--dtype bfloat16`    |
|                 |                                  | optimizer); CPU: autocast           |                        |                       |
| int4_qat / int4 | fake-quantised Linears (STE)     | the transformer linears fake-       | `--quantization int4`, | refused (config.py)   |
|                 |                                  | quantised (megatron/int4_qat); GPU: | `--dtype` the trainer's|                       |
|                 |                                  | bf16 params, fp32 master; CPU: fp32 | (`int4_dtype`)         |                       |
| fp8             | refused: not built               | bf16 + the transformer linears'     | `--dtype bfloat16      | the same flags, from  |
|                 |                                  | GEMMs through torch._scaled_mm      | --quantization fp8`:   | an fp8 folder of the  |
|                 |                                  | (megatron/fp8.py); CUDA cc >= 8.9,  | block-wise fp8 weights | weights (`disk_form`, |
|                 |                                  | or CPU (emulated, slow: tests)      | (quantised on sync),   | fp8_folder.py); shape |
|                 |                                  |                                     | bf16 matmuls; any      | rule: 128-row parts   |
|                 |                                  |                                     | device                 |                       |

fp8 training and fp8 rollout are not the same numbers (the trainer scales its GEMM inputs per
row or tensor at each matmul, the engine stores weights with 128 x 128 block scales), so no
fp8 pair counts as matched below: TIS corrects the gap.

Refusals are one line naming the field, the reason and the fix (a UserError: `milepost run`
exits 2). What no device runs is refused by the recipe schema (config.py); what depends on
the device is refused here, probing this machine when the stages run on it (the local
executor). The trainer/engine logprob gap of each combination is measured every step
(`train/engine_logprob_diff_mean`, `_max`); where the two modes differ, TIS corrects for it
(`algo.tis_cap`, on by default) and turning it off is warned about.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from milepost.core.config import Recipe
from milepost.core.errors import UserError

log = logging.getLogger(__name__)

FP8_CAPABILITY = (8, 9)  # Ada / Hopper: the first with FP8 tensor cores (torch._scaled_mm)
# SGLang's --dtype spelling (srt/server_args.py); the built-in engine takes the same values.
# int4's is the trainer's (int4_dtype).
ENGINE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}
# The same numbers on both sides: no gap for TIS to correct beyond kernel differences.
MATCHED = {("fp32", "fp32"), ("bf16", "bf16"), ("int4_qat", "int4")}


class PrecisionError(UserError):
    """A precision mode this run cannot use."""


@dataclass(frozen=True)
class Device:
    """What a role computes on: `cpu` or `cuda`, with the CUDA compute capability."""

    kind: str
    capability: tuple[int, int] | None = None

    def describe(self) -> str:
        return "a CPU" if self.kind == "cpu" else f"a CUDA device of compute capability {self.capability}"

    def capable(self, capability: tuple[int, int]) -> bool:
        """A CUDA device of at least this compute capability."""
        return self.kind == "cuda" and self.capability is not None and self.capability >= capability


def local_device() -> Device:
    """This machine's first CUDA device, or its CPU."""
    import torch
    if not torch.cuda.is_available():
        return Device("cpu")
    major, minor = torch.cuda.get_device_capability(0)
    return Device("cuda", (major, minor))


def sent_weight_format(rollout: str) -> str | None:
    """What the trainer's weight sender sends for `precision.rollout` (core/train/weight_sender.py):
    "fp8" (block-wise fp8 weights and scales, quantised on sync) or None (its tensors as they are;
    int4 engines quantise the pushed weights themselves, held in the trainer's dtype)."""
    return "fp8" if rollout == "fp8" else None


def int4_dtype(train_backend: str, on_gpu: bool) -> str:
    """The dtype `precision.train: int4_qat` computes in, and so the `--dtype` of an engine serving
    `int4`: both sides dequantise the same q and scales to it, so the served weights are the
    trained ones bit for bit (core/quant/int4.py). The megatron backend on GPUs trains int4_qat
    as bf16 (bf16 parameters, fp32 master weights in its optimizer): fp32 GEMMs ran 0.087x bf16's
    tokens/s on the lent H100 (bench/results/fp8_training_h100.txt, run 5). On CPUs, and in the
    torch backend (fp32 parameters), it is fp32."""
    return "bfloat16" if train_backend == "megatron" and on_gpu else "float32"


def engine_flags(rollout: str, int4_engine_dtype: str = "float32") -> dict[str, str]:
    """Launch flags of an engine serving `precision.rollout` (SGLang's names). SGLang takes
    `--quantization fp8` with an fp8-serialised folder (`disk_form`); int4 on SGLang is
    refused by the schema. `int4_engine_dtype`: int4's --dtype, the trainer's (`int4_dtype`)."""
    flags = {"dtype": int4_engine_dtype if rollout == "int4" else ENGINE_DTYPE[rollout]}
    if rollout in ("int4", "fp8"):
        flags["quantization"] = rollout
    return flags


def disk_form(engine: str, rollout: str) -> str | None:
    """What form of an HF folder an engine serving `precision.rollout` loads from disk: "fp8"
    (SGLang serving fp8 loads only fp8-serialised folders: core/quant/fp8_folder.py) or None
    (the folder as the trainer wrote it; the built-in engine quantises it itself)."""
    return "fp8" if engine == "sglang" and rollout == "fp8" else None


def train_problem(mode: str, backend: str, device: Device | None) -> str | None:
    """Why `precision.train` `mode` cannot run on `device` (None: not known here), or None.
    fp8 is built for the megatron backend: on CUDA devices of compute capability >= 8.9, and on
    a CPU, where torch._scaled_mm is emulated (slow; it runs the GPU's code in tests). A device
    not known here is checked again by each rank (megatron/worker.py)."""
    if mode != "fp8":
        return None
    if backend != "megatron":
        return (f"precision.train fp8 is built for train.backend megatron only (its linears' GEMMs through "
                f"torch._scaled_mm), not train.backend {backend}; use train.backend megatron or precision.train bf16")
    if device is not None and device.kind == "cuda" and not device.capable(FP8_CAPABILITY):
        return (f"precision.train fp8 needs a CUDA device of compute capability >= 8.9 (FP8 matmuls), and "
                f"train.backend {backend} on this machine runs on {device.describe()}; use precision.train bf16")
    return None


def check_precision(recipe: Recipe, probe: Callable[[], Device] | None) -> None:
    """Refuse (PrecisionError) a precision mode the run's devices cannot run. `probe` gives
    the device the stages run on (this machine's for the local executor), None when they run
    elsewhere (Slurm: what needs the device is refused either way for now)."""
    p = recipe.precision
    # every rollout mode the schema allows runs on any device (fp8: stored fp8, bf16 matmuls)
    device = probe() if probe is not None and p.train == "fp8" else None
    problem = train_problem(p.train, recipe.train.backend, device) or served_problem(recipe)
    if problem:
        raise PrecisionError(problem)
    if (p.train, p.rollout) not in MATCHED and recipe.algo.tis_cap is None:
        log.warning("precision.train %s and precision.rollout %s compute different logprobs, and algo.tis_cap is "
                    "null: nothing corrects for the gap (set algo.tis_cap, e.g. 2.0)", p.train, p.rollout)


def served_problem(recipe: Recipe) -> str | None:
    """Why the rollout engines cannot serve recipe.model in precision.rollout's form, where its
    config is known before it is built or copied (a model known only then is checked when its
    fleet starts: Fleet.check_disk_form)."""
    if disk_form(recipe.rollout.engine, recipe.precision.rollout) != "fp8":
        return None
    from milepost.core.model.loading import model_hf_config
    from milepost.core.quant.fp8_folder import sglang_fp8_problem  # torch: not at import (the planner imports this)
    config = model_hf_config(recipe.model)
    return None if config is None else sglang_fp8_problem(config, recipe.rollout.engine_tensor_parallel)
