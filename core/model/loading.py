"""The one path through which every component loads a policy: any HF checkpoint folder.

torch and transformers are imported inside the functions that load, so `milepost run`
checks a model path without paying for them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec

from milepost.core.config import ModelConfig
from milepost.core.data.arith import cache_root
from milepost.core.errors import UserError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

BUILTIN_MODELS = ("builtin:tiny-arith", "builtin:tiny-arith-moe", "builtin:gpu-arith")
# What makes a folder an HF checkpoint the engines and trainers can load: weights (one file,
# or shards with their index) and a tokenizer beside config.json.
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
FIX = "pass a folder saved with save_pretrained (config.json, weights, tokenizer), or builtin:tiny-arith"


class ModelPathError(UserError):
    """`model.path` names nothing this run can load."""


def check_model_path(model_cfg: ModelConfig) -> None:
    """Whether `model.path` names a loadable model, without loading or building it: run at
    validation, before the campaign store is written. Remote URLs are checked for config.json."""
    path = model_cfg.path
    if path.startswith("builtin:"):
        if path not in BUILTIN_MODELS:
            raise ModelPathError(f"model.path `{path}`: unknown builtin model; available: "
                                 f"{', '.join(BUILTIN_MODELS)}, or an HF checkpoint folder")
        return
    protocol, _ = fsspec.core.split_protocol(path)
    if protocol not in (None, "file", "local"):
        _check_remote(path)
        return
    _check_local_folder(Path(fsspec.core.strip_protocol(path) if protocol else path), path)


def _check_remote(url: str) -> None:
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:  # unknown protocol, or its package is not installed
        raise ModelPathError(f"model.path `{url}`: cannot open it: {e}") from None
    if not fs.isfile(f"{root.rstrip('/')}/config.json"):
        raise ModelPathError(f"model.path `{url}` is not an HF checkpoint folder (no config.json there); {FIX}")


def _check_local_folder(folder: Path, path: str) -> None:
    if not folder.exists():
        raise ModelPathError(f"model.path `{path}` does not exist; {FIX}")
    if not folder.is_dir():
        raise ModelPathError(f"model.path `{path}` is a file; point it at the checkpoint's folder")
    config = folder / "config.json"
    if not config.is_file():
        raise ModelPathError(f"model.path `{path}` is not an HF checkpoint folder (no config.json); {FIX}")
    try:
        doc = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelPathError(f"model.path `{path}`: config.json is not valid JSON ({e}); save the "
                             "checkpoint again") from None
    if not isinstance(doc, dict) or "model_type" not in doc:
        raise ModelPathError(f"model.path `{path}`: config.json has no `model_type`, so no model class "
                             "can be chosen; save the checkpoint again with save_pretrained")
    if not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
        raise ModelPathError(f"model.path `{path}` has config.json but no weights (*.safetensors or "
                             f"pytorch_model*.bin); {FIX}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelPathError(f"model.path `{path}` has no tokenizer ({', '.join(TOKENIZER_FILES)}); save the "
                             "tokenizer into the same folder (tokenizer.save_pretrained)")


def validation_tokenizer(model_cfg: ModelConfig) -> tuple[Any, int | None] | None:
    """The policy's tokenizer and context length (max_position_embeddings, None if unknown),
    cheaply, for checking prompts at validation; None when that needs a remote copy. The
    builtin model's tokenizer and config are made without building (training) the model."""
    path = model_cfg.path
    if path in BUILTIN_MODELS:  # the builtin models share tiny-arith's tokenizer and context
        from milepost.core.model import tiny
        tokenizer = tiny.build_tokenizer()
        sizes = model_cfg.gpu_arith if path == "builtin:gpu-arith" else model_cfg.tiny
        return tokenizer, tiny._model_config(sizes, tokenizer).max_position_embeddings
    protocol, _ = fsspec.core.split_protocol(path)
    if path.startswith("builtin:") or protocol not in (None, "file", "local"):
        return None
    local = fsspec.core.strip_protocol(path) if protocol else path
    try:
        tokenizer = load_tokenizer(local)
    except Exception as e:  # noqa: BLE001 - any failure to load it is the checkpoint's
        raise ModelPathError(f"model.path `{path}`: its tokenizer does not load ({type(e).__name__}: {e}); "
                             "save it again with tokenizer.save_pretrained") from None
    context = json.loads((Path(local) / "config.json").read_text()).get("max_position_embeddings")
    return tokenizer, int(context) if isinstance(context, int) else None


def model_hf_config(model_cfg: ModelConfig) -> dict[str, Any] | None:
    """`model.path`'s config.json as a dict, cheaply: a dense builtin model's made without
    building it, a local folder's read; None where that needs more (a remote copy, the MoE)."""
    path = model_cfg.path
    if path in ("builtin:tiny-arith", "builtin:gpu-arith"):
        from milepost.core.model import tiny
        sizes = model_cfg.gpu_arith if path == "builtin:gpu-arith" else model_cfg.tiny
        return dict(tiny._model_config(sizes, tiny.build_tokenizer()).to_dict())
    config = Path(path.removeprefix("file://"), "config.json")
    return json.loads(config.read_text()) if not path.startswith("builtin:") and config.is_file() else None


def resolve_model_path(model_cfg: ModelConfig, seed: int) -> str:
    """A local HF folder for `model.path`: builtin (built, cached), local, or an fsspec URL."""
    path = model_cfg.path
    if path == "builtin:tiny-arith":
        from milepost.core.model import tiny
        return tiny.build(model_cfg.tiny, seed)
    if path == "builtin:tiny-arith-moe":
        from milepost.core.model import tiny_moe
        return tiny_moe.build_tiny_moe_model(model_cfg.tiny, model_cfg.tiny_moe, seed)
    if path == "builtin:gpu-arith":
        from milepost.core.model import gpu_arith
        return gpu_arith.build_gpu_arith_model(model_cfg.gpu_arith, seed)
    if path.startswith("builtin:"):
        raise ModelPathError(f"model.path `{path}`: unknown builtin model; available: {', '.join(BUILTIN_MODELS)}")
    protocol, _ = fsspec.core.split_protocol(path)
    if protocol not in (None, "file", "local"):
        return _copy_remote_checkpoint(path)
    local = fsspec.core.strip_protocol(path) if protocol else path
    _check_local_folder(Path(local), path)
    return str(local)


def _copy_remote_checkpoint(url: str) -> str:
    """Copy a remote checkpoint into the cache once; later calls reuse the copy."""
    final = cache_root() / "models" / f"remote-{hashlib.sha256(url.encode()).hexdigest()[:16]}"
    if (final / "config.json").is_file():
        return str(final)
    fs, root = fsspec.core.url_to_fs(url)
    if not fs.isfile(f"{root.rstrip('/')}/config.json"):
        raise ModelPathError(f"model.path `{url}` is not an HF checkpoint folder (no config.json there); {FIX}")
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


def load_causal_lm(path: str, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """`dtype`: a torch dtype, float32 by default. torch is imported here, not at module level,
    so validation (check_model_path) stays light for the command line."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if dtype is None else dtype)
