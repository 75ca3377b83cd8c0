"""Estimated memory per device of the trainer and the engines, each line with its formula.

These are estimates for planning (expect +-20 %), written so a reader can redo them by hand:
- weights: parameters on the rank x bytes of the precision;
- grads: Megatron keeps fp32 main grads (Megatron-LM's bf16 default, grad_reduce_in_fp32);
  the torch backend's grads have the parameters' dtype (fp32);
- optimizer: Adam's two moments in fp32, plus an fp32 master copy when parameters are bf16;
  the distributed optimizer shards it over data parallel (expert state over expert-data parallel);
- activations (Korthikanti et al. 2022, "Reducing Activation Recomputation", with fused/flash
  attention so no s^2 score matrix is kept): per layer, the tensors its backward reads, for one
  micro-batch of s tokens; the first pipeline stage holds `in-flight` micro-batches of them (1F1B:
  PP; interleaved: PP*(1 + (PP-1)/(PP*VPP))), `full` recompute keeps only each layer's input plus
  one layer's working set; `selective` recompute re-runs core attention, which fused attention
  does not keep anyway, so it equals `none` here. The last stage adds fp32 logits + softmax;
- engine KV cache: max_batch_size x (max_prompt_tokens + max_new_tokens) tokens x bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from milepost.core.plan.arch import Architecture
from milepost.core.plan.layout import TrainLayout

GB = 1e9
BYTES = {"bf16": 2, "fp32": 4}
# An engine's bytes per parameter of its decoder layers and per KV element by precision.rollout
# (core/quant/modes.py): int4 keeps the pushed weights (the built-in engine's landing buffers,
# fp32, or bf16 where the trainer computes int4_qat in bf16: "int4-bf16", modes.int4_dtype)
# beside int4 values (0.5 B) and fp32 scales (4 B per 128); fp8 holds e4m3 values and
# one fp32 scale per 128 x 128. Embeddings and the output head stay in the engine's dtype
# (ENGINE_EMBEDDING_BYTES); the layers' norms and biases are counted with the layers (a few
# thousandths of them).
ENGINE_WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "int4": 4.0 + 0.5 + 4 / 128, "int4-bf16": 2.0 + 0.5 + 4 / 128,
                       "fp8": 1.0 + 4 / 128**2}
ENGINE_EMBEDDING_BYTES = {"fp32": 4, "bf16": 2, "int4": 4, "int4-bf16": 2, "fp8": 2}
ENGINE_KV_BYTES = {"fp32": 4, "bf16": 2, "int4": 4, "int4-bf16": 2, "fp8": 2}


@dataclass(frozen=True)
class MemoryItem:
    name: str
    bytes: float
    formula: str


def count_text(x: float) -> str:
    """A count as people write it: 4.10e9 -> `4.10 B`."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f}"


def stage_layers(num_layers: int, pp: int, vpp: int | None, stage: int) -> list[int]:
    """Layers held by pipeline rank `stage`: one contiguous block, or with a virtual pipeline the
    chunks stage, stage+PP, stage+2PP, ... of VPP*PP equal chunks (Megatron's interleaving)."""
    chunks = pp * (vpp or 1)
    per_chunk = num_layers // chunks
    return [i for c in range(stage, chunks, pp) for i in range(c * per_chunk, (c + 1) * per_chunk)]


def layer_activation_elements(arch: Architecture, layer: int, s: float, lay: TrainLayout) -> float:
    """Elements one layer keeps for backward for a micro-batch of `s` tokens on one rank."""
    h, tp = arch.hidden_size, lay.tp
    sp = tp if lay.sequence_parallel else 1  # norm/linear inputs are split over TP only with SP
    if arch.is_mla:
        qk = arch.qk_nope_head_dim + arch.qk_rope_head_dim
        attn = (2 * s * h / sp + s * (2 * arch.q_lora_rank + 2 * arch.kv_lora_rank + arch.qk_rope_head_dim)
                + s * arch.num_heads * (2 * qk + 2 * arch.v_head_dim) / tp)
    else:
        kv_heads = arch.num_kv_heads / tp if arch.num_kv_heads >= tp else 1
        attn = 2 * s * h / sp + s * (2 * arch.num_heads / tp + 2 * kv_heads) * arch.head_dim
    if layer not in arch.moe_layers:
        return attn + 2 * s * h / sp + 3 * s * arch.intermediate_size / tp
    routed = s / sp * arch.experts_per_token * lay.etp  # token copies reaching this rank's experts
    return (attn + 2 * s * h / sp + s / sp * arch.num_experts
            + routed * (2 * h + 3 * arch.expert_intermediate_size / lay.etp)
            + 3 * s * arch.shared_expert_intermediate_size / tp)


def _in_flight(lay: TrainLayout, stage: int) -> float:
    """Micro-batches whose activations stage `stage` holds at the peak of the schedule."""
    if lay.pp == 1:
        return 1.0
    v = lay.vpp or 1
    chunks = (lay.pp - stage - 1) * 2 + (v - 1) * lay.pp + 1 if v > 1 else lay.pp - stage
    return min(chunks, lay.num_microbatches * v) / v


def trainer_memory(arch: Architecture, lay: TrainLayout, stage: int) -> list[MemoryItem]:
    """Memory of one trainer rank of pipeline stage `stage`."""
    tp, pp = lay.tp, lay.pp
    layers = stage_layers(arch.num_layers, pp, lay.vpp, stage) if lay.backend == "megatron" \
        else list(range(arch.num_layers))
    dense = expert = 0
    for i in layers:
        d, e = arch.layer_params(i, tp, lay.ep, lay.etp)
        dense, expert = dense + d, expert + e
    first, last = stage == 0, stage == pp - 1
    embed = arch.embedding_params(tp)
    # pp=1: one copy if tied. pp>1: the last stage keeps its own copy of a tied embedding.
    dense += embed * (int(first) + int(last and (not arch.tied_embeddings or pp > 1)))
    dense += arch.hidden_size if last else 0  # final norm
    params = dense + expert
    pb = BYTES[lay.precision]
    shown = f"{count_text(dense)} dense" + (f" + {count_text(expert)} expert" if expert else "") + " params"
    items = [MemoryItem("weights", params * pb, f"{shown} x {pb} B ({lay.precision})")]
    if lay.lora_rank:  # only the adapter trains (replicated on TP ranks): its grads and optimizer state
        return items + lora_memory(arch, lay, layers) + _activations_and_logits(arch, lay, stage, layers)
    items.append(MemoryItem("grads", params * 4, f"{count_text(params)} params x 4 B (fp32 grads)"))
    opt_b = 12 if lay.precision == "bf16" else 8
    what = "fp32 master + m + v" if opt_b == 12 else "fp32 m + v"
    if lay.distributed_optimizer:
        shard_d, shard_e = lay.dp * lay.cp, lay.edp
        opt = opt_b * (dense / shard_d + expert / shard_e)
        f = f"{opt_b} B ({what}) x ({count_text(dense)} / DP*CP {shard_d}" + (
            f" + {count_text(expert)} / expert-DP {shard_e})" if expert else ")") + " (distributed optimizer)"
    else:
        opt, f = opt_b * params, f"{count_text(params)} params x {opt_b} B ({what}), replicated over DP"
    items.append(MemoryItem("optimizer", opt, f))
    return items + _activations_and_logits(arch, lay, stage, layers)


def _activations_and_logits(arch: Architecture, lay: TrainLayout, stage: int, layers: list[int]) -> list[MemoryItem]:
    items = [_activations(arch, lay, stage, layers)]
    if stage == lay.pp - 1:
        s = lay.micro_batch_tokens / lay.cp
        items.append(MemoryItem("logits", s * arch.vocab_size / lay.tp * 8, f"{count_text(s)} tokens x vocab "
                                f"{arch.vocab_size} / TP {lay.tp} x 8 B (fp32 logits + softmax)"))
    return items


def lora_memory(arch: Architecture, lay: TrainLayout, layers: list[int]) -> list[MemoryItem]:
    """train.lora: r x (in + out) parameters per adapted Linear of each layer (in the model's
    precision, as the backends hold them), their fp32 grads and Adam's state (an fp32 master
    copy too under bf16); the base's grads and optimizer state do not exist."""
    q, kv, h = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size
    f = arch.intermediate_size
    dims = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h, "gate_proj": h + f,
            "up_proj": h + f, "down_proj": f + h}
    per_layer = lay.lora_rank * sum(dims.get(t, 0) for t in lay.lora_targets)
    n = per_layer * len(layers)
    what = f"{count_text(n)} adapter params (rank {lay.lora_rank}, {len(lay.lora_targets)} targets)"
    pb, opt_b = BYTES[lay.precision], 12 if lay.precision == "bf16" else 8
    return [MemoryItem("adapter", n * pb, f"{what} x {pb} B ({lay.precision})"),
            MemoryItem("grads", n * 4, f"{what} x 4 B (fp32 grads; the base has none)"),
            MemoryItem("optimizer", n * opt_b, f"{what} x {opt_b} B (Adam state; the base has none)")]


def _activations(arch: Architecture, lay: TrainLayout, stage: int, layers: list[int]) -> MemoryItem:
    ab = BYTES[lay.precision] if lay.backend == "megatron" else 4
    s = lay.micro_batch_tokens / lay.cp
    if not layers:  # a layout with more pipeline chunks than layers (refused by the checks)
        return MemoryItem("activations", 0.0, "no layers on this stage")
    per_layer = [layer_activation_elements(arch, i, s, lay) * ab for i in layers]
    flight = _in_flight(lay, stage)
    head = f"{count_text(s)} tokens/micro-batch" + (f" (/CP {lay.cp})" if lay.cp > 1 else "")
    if lay.recompute == "full":
        sp = lay.tp if lay.sequence_parallel else 1
        kept = len(layers) * s * arch.hidden_size / sp * ab * flight
        total = kept + max(per_layer)
        return MemoryItem("activations", total,
                          f"full recompute: {len(layers)} layer inputs x {head} x h {arch.hidden_size}"
                          f"{f' / SP {sp}' if sp > 1 else ''} x {ab} B x {flight:.2f} in flight"
                          f" + one layer's working set {max(per_layer) / GB:.2f} GB")
    return MemoryItem("activations", sum(per_layer) * flight,
                      f"{len(layers)} layers x {sum(per_layer) / len(layers) / GB:.3f} GB/layer ({head}, "
                      f"{ab} B, TP {lay.tp}{' +SP' if lay.sequence_parallel else ''}) x {flight:.2f} in flight")


def engine_memory(arch: Architecture, tp: int, precision: str, max_batch: int, seq_tokens: int) -> list[MemoryItem]:
    """Memory of one device of an engine with tensor parallel `tp` (experts split over TP too),
    serving `precision` (a precision.rollout mode)."""
    layers = sum(sum(arch.layer_params(i, tp, 1, tp)) for i in range(arch.num_layers))
    embeddings = arch.embedding_params(tp) * (1 if arch.tied_embeddings else 2) + arch.hidden_size  # + final norm
    pb, eb = ENGINE_WEIGHT_BYTES[precision], ENGINE_EMBEDDING_BYTES[precision]
    per_token = arch.kv_elements_per_token(tp) * ENGINE_KV_BYTES[precision]
    tokens = max_batch * seq_tokens
    kind = "MLA latent" if arch.is_mla else "K+V"
    return [MemoryItem("engine weights", layers * pb + embeddings * eb,
                       f"({count_text(layers)} layer x {pb:.3g} B + {count_text(embeddings)} embedding params x "
                       f"{eb} B) on the rank (engine TP {tp}, {precision})"),
            MemoryItem("engine KV cache", tokens * per_token,
                       f"{max_batch} seqs x {seq_tokens} tokens x {per_token:,} B/token ({kind}, TP {tp})")]
