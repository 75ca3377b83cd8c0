"""`milepost plan`: devices per role, parallel layout and memory per device of a recipe, checked.

A plan is refused (problems listed, each with its fix) when the layout does not divide the
model or a device's estimated peak exceeds `cluster.gpu_memory_gb`. Peaks per device:
- colocated: training (engines asleep, their memory released) = trainer state + activations;
  rollout = trainer state (it stays resident) + engine weights + KV cache;
- disaggregated: the trainer's devices and the engines' devices separately.
Each adds a reserve for what the estimate leaves out (CUDA context, NCCL buffers, allocator
fragmentation, CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from milepost.core.config import Recipe
from milepost.core.plan.arch import Architecture
from milepost.core.plan.catalog import catalog_mismatch, resolve_architecture
from milepost.core.plan.layout import (
    Problem,
    Roles,
    TrainLayout,
    check_roles,
    check_trainer,
    role_notes,
    roles,
    train_layout,
)
from milepost.core.plan.memory import GB, MemoryItem, count_text, engine_memory, trainer_memory
from milepost.core.quant.modes import int4_dtype

# Share of GPU memory set aside for what the estimate leaves out: CUDA context (~0.5-1 GB), NCCL
# buffers, allocator fragmentation, CUDA graphs. An allowance, not a measurement.
RESERVE_FRACTION = 0.08


@dataclass
class Phase:
    name: str
    items: list[MemoryItem]
    reserve_bytes: float

    @property
    def total_bytes(self) -> float:
        return sum(i.bytes for i in self.items) + self.reserve_bytes


@dataclass
class Plan:
    arch: Architecture
    source: str
    layout: TrainLayout
    roles: Roles
    trainer_stage: int
    trainer_items: list[MemoryItem]
    engine_items: list[MemoryItem]
    phases: list[Phase]
    gpu_memory_gb: float
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _worst_stage(arch: Architecture, lay: TrainLayout) -> tuple[int, list[MemoryItem]]:
    stages = range(lay.pp) if lay.backend == "megatron" else range(1)
    if lay.backend == "megatron" and arch.num_layers % (lay.pp * (lay.vpp or 1)):
        stages = range(1)  # the layout is refused anyway; plan stage 0 so memory still prints
    candidates = [(s, trainer_memory(arch, lay, s)) for s in stages]
    return max(candidates, key=lambda c: sum(i.bytes for i in c[1]))


def _phases(r: Roles, trainer: list[MemoryItem], engine: list[MemoryItem], reserve: float) -> list[Phase]:
    if r.placement == "disaggregated":
        return [Phase("trainer device", trainer, reserve), Phase("engine device", engine, reserve)]
    if r.placement == "shared":  # nothing is handed over: the trainer's step beside a resident engine
        return [Phase("training beside the engines", trainer + engine, reserve)]
    static = [i for i in trainer if i.name in ("weights", "adapter", "grads", "optimizer")]
    return [Phase("training (engines asleep)", trainer, reserve),
            Phase("rollout (trainer state resident)", static + engine, reserve)]


def _memory_fix(phase: Phase, lay: TrainLayout, r: Roles) -> str:
    biggest = max(phase.items, key=lambda i: i.bytes).name
    if biggest == "optimizer" and lay.backend == "megatron" and not lay.distributed_optimizer:
        fix = "set train.megatron.distributed_optimizer: true"
    elif biggest in ("activations", "logits"):
        fix = ("set train.megatron.recompute: full or lower train.megatron.micro_batch_tokens"
               if lay.backend == "megatron" else "lower train.micro_batch_size")
    elif biggest == "engine KV cache":
        fix = "lower rollout.max_batch_size or raise rollout.engine_tensor_parallel"
    elif biggest == "engine weights":
        fix = "raise rollout.engine_tensor_parallel"
    elif lay.backend == "torch":
        fix = "use train.backend: megatron with tensor/pipeline parallelism (the torch backend replicates the model)"
    else:
        fix = "raise train.megatron tensor_parallel / pipeline_parallel / expert_parallel (more ranks if needed)"
    if r.placement == "colocated" and phase.name.startswith("rollout"):
        fix += ", or cluster.placement: disaggregated"
    if r.placement == "shared":
        fix += ", or cluster.placement: colocated (engines give their memory back while the trainer steps)"
    return fix + ", or a GPU with more memory (cluster.gpu_memory_gb)"


def make_plan(recipe: Recipe) -> Plan:
    """Plan `recipe`. Raises ValueError when the model's architecture cannot be found."""
    arch, source = resolve_architecture(recipe.model)
    lay, r = train_layout(recipe), roles(recipe)
    stage, trainer = _worst_stage(arch, lay)
    precision: str = recipe.precision.rollout  # the built-in engine serves it on a CPU too (--dtype, --quantization)
    if precision == "int4" and int4_dtype(recipe.train.backend, r.device == "gpu") == "bfloat16":
        precision = "int4-bf16"  # its landing weights in the trainer's bf16 (memory.py)
    engine = engine_memory(arch, r.engine_tp, precision, recipe.rollout.max_batch_size, lay.seq_tokens)
    gpu_gb = recipe.cluster.gpu_memory_gb
    reserve = RESERVE_FRACTION * gpu_gb * GB if r.device == "gpu" else 0.0
    phases = _phases(r, trainer, engine, reserve)
    problems = check_trainer(arch, lay, r.gpus_per_node) + check_roles(arch, r)
    if r.device == "gpu":
        for ph in phases:
            if ph.total_bytes > gpu_gb * GB:
                problems.append(Problem(
                    f"{ph.name}: an estimated {ph.total_bytes / GB:.1f} GB per GPU does not fit in "
                    f"cluster.gpu_memory_gb={gpu_gb:g}", _memory_fix(ph, lay, r)))
    notes = role_notes(recipe, lay, r, arch)
    mismatch = catalog_mismatch(recipe.model, arch)
    if mismatch:
        notes.append(mismatch)
    if r.device == "cpu":
        notes.append("no GPUs (cluster.slurm.gpus_per_node 0): memory is host RAM and is not checked")
    return Plan(arch, source, lay, r, stage, trainer, engine, phases, gpu_gb, problems, notes)


def _gb(b: float) -> str:
    return f"{b / GB:8.2f} GB" if b >= 0.01 * GB else f"{b / 1e6:8.2f} MB"


def format_plan(plan: Plan, recipe_name: str) -> str:
    a, lay, r = plan.arch, plan.layout, plan.roles
    kind = (f"MoE {a.num_experts} experts, top-{a.experts_per_token}" if a.is_moe else "dense") + (
        ", MLA" if a.is_mla else f", {a.num_heads} heads / {a.num_kv_heads} KV heads")
    lines = [f"plan of {recipe_name}",
             f"model      {a.name} ({a.model_type}; {kind}; {a.num_layers} layers): "
             f"{count_text(a.total_params())} params, {count_text(a.active_params())} active",
             f"           architecture from {plan.source}"]
    dev = "GPUs" if r.device == "gpu" else "CPU processes"
    if r.device == "gpu":
        lines.append(f"cluster    {r.nodes_needed} node(s) x {r.gpus_per_node} GPUs of {plan.gpu_memory_gb:g} GB "
                     f"({r.nodes_available} available), placement {r.placement}")
    else:
        lines.append(f"cluster    one machine, CPU only, placement {r.placement}")
    if lay.backend == "megatron":
        par = (f"TP {lay.tp} x PP {lay.pp}{f' (VPP {lay.vpp})' if lay.vpp else ''} x CP {lay.cp} x DP {lay.dp}"
               + (f"; EP {lay.ep}, expert-TP {lay.etp}, expert-DP {lay.edp}" if a.is_moe else "")
               + f"; {lay.num_microbatches} micro-batches of {lay.micro_batch_tokens} tokens per step")
    else:
        par = f"DDP x {lay.num_ranks} (whole model per rank)"
    shared = " (the trainer's)" if r.placement in ("colocated", "shared") else ""
    lines += [f"trainer    {r.trainer_devices} {dev}, {lay.backend} {lay.precision}: {par}",
              f"engines    {r.num_engines} x TP {r.engine_tp} = {r.engine_devices} {dev}{shared}",
              f"memory per device, trainer pipeline stage {plan.trainer_stage} (the largest):"]
    for it in plan.trainer_items + plan.engine_items:
        lines.append(f"  {it.name:<16}{_gb(it.bytes)}  = {it.formula}")
    if r.device == "gpu":
        lines.append(f"  {'reserve':<16}{_gb(plan.phases[0].reserve_bytes)}  = {RESERVE_FRACTION:.0%} of "
                     f"{plan.gpu_memory_gb:g} GB (CUDA context, NCCL, fragmentation)")
    for ph in plan.phases:
        verdict = "" if r.device == "cpu" else (
            f"  ({ph.total_bytes / (plan.gpu_memory_gb * GB):.0%} of {plan.gpu_memory_gb:g} GB)")
        lines.append(f"  peak, {ph.name}: {ph.total_bytes / GB:.2f} GB = "
                     f"{' + '.join(i.name for i in ph.items)}{' + reserve' if ph.reserve_bytes else ''}{verdict}")
    lines += [f"note       {n}" for n in plan.notes]
    if plan.ok:
        lines.append("verdict    fits: the layout divides and every device's estimate is within its memory")
    else:
        lines.append("verdict    REFUSED:")
        lines += [f"  - {p.reason}\n    fix: {p.fix}" for p in plan.problems]
    return "\n".join(lines)
