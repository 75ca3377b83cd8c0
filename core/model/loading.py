"""The one path through which every component loads a policy: any HF checkpoint folder."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import fsspec
import torch

from milepost.core.config import ModelConfig
from milepost.core.data.arith import cache_root

BUILTIN_MODELS = ("builtin:tiny-arith",)


def resolve_model_path(model_cfg: ModelConfig, seed: int) -> str:
    """A local HF folder for `model.path`: builtin (built, cached), local, or an fsspec URL."""
    path = model_cfg.path
    if path == "builtin:tiny-arith":
        from milepost.core.model import tiny
        return tiny.build(model_cfg.tiny, seed)
    if path.startswith("builtin:"):
        raise ValueError(f"model.path `{path}`: unknown builtin model; available: {', '.join(BUILTIN_MODELS)}")
    protocol, _ = fsspec.core.split_protocol(path)
    if protocol not in (None, "file", "local"):
        return _copy_remote_checkpoint(path)
    local = fsspec.core.strip_protocol(path) if protocol else path
    if not (Path(local) / "config.json").is_file():
        raise ValueError(f"model.path `{path}` is not an HF checkpoint folder (no config.json); "
                         "pass a folder saved with save_pretrained, or builtin:tiny-arith")
    return str(local)


def _copy_remote_checkpoint(url: str) -> str:
    """Copy a remote checkpoint into the cache once; later calls reuse the copy."""
    final = cache_root() / "models" / f"remote-{hashlib.sha256(url.encode()).hexdigest()[:16]}"
    if (final / "config.json").is_file():
        return str(final)
    fs, root = fsspec.core.url_to_fs(url)
    if not fs.isfile(f"{root.rstrip('/')}/config.json"):
        raise ValueError(f"model.path `{url}` is not an HF checkpoint folder (no config.json there); "
                         "point it at a folder saved with save_pretrained")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        fs.get(root.rstrip("/") + "/", str(tmp), recursive=True)
        if final.exists():  # another process copied it first
            shutil.rmtree(tmp)
        else:
            tmp.rename(final)  # rename: a killed copy never looks like a complete checkpoint
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(final)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
