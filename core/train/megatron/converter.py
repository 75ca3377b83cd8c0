"""HF safetensors <-> megatron-core `GPTModel` state, streaming one tensor at a time.

Name mapping (megatron global name <- HF names), layer L, expert E:
  embedding.word_embeddings.weight               <- model.embed_tokens.weight      (vocab rows, TP dim 0)
  output_layer.weight                            <- lm_head.weight (embed_tokens when tied)
  decoder.final_layernorm.weight                 <- model.norm.weight
  decoder.layers.L.input_layernorm.weight        <- model.layers.L.input_layernorm.weight
  decoder.layers.L.self_attention.linear_qkv.*   <- self_attn.{q,k,v}_proj.*  (fused per query group)
  decoder.layers.L.self_attention.{q,k}_layernorm.weight <- self_attn.{q,k}_norm.weight (Qwen3)
  decoder.layers.L.self_attention.linear_proj.weight     <- self_attn.o_proj.weight (TP dim 1)
  decoder.layers.L.pre_mlp_layernorm.weight      <- post_attention_layernorm.weight
  decoder.layers.L.mlp.linear_fc1.weight         <- mlp.{gate,up}_proj.weight (each TP shard: [gate_r; up_r])
  decoder.layers.L.mlp.linear_fc2.weight         <- mlp.down_proj.weight (TP dim 1)
  decoder.layers.L.mlp.router.weight             <- mlp.gate.weight (Qwen3-MoE, replicated)
  decoder.layers.L.mlp.experts.local_experts.E.linear_fc{1,2}.weight <- mlp.experts.E.{gate,up,down}_proj.weight

Fused QKV layout (megatron): for each query group g, [q heads of g; k_g; v_g] stacked on dim 0,
so a TP shard is a contiguous block of whole groups. The vocabulary is padded to a multiple
of the TP size with zero rows that export drops. Every transform copies or views the values
unchanged, so HF -> megatron -> HF is bit-exact in the model's dtype.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from milepost.core.train.megatron.model import ModelSpec

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
SIMPLE_LAYER = {  # megatron suffix -> (kind, HF suffix)
    "input_layernorm.weight": ("replicated", "input_layernorm.weight"),
    "self_attention.q_layernorm.weight": ("replicated", "self_attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": ("replicated", "self_attn.k_norm.weight"),
    "self_attention.linear_proj.weight": ("row", "self_attn.o_proj.weight"),
    "pre_mlp_layernorm.weight": ("replicated", "post_attention_layernorm.weight"),
    "mlp.linear_fc2.weight": ("row", "mlp.down_proj.weight"),
    "mlp.router.weight": ("replicated", "mlp.gate.weight"),
}


@dataclass(frozen=True)
class Mapping:
    """How one megatron tensor is made of HF tensors. kind: replicated | row (TP dim 1) |
    column (TP dim 0) | vocab (column, padded) | qkv | fc1 (gated: gate and up)."""

    kind: str
    hf_names: tuple[str, ...]


def mapping_for(name: str, spec: ModelSpec) -> Mapping:
    """The mapping of a megatron *global* name (global layer and expert indices)."""
    if name == "embedding.word_embeddings.weight":
        return Mapping("vocab", ("model.embed_tokens.weight",))
    if name == "output_layer.weight":
        return Mapping("vocab", ("model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight",))
    if name == "decoder.final_layernorm.weight":
        return Mapping("replicated", ("model.norm.weight",))
    m = LAYER.match(name)
    if m is None:
        raise KeyError(f"megatron tensor {name} has no HF counterpart (converter out of date?)")
    hf = f"model.layers.{m.group(1)}."
    rest = m.group(2)
    if rest in SIMPLE_LAYER:
        kind, suffix = SIMPLE_LAYER[rest]
        return Mapping(kind, (hf + suffix,))
    if rest.startswith("self_attention.linear_qkv."):
        part = rest.rsplit(".", 1)[1]  # weight | bias
        return Mapping("qkv", tuple(f"{hf}self_attn.{p}_proj.{part}" for p in "qkv"))
    if rest == "mlp.linear_fc1.weight":
        return Mapping("fc1", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"))
    e = EXPERT.match(rest)
    if e is not None:
        base = f"{hf}mlp.experts.{e.group(1)}."
        if e.group(2) == "linear_fc1":
            return Mapping("fc1", (base + "gate_proj.weight", base + "up_proj.weight"))
        return Mapping("row", (base + "down_proj.weight",))
    raise KeyError(f"megatron tensor {name} has no HF counterpart (converter out of date?)")


def _qkv_groups(spec: ModelSpec) -> tuple[int, int]:
    """(rows per query group in the fused tensor, q rows of one group)."""
    q_rows = spec.num_heads // spec.num_query_groups * spec.head_dim
    return q_rows + 2 * spec.head_dim, q_rows


def to_megatron(mapping: Mapping, hf: list[torch.Tensor], spec: ModelSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's shard of the megatron tensor built from the HF tensors (in hf_names order)."""
    kind = mapping.kind
    if kind == "replicated":
        return hf[0]
    if kind == "row":
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if kind == "column":
        return hf[0].chunk(tp_size, dim=0)[tp_rank]
    if kind == "vocab":
        t = hf[0]
        pad = spec.padded_vocab_size - t.shape[0]
        if pad:
            t = torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))])
        return t.chunk(tp_size, dim=0)[tp_rank]
    if kind == "fc1":
        return torch.cat([t.chunk(tp_size, dim=0)[tp_rank] for t in hf])
    if kind == "qkv":
        q, k, v = hf
        g = spec.num_query_groups
        tail = tuple(q.shape[1:])
        fused = torch.cat([q.reshape((g, -1) + tail), k.reshape((g, -1) + tail), v.reshape((g, -1) + tail)], dim=1)
        return fused.chunk(tp_size, dim=0)[tp_rank].reshape((-1,) + tail)
    raise AssertionError(kind)


def to_hf(mapping: Mapping, shards: list[torch.Tensor], spec: ModelSpec, views: bool = False,
          reuse: dict[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one megatron tensor, from its shards on every TP rank (in rank order).
    Each is a tensor of its own (safetensors refuses tensors that share memory), unless `views`:
    then, from one shard (TP=1), every HF tensor that is a contiguous piece of it is that piece
    (no copy), and the q/k/v split is written into `reuse`'s tensor of its name where one fits.
    Why: every weight push stages every tensor (bucket by bucket), and two copies of each
    (cat, clone) plus new addresses each time (so the CUDA sender planned again) were most of
    what Megatron's push cost beyond the transport (core/train/cuda_sender.py)."""
    kind, names = mapping.kind, mapping.hf_names
    if views and len(shards) == 1 and kind != "qkv":
        return _pieces(kind, names, shards[0], spec)
    if kind == "replicated":
        return [(names[0], shards[0])]
    if kind == "row":
        return [(names[0], torch.cat(shards, dim=1))]
    if kind == "column":
        return [(names[0], torch.cat(shards, dim=0))]
    if kind == "vocab":
        return [(names[0], torch.cat(shards, dim=0)[:spec.vocab_size].clone())]
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(names[0], torch.cat([h[0] for h in halves])), (names[1], torch.cat([h[1] for h in halves]))]
    if kind == "qkv":
        rows, q_rows = _qkv_groups(spec)
        full = shards[0] if len(shards) == 1 else torch.cat(shards, dim=0)
        tail = tuple(full.shape[1:])
        grouped = full.reshape((spec.num_query_groups, rows) + tail)
        parts = grouped.split([q_rows, spec.head_dim, spec.head_dim], dim=1)
        return [(n, _into_kept(t, (reuse or {}).get(n) if views else None)) for n, t in zip(names, parts)]
    raise AssertionError(kind)


def _pieces(kind: str, names: tuple[str, ...], shard: torch.Tensor, spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """to_hf at TP=1, as views of the one shard (every kind but qkv: its HF tensors are strided)."""
    if kind == "vocab":
        return [(names[0], shard[:spec.vocab_size])]  # rows: contiguous
    if kind == "fc1":
        gate, up = shard.chunk(2, dim=0)
        return [(names[0], gate), (names[1], up)]
    return [(names[0], shard)]


def _into_kept(part: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """One of q/k/v (`part`: [groups, rows of the group, ...]) as a contiguous [rows, ...]
    tensor: written into `kept` where it has that shape, dtype and device (so its address
    stays the same push after push), else into a new tensor."""
    shape = (part.shape[0] * part.shape[1],) + tuple(part.shape[2:])
    if kept is None or tuple(kept.shape) != shape or kept.dtype != part.dtype or kept.device != part.device:
        kept = part.new_empty(shape)
    kept.view(part.shape).copy_(part)
    return kept


# ---- model side: local names of a model chunk <-> global names ----
def global_names(chunk: Any, ep_rank: int = 0) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(local name, global name, parameter) for every parameter of one GPTModel chunk.
    Skips the tied output layer's alias (its weight is the embedding's)."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    layer_numbers = [layer.layer_number for layer in chunk.decoder.layers]
    local_experts = {}
    for i, layer in enumerate(chunk.decoder.layers):
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, SequentialMLP):
            local_experts[i] = experts.num_local_experts
    out = []
    for local, param in chunk.named_parameters():
        name = local
        m = LAYER.match(local)
        if m is not None:
            i, rest = int(m.group(1)), m.group(2)
            e = EXPERT.match(rest)
            if e is not None:
                expert = ep_rank * local_experts[i] + int(e.group(1))
                rest = rest.replace(f"local_experts.{e.group(1)}.", f"local_experts.{expert}.", 1)
            name = f"decoder.layers.{layer_numbers[i] - 1}.{rest}"
        out.append((local, name, param))
    return out


class HFReader:
    """Lazy reader of an HF checkpoint folder (single file or sharded with an index)."""

    def __init__(self, folder: str) -> None:
        from safetensors import safe_open
        root = Path(folder)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (root / "model.safetensors").is_file():
            weight_map = None
        else:
            raise FileNotFoundError(f"{folder} holds no model.safetensors(.index.json); save the model with "
                                    "save_pretrained(safe_serialization=True)")
        self._files: dict[str, Any] = {}
        self._open = lambda f: self._files.setdefault(f, safe_open(str(root / f), "pt"))
        if weight_map is None:
            self.weight_map = {k: "model.safetensors" for k in self._open("model.safetensors").keys()}  # noqa: SIM118 - a safetensors handle
        else:
            self.weight_map = weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"the HF checkpoint has no tensor {name}: does its config match its weights?")
        return self._open(self.weight_map[name]).get_tensor(name)


@torch.no_grad()
def load_hf_into(chunks: list[Any], folder: str, spec: ModelSpec, tp_rank: int, tp_size: int, ep_rank: int = 0) -> None:
    """Copy the HF checkpoint into this rank's parameters, one tensor at a time."""
    reader = HFReader(folder)
    for chunk in chunks:
        for _, name, param in global_names(chunk, ep_rank):
            mapping = mapping_for(name, spec)
            hf = [reader.get(n) for n in mapping.hf_names]
            shard = to_megatron(mapping, hf, spec, tp_rank, tp_size)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: HF {[tuple(t.shape) for t in hf]} gives {tuple(shard.shape)}, the model "
                                 f"has {tuple(param.shape)}; is the config.json the one of these weights?")
            param.data.copy_(shard)


def iter_hf_tensors(chunks: list[Any], spec: ModelSpec, gather: Callable[[torch.Tensor], list[torch.Tensor]],
                    ep_rank: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of this pipeline stage, one megatron tensor at a time. Collective:
    every rank of the TP group runs it (gather(t) returns the shards of t on every TP rank)."""
    for chunk in chunks:
        for _, name, param in global_names(chunk, ep_rank):
            mapping = mapping_for(name, spec)
            if name == "output_layer.weight" and spec.tie_embeddings:
                continue  # the last stage's copy of the embedding: exported once, from the first stage
            shards = [param.detach()] if mapping.kind == "replicated" else gather(param.detach())
            yield from to_hf(mapping, shards, spec)


def write_safetensors_shards(tensors: Iterator[tuple[str, torch.Tensor]], folder: str, prefix: str,
                             max_shard_bytes: int) -> dict[str, tuple[str, int]]:
    """Stream tensors into `<prefix>-NNNNN.safetensors` files of at most ~max_shard_bytes
    (one tensor in memory beyond the pending shard); returns name -> (file, bytes)."""
    from safetensors.torch import save_file
    written: dict[str, tuple[str, int]] = {}
    pending: dict[str, torch.Tensor] = {}
    size, index = 0, 0

    def flush() -> None:
        nonlocal pending, size, index
        if pending:
            fname = f"{prefix}-{index:05d}.safetensors"
            save_file(pending, str(Path(folder) / fname), metadata={"format": "pt"})
            written.update({k: (fname, v.numel() * v.element_size()) for k, v in pending.items()})
            pending, size, index = {}, 0, index + 1

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > max_shard_bytes:
            flush()
        pending[name] = t.detach().cpu().contiguous()
        size += nbytes
    flush()
    return written


def write_index(folder: str, written: dict[str, tuple[str, int]]) -> None:
    """model.safetensors.index.json over the shard files; a single file becomes model.safetensors
    (what HF writes for small models)."""
    root = Path(folder)
    files = sorted({f for f, _ in written.values()})
    if len(files) == 1:
        (root / files[0]).rename(root / "model.safetensors")
        return
    index = {"metadata": {"total_size": sum(n for _, n in written.values())},
             "weight_map": {k: f for k, (f, _) in sorted(written.items())}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
