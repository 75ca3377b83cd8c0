"""core/train/lora.py: PEFT's LoRA layers and format, checked against peft's own reader."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.config import LoraConfig
from milepost.core.train import lora


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).eval()


def perturb(model: torch.nn.Module, seed: int = 3) -> None:
    """Give every lora_B non-zero values (a fresh adapter is the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, lora.LoraLinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)


IDS = torch.tensor([[2, 5, 7, 9, 11, 3]])


def test_a_fresh_adapter_leaves_the_model_exactly_as_it_was() -> None:
    model = tiny_qwen2()
    before = model(IDS).logits
    names = lora.inject(model, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]), seed=1)
    assert names == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert torch.equal(model(IDS).logits, before)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(n.endswith(("lora_A.weight", "lora_B.weight")) for n in trained)


def test_initialisation_depends_on_seed_and_layer_name_only() -> None:
    cfg = LoraConfig(rank=4, target_modules=["q_proj"])
    a, b, c = tiny_qwen2(0), tiny_qwen2(1), tiny_qwen2(0)
    lora.inject(a, cfg, seed=7)
    lora.inject(b, cfg, seed=7)
    lora.inject(c, cfg, seed=8)
    sa, sb, sc = lora.adapter_state(a), lora.adapter_state(b), lora.adapter_state(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # other base weights, same adapter
    assert not torch.equal(sa[next(iter(sa))], sc[next(iter(sc))])


def test_peft_loads_the_saved_adapter_and_computes_the_same_logits(tmp_path) -> None:
    import peft  # the test extra's: its own reader is the check
    base = tiny_qwen2()
    ours = copy.deepcopy(base)
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "o_proj", "down_proj"])
    lora.inject(ours, cfg, seed=1)
    perturb(ours)
    size = lora.save_adapter(tmp_path, lora.adapter_state(ours), cfg, "tiny")
    assert size == (tmp_path / lora.ADAPTER_WEIGHTS).stat().st_size
    theirs = peft.PeftModel.from_pretrained(base, str(tmp_path)).eval()
    assert torch.allclose(theirs(IDS).logits, ours(IDS).logits, atol=1e-6, rtol=0)
    # and peft's own save has the same tensor names
    out = tmp_path / "peft_saved"
    theirs.save_pretrained(str(out))
    _, saved = lora.read_adapter(out)
    assert sorted(saved) == sorted(lora.adapter_state(ours))
    assert json.loads((out / lora.ADAPTER_CONFIG).read_text())["r"] == 4


def test_round_trip_through_the_folder_restores_the_adapter(tmp_path) -> None:
    cfg = LoraConfig(rank=2, target_modules=["gate_proj"])
    a, b = tiny_qwen2(), tiny_qwen2()
    lora.inject(a, cfg, seed=1)
    lora.inject(b, cfg, seed=2)
    perturb(a)
    lora.save_adapter(tmp_path, lora.adapter_state(a), cfg, "tiny")
    config, tensors = lora.read_adapter(tmp_path)
    lora.load_adapter_state(b, tensors)
    assert config["peft_type"] == "LORA" and config["lora_alpha"] == 16.0
    assert torch.equal(a(IDS).logits, b(IDS).logits)


def test_targets_that_match_nothing_are_refused_with_the_names_there_are() -> None:
    with pytest.raises(ValueError, match=r"train.lora.target_modules \['qkv'\] match no Linear.*q_proj"):
        lora.inject(tiny_qwen2(), LoraConfig(target_modules=["qkv"]), seed=1)


def test_an_adapter_for_other_layers_is_refused() -> None:
    a, b = tiny_qwen2(), tiny_qwen2()
    lora.inject(a, LoraConfig(target_modules=["q_proj"]), seed=1)
    lora.inject(b, LoraConfig(target_modules=["v_proj"]), seed=1)
    with pytest.raises(ValueError, match="does not fit the model's LoRA layers"):
        lora.load_adapter_state(b, lora.adapter_state(a))


def test_the_recipe_refuses_full_weight_transports_and_empty_targets() -> None:
    from pydantic import ValidationError

    from milepost.core.config import Recipe
    with pytest.raises(ValidationError, match="set sync.transport=disk"):
        Recipe.model_validate({"train": {"lora": {}}, "sync": {"transport": "tensor"}})
    with pytest.raises(ValidationError, match="target_modules must name at least one"):
        Recipe.model_validate({"train": {"lora": {"target_modules": []}}})
    with pytest.raises(ValidationError, match="dropout"):
        Recipe.model_validate({"train": {"lora": {"dropout": 1.0}}})


def test_the_plan_counts_grads_and_adam_state_of_the_adapter_only() -> None:
    from milepost.core.config import Recipe
    from milepost.core.plan.arch import Architecture
    from milepost.core.plan.layout import train_layout
    from milepost.core.plan.memory import trainer_memory
    arch = Architecture(name="t", model_type="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=32, intermediate_size=256, vocab_size=15, tied_embeddings=True)
    recipe = Recipe.model_validate({"train": {"lora": {"rank": 8, "target_modules": ["q_proj", "down_proj"]}}})
    items = {i.name: i.bytes for i in trainer_memory(arch, train_layout(recipe), 0)}
    adapter = 2 * 8 * ((128 + 128) + (256 + 128))  # layers x rank x (in + out) per target
    assert items["adapter"] == items["grads"] == 4 * adapter and items["optimizer"] == 8 * adapter
