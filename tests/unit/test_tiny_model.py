from pathlib import Path

from milepost.core.config import TinyModelConfig
from milepost.core.model.loading import load_causal_lm, load_tokenizer
from milepost.core.model.tiny import build_tiny_model


def test_tiny_model_is_a_real_hf_checkpoint_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MILEPOST_CACHE", str(tmp_path))
    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, warmstart_steps=3, warmstart_batch_size=8)
    path = build_tiny_model(cfg, seed=0)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (Path(path) / name).is_file(), name
    tok = load_tokenizer(path)
    assert tok.decode(tok.encode("12+7=19", add_special_tokens=False)) == "12+7=19"
    assert load_causal_lm(path).config.model_type == "qwen2"
    mtime = (tmp_path / "models").stat().st_mtime_ns
    assert build_tiny_model(cfg, seed=0) == path  # second call reuses the cache
    assert (tmp_path / "models").stat().st_mtime_ns == mtime
