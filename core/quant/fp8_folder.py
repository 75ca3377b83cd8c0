"""precision.rollout fp8 on SGLang engines: the block-wise fp8 HF folder such an engine loads,
made from an unquantised one (the base model, the trainer's exports, a checkpoint's `hf/`).

Why a folder of its own (sglang 0.5.23): SGLang serves block-wise fp8 only from a model whose
config.json declares it (`Fp8Config.from_config`: quant_method "fp8" makes the checkpoint fp8-
serialised, `weight_block_size` [128, 128] block-quantised); its linears then hold a float8
`weight` and a float32 `weight_scale_inv` (`Fp8LinearMethod.create_fp8_weight_`), and
/update_weights_from_disk reads a folder's tensors into those parameters without reading its
config again (`WeightUpdater.update_weights_from_disk`). An unquantised folder would be cast
into float8 without scales. So every folder an SGLang fp8 engine loads, at launch and from
disk (a disk push, a restarted or woken engine, a restore after a failed push), is this form
of it; pushes by tensor or distributed send the same tensors, quantised by the trainer
(core/train/weight_sender.py). The built-in engine quantises an unquantised folder itself
(core/engine/quantized.served_state) and needs no copy.

Layout: the source's safetensors files, one for one, each picked weight (`served_in_fp8`)
replaced by its e4m3 values with `X.weight_scale_inv` beside it in the same file (a sharded
source's index maps the scales too); config.json with `quantization_config`; every other
file (tokenizer, generation config) copied.

`fp8_folder` keeps the copies under one folder (the fleet's, in the campaign store), named by
the source's real path and its files' sizes and mtimes, so a rewritten source gets a new copy.
Each is written once, into a temporary folder renamed into place (a killed write leaves no
folder that looks complete), and only the newest `keep` are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from milepost.core.quant.fp8 import BLOCK, QUANTIZATION_CONFIG, quantize_state_fp8, scale_name, served_in_fp8

INDEX = "model.safetensors.index.json"
KEEP = 3
STALE_S = 3600.0  # a temporary folder untouched this long was left by a killed writer


class Fp8FolderError(ValueError):
    """A folder that cannot be turned into the fp8 form (already quantised, no weights)."""


def fp8_folder(src: str, served_dir: str, keep: int = KEEP) -> str:
    """The block-wise fp8 form of the HF folder `src` under `served_dir`, written if absent."""
    source = Path(src)
    dst = Path(served_dir) / f"{source.name}-fp8-{_source_key(source)}"
    if (dst / "config.json").is_file():
        return str(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write_fp8_folder(source, tmp)
        try:
            os.replace(tmp, dst)
        except OSError:  # a concurrent writer renamed its copy first: theirs is as good
            if not (dst / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(dst.parent, keep, dst)
    return str(dst)


def write_fp8_folder(src: str | Path, dst: str | Path) -> None:
    """Write the fp8 form of `src` into the new folder `dst` (module doc: layout)."""
    source, target = Path(src), Path(dst)
    config = json.loads((source / "config.json").read_text())
    if config.get("quantization_config"):
        raise Fp8FolderError(f"{source} is already quantised ({config['quantization_config'].get('quant_method')}); "
                             "fp8 serving quantises an unquantised (fp32 / bf16) folder")
    shards = sorted(source.glob("*.safetensors"))
    if not shards:
        raise Fp8FolderError(f"{source} holds no *.safetensors weights to quantise")
    target.mkdir(parents=True)
    added: dict[str, str] = {}  # scale name -> its shard
    for shard in shards:
        state = load_file(str(shard))
        picked = {name for name, t in state.items() if served_in_fp8(name, t.shape)}
        save_file(quantize_state_fp8(state, picked), str(target / shard.name), metadata={"format": "pt"})
        added.update({scale_name(name): shard.name for name in picked})
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if (source / INDEX).is_file():
        index = json.loads((source / INDEX).read_text())
        index["weight_map"] = {**index["weight_map"], **added}
        (target / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    for other in source.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name not in ("config.json", INDEX):
            shutil.copy2(other, target / other.name)


def _source_key(source: Path) -> str:
    """A digest of `source`'s real path and its files' names, sizes and mtimes."""
    if not (source / "config.json").is_file():
        raise Fp8FolderError(f"{source} is not an HF folder (no config.json); fp8 serving loads HF folders")
    digest = hashlib.sha256(str(source.resolve()).encode())
    for f in sorted(p for p in source.iterdir() if p.is_file()):
        st = f.stat()
        digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _prune(parent: Path, keep: int, current: Path) -> None:
    """Remove all but the newest `keep` copies (`current` always stays), and temporary folders
    a killed writer left (untouched for STALE_S: a live writer's is younger)."""
    copies, now = [], time.time()
    for p in parent.iterdir():
        if p.is_dir() and p.name.startswith(".") and ".tmp-" in p.name and now - p.stat().st_mtime > STALE_S:
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_dir() and "-fp8-" in p.name and not p.name.startswith("."):
            copies.append(p)
    copies.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for old in copies[keep:]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


def sglang_fp8_problem(config: Mapping[str, Any], tp_size: int) -> str | None:
    """Why SGLang cannot serve the model of HF `config` in block-wise fp8 on `tp_size` GPUs,
    or None. SGLang loads each part of a merged projection (q/k/v, gate/up, an MoE layer's
    experts) into whole 128-row blocks of scales, so each part's rows on one tensor-parallel
    rank must be a multiple of 128 (`Fp8LinearMethod.validate_block_quant_shapes`); the
    row-parallel o_proj and down_proj take the same widths as input."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    parts = {"q projection (num_attention_heads x head_dim)": heads * head_dim // tp_size,
             # SGLang replicates k/v heads when a rank would get fewer than one
             "k/v projection (num_key_value_heads x head_dim)": max(1, kv_heads // tp_size) * head_dim}
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if config.get(key):
            parts[f"MLP ({key})"] = int(config[key]) // tp_size
    bad = [f"{what} is {rows}" for what, rows in parts.items() if rows % BLOCK]
    if not bad:
        return None
    return (f"SGLang serves precision.rollout fp8 in {BLOCK} x {BLOCK} blocks, so each part of a merged projection "
            f"must be a multiple of {BLOCK} rows per tensor-parallel rank (rollout.engine_tensor_parallel "
            f"{tp_size}); in this model {', '.join(bad)}. Use rollout.engine builtin (it serves any shape in fp8), "
            "precision.rollout bf16, or another engine_tensor_parallel")
