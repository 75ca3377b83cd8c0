"""The megatron backend's LoRA hooks (core/train/megatron/lora.py) compute what PEFT's LoRA
computes on the HF model: same adapter, same logits (one gloo rank, TP 1, in a child process:
megatron's process groups are global state). TP = 2 is compared with the torch backend by
bench/lora_megatron_parity.py."""

from __future__ import annotations

import multiprocessing as mp
import tempfile

import pytest
import torch
from megatron_one_rank import in_child, one_rank

from milepost.core.config import LoraConfig

LORA = LoraConfig(rank=3, alpha=6.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"])


def _compare(port: int, cfg: LoraConfig, queue: mp.Queue) -> None:
    import transformers as T

    from milepost.core.config import MegatronConfig
    from milepost.core.train import lora
    from milepost.core.train.megatron import lora as mlora
    from milepost.core.train.megatron.converter import load_hf_into
    from milepost.core.train.megatron.head import response_logits
    from milepost.core.train.megatron.model import build_gpt_model, spec_from_hf_config, transformer_config
    with one_rank(port):
        torch.manual_seed(0)
        path = tempfile.mkdtemp()
        hf = T.Qwen2ForCausalLM(T.Qwen2Config(vocab_size=31, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, intermediate_size=96)).float().eval()
        hf.save_pretrained(path)
        s = spec_from_hf_config(T.AutoConfig.from_pretrained(path), 1)
        model = build_gpt_model(s, transformer_config(s, MegatronConfig(), torch.float32, True)).eval()
        load_hf_into([model], path, s, 0, 1)
        adapters = mlora.attach([model], cfg, s, 0, 1, 5, torch.float32, torch.device("cpu"))
        lora.inject(hf, cfg, seed=5)
        same_init = all(torch.equal(a, b) for a, b in zip(lora.adapter_state(hf).values(),
                                                          mlora.adapter_state(adapters, cfg).values()))
        g = torch.Generator().manual_seed(1)
        trained = {k: torch.randn(v.shape, generator=g) * 0.2 for k, v in lora.adapter_state(hf).items()}
        lora.load_adapter_state(hf, trained)
        mlora.load_adapter_state(adapters, cfg, trained)
        ids = torch.randint(2, 31, (2, 9))
        pos = torch.arange(9).unsqueeze(0).expand(2, 9)
        rows = torch.arange(2).unsqueeze(-1).expand(2, 9)
        with torch.no_grad():
            got = response_logits(model, model(ids, pos, None), rows, pos, 31, 1)
            ref = hf(input_ids=ids, position_ids=pos).logits
            for m in model.modules():  # without the adapter's hooks: the base model, whose logits differ
                m._forward_hooks.clear()
            base = response_logits(model, model(ids, pos, None), rows, pos, 31, 1)
    queue.put({"same_init": same_init, "diff": float((got - ref).abs().max()),
               "adapter_effect": float((base - ref).abs().max())})


def test_megatron_lora_hooks_give_peft_lora_logits() -> None:
    result = in_child(_compare, LORA)
    assert result["same_init"]  # both backends start from the same adapter
    assert result["adapter_effect"] > 1e-2  # the adapter matters to the logits
    assert result["diff"] < 1e-5, result  # and megatron's fused layout applies it as PEFT does


def test_what_the_megatron_backend_cannot_adapt_is_refused_naming_the_field() -> None:
    from milepost.core.train.megatron.lora import check_supported
    with pytest.raises(ValueError, match=r"train.lora.target_modules \['lm_head'\]"):
        check_supported(LoraConfig(target_modules=["lm_head"]), 1)
    with pytest.raises(ValueError, match="train.lora.dropout"):
        check_supported(LoraConfig(dropout=0.1), 1)
    with pytest.raises(ValueError, match="pipeline_parallel"):
        check_supported(LoraConfig(), 2)
