"""The parallel layout of a recipe: derived sizes, devices per role, and the rules it must obey.

Divisibility rules are those megatron-core 0.16 (trainer) and SGLang (engines) enforce at
start-up, checked here before any allocation is requested:
- TP divides the attention heads; the KV heads are a multiple or a divisor of TP (below TP,
  each rank holds one replicated KV head); TP divides the MLP hidden size;
- PP divides the layers; with a virtual pipeline, PP >= 2 and VPP divides the layers per stage;
- EP divides the routed experts; expert-TP divides the expert hidden size; the world size is a
  multiple of expert-TP * EP * PP (Megatron's expert grid);
- world size = TP * PP * CP * DP (the recipe schema refuses a world size TP*PP*CP does not divide);
- a TP group stays inside one node (TP all-reduces run on every layer; across nodes they
  would run over the network);
- colocated engines run on the trainer's devices, so they may not need more of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from milepost.core.config import Recipe
from milepost.core.plan.arch import Architecture
from milepost.core.quant.modes import int4_dtype


@dataclass(frozen=True)
class Problem:
    """Why a recipe cannot run as written, and what to change."""

    reason: str
    fix: str


@dataclass(frozen=True)
class TrainLayout:
    backend: str
    num_ranks: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    recompute: str = "none"
    precision: str = "fp32"
    micro_batch_tokens: int = 1  # tokens of one micro-batch (before CP splits it)
    seq_tokens: int = 1  # longest sample: prompt + response
    tokens_per_step: int = 1  # every sample of a step at its longest
    lora_rank: int = 0  # train.lora: grads and optimizer state are the adapter's only (0: off)
    lora_targets: tuple[str, ...] = ()

    @property
    def dp(self) -> int:
        return max(1, self.num_ranks // (self.tp * self.pp * self.cp))

    @property
    def edp(self) -> int:
        """Expert data-parallel size: the group the distributed optimizer shards expert state over."""
        return max(1, self.num_ranks // (self.etp * self.ep * self.pp))

    @property
    def num_microbatches(self) -> int:
        return max(1, math.ceil(self.tokens_per_step / (self.dp * self.micro_batch_tokens)))


@dataclass(frozen=True)
class Roles:
    device: str  # "gpu" or "cpu"
    placement: str
    trainer_devices: int
    num_engines: int
    engine_tp: int
    gpus_per_node: int
    nodes_available: int

    @property
    def engine_devices(self) -> int:
        return self.num_engines * self.engine_tp

    @property
    def total_devices(self) -> int:
        if self.placement in ("colocated", "shared"):
            return max(self.trainer_devices, self.engine_devices)
        return self.trainer_devices + self.engine_devices

    @property
    def nodes_needed(self) -> int:
        return math.ceil(self.total_devices / self.gpus_per_node) if self.gpus_per_node else 1


def train_layout(recipe: Recipe) -> TrainLayout:
    t, r = recipe.train, recipe.rollout
    seq = r.max_prompt_tokens + r.max_new_tokens
    per_step = r.prompts_per_step * r.num_samples_per_prompt * seq
    lora: dict[str, Any] = dict(lora_rank=t.lora.rank, lora_targets=tuple(t.lora.target_modules)) if t.lora else {}
    if t.backend == "torch":  # DDP: whole model on every rank, fp32 parameters
        return TrainLayout(backend="torch", num_ranks=t.num_ranks, precision="fp32",
                           micro_batch_tokens=t.micro_batch_size * seq, seq_tokens=seq, tokens_per_step=per_step,
                           **lora)
    m = t.megatron
    on_gpu = roles(recipe).device == "gpu"
    int4_bf16 = recipe.precision.train == "int4_qat" and int4_dtype("megatron", on_gpu) == "bfloat16"
    return TrainLayout(
        backend="megatron", num_ranks=t.num_ranks, tp=m.tensor_parallel, pp=m.pipeline_parallel,
        vpp=m.virtual_pipeline, cp=m.context_parallel, ep=m.expert_parallel,
        etp=m.expert_tensor_parallel or m.tensor_parallel, sequence_parallel=m.sequence_parallel,
        distributed_optimizer=m.distributed_optimizer, recompute=m.recompute,
        # fp8 keeps bf16 parameters and fp32 masters (megatron/fp8.py): bf16's memory, activations included;
        # so does int4_qat on GPUs (quant/modes.py int4_dtype)
        precision="bf16" if recipe.precision.train in ("bf16", "fp8") or int4_bf16 else "fp32",
        micro_batch_tokens=m.micro_batch_tokens, seq_tokens=seq, tokens_per_step=per_step, **lora)


def roles(recipe: Recipe) -> Roles:
    c = recipe.cluster
    gpus = c.slurm.gpus_per_node
    # The local executor runs every stage on this one machine, whatever num_nodes says.
    nodes = c.num_nodes if c.executor == "slurm" else 1
    return Roles(device="gpu" if gpus else "cpu", placement=c.placement, trainer_devices=recipe.train.num_ranks,
                 num_engines=recipe.rollout.num_engines, engine_tp=recipe.rollout.engine_tensor_parallel,
                 gpus_per_node=gpus, nodes_available=nodes)


def _tp_rules(arch: Architecture, tp: int, key: str, engine: bool) -> list[Problem]:
    out = []
    if arch.num_heads % tp:
        ok = [d for d in range(1, arch.num_heads + 1) if arch.num_heads % d == 0 and d <= 64]
        out.append(Problem(f"{key}={tp} does not divide the {arch.num_heads} attention heads of {arch.name}",
                           f"set {key} to one of {ok}"))
    elif not arch.is_mla and arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        out.append(Problem(f"{key}={tp} is neither a divisor nor a multiple of the {arch.num_kv_heads} KV heads "
                           f"of {arch.name} (KV heads are split over TP, or replicated when TP exceeds them)",
                           f"set {key} to a divisor or multiple of {arch.num_kv_heads}"))
    if not engine and arch.intermediate_size % tp and len(arch.moe_layers) < arch.num_layers:
        out.append(Problem(f"{key}={tp} does not divide the MLP hidden size {arch.intermediate_size}",
                           f"set {key} to a divisor of {arch.intermediate_size}"))
    return out


def _node_rule(size: int, gpus: int, key: str, allow_multinode: bool) -> list[Problem]:
    if not gpus or (size <= gpus and gpus % size == 0) or (allow_multinode and size % gpus == 0):
        return []
    where = "fit inside one node" if not allow_multinode else "fit inside one node or span whole nodes"
    return [Problem(f"{key}={size} does not {where} of cluster.slurm.gpus_per_node={gpus}",
                    f"set {key} to a divisor of {gpus}" + (f" or a multiple of {gpus}" if allow_multinode else "")
                    + ("" if allow_multinode else "; scale across nodes with pipeline, expert or data parallelism"))]


def check_trainer(arch: Architecture, lay: TrainLayout, gpus_per_node: int) -> list[Problem]:
    if lay.backend == "torch":
        return []
    p = "train.megatron."
    out = _tp_rules(arch, lay.tp, p + "tensor_parallel", engine=False)
    if arch.num_layers % lay.pp:
        ok = [d for d in range(1, arch.num_layers + 1) if arch.num_layers % d == 0]
        out.append(Problem(f"{p}pipeline_parallel={lay.pp} does not divide the {arch.num_layers} layers of "
                           f"{arch.name}", f"set {p}pipeline_parallel to one of {ok}"))
    elif lay.vpp is not None and (lay.pp < 2 or (arch.num_layers // lay.pp) % lay.vpp):
        per_stage = arch.num_layers // lay.pp
        options = [d for d in range(2, per_stage + 1) if per_stage % d == 0] if lay.pp >= 2 else []
        out.append(Problem(f"{p}virtual_pipeline={lay.vpp} needs pipeline_parallel >= 2 and must divide the "
                           f"{per_stage} layers per pipeline stage",
                           f"set {p}virtual_pipeline to " + (f"one of {options}, or null" if options else "null")))
    if not arch.is_moe and lay.ep > 1:
        out.append(Problem(f"{p}expert_parallel={lay.ep} but {arch.name} is a dense model (no experts)",
                           f"set {p}expert_parallel to 1"))
    if arch.is_moe:
        if arch.num_experts % lay.ep:
            out.append(Problem(f"{p}expert_parallel={lay.ep} does not divide the {arch.num_experts} experts",
                               f"set {p}expert_parallel to a divisor of {arch.num_experts}"))
        if arch.expert_intermediate_size % lay.etp:
            out.append(Problem(f"expert tensor parallel {lay.etp} does not divide the expert hidden size "
                               f"{arch.expert_intermediate_size}", f"set {p}expert_tensor_parallel to a divisor"))
        grid = lay.etp * lay.ep * lay.pp
        if lay.num_ranks % grid:
            out.append(Problem(f"train.num_ranks={lay.num_ranks} is not a multiple of expert_tensor_parallel*"
                               f"expert_parallel*pipeline_parallel={lay.etp}*{lay.ep}*{lay.pp}={grid}",
                               f"set train.num_ranks to a multiple of {grid} or lower expert_parallel"))
    if lay.micro_batch_tokens < lay.seq_tokens:
        out.append(Problem(f"{p}micro_batch_tokens={lay.micro_batch_tokens} is below one sample's "
                           f"{lay.seq_tokens} tokens (rollout.max_prompt_tokens + max_new_tokens)",
                           f"raise {p}micro_batch_tokens to at least {lay.seq_tokens}"))
    return out + _node_rule(lay.tp, gpus_per_node, p + "tensor_parallel", allow_multinode=False)


def check_roles(arch: Architecture, r: Roles) -> list[Problem]:
    out = _tp_rules(arch, r.engine_tp, "rollout.engine_tensor_parallel", engine=True)
    out += _node_rule(r.engine_tp, r.gpus_per_node, "rollout.engine_tensor_parallel", allow_multinode=True)
    if r.placement in ("colocated", "shared") and r.engine_devices > r.trainer_devices:
        out.append(Problem(
            f"{r.placement} engines run on the trainer's {r.trainer_devices} devices, but rollout.num_engines * "
            f"engine_tensor_parallel = {r.num_engines}*{r.engine_tp} = {r.engine_devices}",
            f"set rollout.num_engines to at most {r.trainer_devices // r.engine_tp}, or cluster.placement: "
            "disaggregated"))
    if r.device == "gpu" and r.nodes_needed > r.nodes_available:
        out.append(Problem(
            f"{r.total_devices} GPUs are needed ({r.placement}) = {r.nodes_needed} nodes of {r.gpus_per_node}, "
            f"but {r.nodes_available} node(s) are available",
            f"set cluster.num_nodes to {r.nodes_needed} (with cluster.executor: slurm; the local executor has "
            "one machine), or use fewer trainer ranks / engines"))
    return out


# What core/train/megatron/model.py builds (a test keeps the two equal; not imported: it needs torch).
MEGATRON_BUILDS = ("qwen2", "qwen3", "qwen3_moe", "llama")


def role_notes(recipe: Recipe, lay: TrainLayout, r: Roles, arch: Architecture) -> list[str]:
    """Things that run but are probably not what was meant, or not yet."""
    notes = []
    if lay.backend == "megatron" and arch.model_type not in MEGATRON_BUILDS:
        notes.append(f"the Megatron backend does not build `{arch.model_type}` models yet (it builds "
                     f"{', '.join(MEGATRON_BUILDS)}): this recipe is planned, not runnable, in this version")
    if r.placement in ("colocated", "shared") and r.engine_devices < r.trainer_devices:
        notes.append(f"only {r.engine_devices} of the {r.trainer_devices} trainer devices host an engine")
    if r.device == "gpu" and r.nodes_needed * r.gpus_per_node > r.total_devices:
        notes.append(f"{r.nodes_needed * r.gpus_per_node - r.total_devices} GPU(s) of the allocation stay idle")
    if r.device == "gpu" and r.nodes_available > r.nodes_needed:
        notes.append(f"cluster.num_nodes={r.nodes_available} but the layout needs {r.nodes_needed}")
    if lay.backend == "torch" and recipe.train.megatron != type(recipe.train.megatron)():
        notes.append("train.megatron is set but train.backend is torch: the layout there is ignored")
    if lay.backend == "torch" and recipe.precision.train != "fp32":
        notes.append(f"the torch backend keeps fp32 parameters with precision.train {recipe.precision.train} "
                     "(bf16: autocast; int4_qat: fake-quantised in the forward): planned at fp32")
    if lay.backend == "megatron" and lay.sequence_parallel and lay.tp == 1:
        notes.append("sequence_parallel has no effect with tensor_parallel 1")
    if r.placement == "disaggregated" and recipe.sync.transport == "tensor":
        notes.append("sync.transport tensor shares /dev/shm buffers (one node); disaggregated runs usually "
                     "use `distributed`")
    return notes
