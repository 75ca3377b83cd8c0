import os
from pathlib import Path

import pytest

from milepost.core.config import ModelConfig, TinyModelConfig
from milepost.core.model import tiny
from milepost.core.model.loading import load_causal_lm, load_tokenizer, resolve_model_path

SMALL = TinyModelConfig(hidden_size=32, intermediate_size=64, warmstart_steps=5, warmstart_batch_size=8)


def test_tiny_model_is_a_real_hf_checkpoint_and_is_cached(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    monkeypatch.setenv("MILEPOST_CACHE", str(tmp_path))
    path = resolve_model_path(ModelConfig(tiny=SMALL), seed=0)
    assert Path(path).parent == tmp_path / "models" and Path(path).name.startswith("tiny-arith-")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (Path(path) / name).is_file(), name
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.encode("12+7=19", add_special_tokens=False)
    assert len(ids) == 7 and tok.decode(ids) == "12+7=19"
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert load_causal_lm(path).config.vocab_size == len(load_tokenizer(path))
    report = tiny.build_report(path)
    assert 0.0 <= report["eval_accuracy"] <= 1.0 and report["warmstart_loss"] > 0
    stamp = (Path(path) / "model.safetensors").stat().st_mtime_ns
    assert tiny.build_tiny_model(SMALL, seed=0) == path  # second call reuses the cache
    assert (Path(path) / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "models").iterdir()] == [Path(path).name]  # no tmp left


def test_build_is_deterministic_and_keyed_by_seed(tmp_path, monkeypatch):
    monkeypatch.setenv("MILEPOST_CACHE", str(tmp_path / "a"))
    a = Path(tiny.build_tiny_model(SMALL, seed=0))
    monkeypatch.setenv("MILEPOST_CACHE", str(tmp_path / "b"))
    b = Path(tiny.build_tiny_model(SMALL, seed=0))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert tiny.cached_model_dir(SMALL, 0) != tiny.cached_model_dir(SMALL, 1)


def test_a_failed_build_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MILEPOST_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny, "warmstart", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        tiny.build_tiny_model(SMALL, seed=0)
    assert os.listdir(tmp_path / "models") == []


def test_model_path_errors_and_fsspec_copy(tmp_path, monkeypatch):
    import fsspec
    monkeypatch.setenv("MILEPOST_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="model.path.*no config.json"):
        resolve_model_path(ModelConfig(path=str(tmp_path)), seed=0)
    with pytest.raises(ValueError, match="model.path.*builtin:tiny-arith"):
        resolve_model_path(ModelConfig(path="builtin:gpt5"), seed=0)
    local = tiny.build_tiny_model(SMALL, seed=0)
    assert resolve_model_path(ModelConfig(path=local), seed=0) == local
    fs = fsspec.filesystem("memory")
    for f in Path(local).iterdir():
        fs.pipe(f"/milepost-ckpt/{f.name}", f.read_bytes())
    copied = resolve_model_path(ModelConfig(path="memory://milepost-ckpt"), seed=0)
    assert (Path(copied) / "model.safetensors").read_bytes() == (Path(local) / "model.safetensors").read_bytes()
    assert resolve_model_path(ModelConfig(path="memory://milepost-ckpt"), seed=0) == copied
    assert load_tokenizer(copied).decode([2, 3]) == "01"
