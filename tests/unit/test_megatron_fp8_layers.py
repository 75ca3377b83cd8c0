"""Which megatron linears `attach_fp8` turns fp8 (core/train/megatron/fp8.py): the output layer
never, the first / last `bf16_edge_layers` transformer layers not when asked (one gloo rank,
TP 1, in a child process: megatron's process groups are global state)."""

from __future__ import annotations

import multiprocessing as mp

import torch
from megatron_one_rank import in_child, one_rank

from milepost.core.quant.fp8_cast import Fp8Recipe


def _attach(port: int, edge_layers: int, queue: mp.Queue) -> None:
    import transformers as T

    from milepost.core.config import MegatronConfig
    from milepost.core.train.megatron.fp8 import attach_fp8
    from milepost.core.train.megatron.model import build_gpt_model, spec_from_hf_config, transformer_config
    with one_rank(port):
        hf_cfg = T.Qwen2Config(vocab_size=32, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=96)
        s = spec_from_hf_config(hf_cfg, 1)
        model = build_gpt_model(s, transformer_config(s, MegatronConfig(), torch.float32, True))
        done = attach_fp8([model], Fp8Recipe("tensorwise"), bf16_edge_layers=edge_layers)
        classes = {name: type(m).__name__ for name, m in model.named_modules() if name in done.fp8 + list(done.bf16)}
    queue.put({"fp8": done.fp8, "bf16": done.bf16, "classes": classes, "line": done.describe()})


def _attached(edge_layers: int) -> dict:
    return in_child(_attach, edge_layers)


def test_the_first_and_last_layers_stay_bf16_when_asked_and_the_output_layer_always() -> None:
    every = _attached(0)
    assert len(every["fp8"]) == 5 * 4  # qkv, proj, fc1, fc2 of each of the 5 layers
    assert list(every["bf16"]) == ["output_layer"]
    edges = _attached(1)
    kept = sorted(name for name in edges["bf16"] if name != "output_layer")
    assert kept == sorted(n for n in every["fp8"] if n.startswith(("decoder.layers.0.", "decoder.layers.4."))), kept
    assert len(edges["fp8"]) == 3 * 4 and all(n.startswith(("decoder.layers.1.", "decoder.layers.2.",
                                                            "decoder.layers.3.")) for n in edges["fp8"])
    assert all(edges["classes"][n].startswith("Fp8") for n in edges["fp8"])
    assert not any(edges["classes"][n].startswith("Fp8") for n in edges["bf16"])
    assert "8 layer(s): kept in bf16: one of the first / last 1 transformer layers" in edges["line"], edges["line"]
