"""precision.rollout fp8 on SGLang engines (issue 21): the block-wise fp8 folder such an engine
loads (core/quant/fp8_folder.py), its cache, the shape rule SGLang's block loading imposes, and
the refusals at start-up. The folder's reader here is transformers (its FineGrainedFP8
dequantiser on CPU: the DeepSeek-V3 checkpoint format SGLang also reads); SGLang's loader
needs CUDA and triton, so what it takes is cited from its source in the module doc."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from milepost.core.config import Recipe
from milepost.core.quant.fp8 import (
    FP8_DTYPE,
    QUANTIZATION_CONFIG,
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
    scale_name,
    served_in_fp8,
)
from milepost.core.quant.fp8_folder import Fp8FolderError, fp8_folder, sglang_fp8_problem, write_fp8_folder
from milepost.core.quant.modes import PrecisionError, check_precision, disk_form
from milepost.core.recipe_io import load_recipe

QWEN2_05B = {"hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864}
QWEN3_17B = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 6144}


def _save(path: Path, hidden: int = 256, intermediate: int = 384, **save: object) -> dict[str, torch.Tensor]:
    """A 2-layer Qwen2 (untied head) saved to `path`; its state. Default shapes are whole
    128 x 128 blocks (transformers' dequantiser takes no ragged edge)."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=hidden, intermediate_size=intermediate,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=False, eos_token_id=1, pad_token_id=0))
    model.save_pretrained(path, **save)
    (path / "tokenizer_config.json").write_text("{}")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_fp8_folder_holds_e4m3_weights_with_block_scales_and_everything_else_unchanged(tmp_path) -> None:
    state = _save(tmp_path / "src", hidden=128, intermediate=320)  # ragged blocks: SGLang and milepost take them
    write_fp8_folder(tmp_path / "src", tmp_path / "fp8")
    written = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    picked = [n for n, t in state.items() if served_in_fp8(n, t.shape)]
    assert len(picked) == 14  # q, k, v, o, gate, up, down in each of 2 layers
    for name, tensor in state.items():
        if name in picked:
            q, scale = quantize_fp8_blockwise(tensor)
            assert written[name].dtype == FP8_DTYPE
            assert torch.equal(written[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(written[scale_name(name)], scale), name
        else:
            assert torch.equal(written[name], tensor), name
    assert len(written) == len(state) + len(picked)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    assert (tmp_path / "fp8" / "tokenizer_config.json").is_file()  # the other files come along
    assert (tmp_path / "fp8" / "generation_config.json").is_file()


def test_transformers_reads_the_fp8_folder_as_the_block_dequantised_weights_bit_for_bit(tmp_path) -> None:
    """An independent reader of the format: transformers' FineGrainedFP8 loader (CPU:
    dequantise) gives each picked weight exactly milepost's dequantisation, the rest as saved."""
    state = _save(tmp_path / "src")
    write_fp8_folder(tmp_path / "src", tmp_path / "fp8")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float32).state_dict()
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        expected = (dequantize_fp8_blockwise(*quantize_fp8_blockwise(tensor))
                    if served_in_fp8(name, tensor.shape) else tensor)
        assert torch.equal(loaded[name], expected), name


def test_a_sharded_folder_keeps_its_shards_and_its_index_maps_each_scale_beside_its_weight(tmp_path) -> None:
    _save(tmp_path / "src", max_shard_size="300KB")
    shards = sorted(p.name for p in (tmp_path / "src").glob("*.safetensors"))
    assert len(shards) > 1
    write_fp8_folder(tmp_path / "src", tmp_path / "fp8")
    assert sorted(p.name for p in (tmp_path / "fp8").glob("*.safetensors")) == shards
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    contents = {shard: set(load_file(str(tmp_path / "fp8" / shard))) for shard in shards}
    assert all(name in contents[shard] for name, shard in index.items())
    assert set().union(*contents.values()) == set(index)
    assert sum(n.endswith("_scale_inv") for n in index) == 14


def test_copies_are_written_once_per_source_content_and_only_the_newest_are_kept(tmp_path) -> None:
    served = tmp_path / "served"
    sources = []
    for i in range(3):
        _save(tmp_path / f"step{i}", hidden=128, intermediate=128)
        sources.append(tmp_path / f"step{i}")
    first = fp8_folder(str(sources[0]), str(served), keep=2)
    stamp = os.stat(Path(first, "model.safetensors")).st_mtime_ns
    assert fp8_folder(str(sources[0]), str(served), keep=2) == first  # written once
    assert os.stat(Path(first, "model.safetensors")).st_mtime_ns == stamp
    (served / ".step9-fp8-0.tmp-dead").mkdir()  # a killed writer's leftover is no copy...
    os.utime(served / ".step9-fp8-0.tmp-dead", (0, 0))  # ...and is removed once stale
    (served / ".step8-fp8-0.tmp-live").mkdir()  # a live writer's stays
    later = [fp8_folder(str(s), str(served), keep=2) for s in sources[1:]]
    assert sorted(p.name for p in served.iterdir()) == sorted([".step8-fp8-0.tmp-live", *(Path(p).name for p in later)])
    _save(sources[2], hidden=128, intermediate=128)  # rewritten in place: a new copy
    os.utime(sources[2] / "model.safetensors", ns=(1, 1))
    assert fp8_folder(str(sources[2]), str(served), keep=2) != later[1]


def test_a_folder_already_quantised_or_not_hf_is_refused_by_name(tmp_path) -> None:
    _save(tmp_path / "src", hidden=128, intermediate=128)
    write_fp8_folder(tmp_path / "src", tmp_path / "fp8")
    with pytest.raises(Fp8FolderError, match=r"already quantised \(fp8\)"):
        write_fp8_folder(tmp_path / "fp8", tmp_path / "again")
    (tmp_path / "empty").mkdir()
    with pytest.raises(Fp8FolderError, match="no config.json"):
        fp8_folder(str(tmp_path / "empty"), str(tmp_path / "served"))


@pytest.mark.parametrize("config,tp,bad", [
    (QWEN2_05B, 1, None),  # q 896 = 7 blocks, k/v 2 x 64 = 128, MLP 4864 = 38 blocks
    (QWEN2_05B, 2, "q projection (num_attention_heads x head_dim) is 448"),
    (QWEN3_17B, 4, None),  # k/v: 8 heads / 4 ranks x 128
    (QWEN3_17B, 16, None),  # fewer k/v heads than ranks: SGLang replicates one per rank
    ({"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256}, 1,
     "k/v projection (num_key_value_heads x head_dim) is 64"),  # tiny-arith
    ({**QWEN3_17B, "moe_intermediate_size": 768 + 64}, 1, "MLP (moe_intermediate_size) is 832"),
])
def test_sglangs_block_rule_names_the_part_that_breaks_it(config, tp, bad) -> None:
    problem = sglang_fp8_problem(config, tp)
    assert problem is None if bad is None else bad in problem and "rollout.engine builtin" in problem


def test_sglang_fp8_is_refused_at_start_up_for_a_model_it_cannot_block_and_taken_for_one_it_can() -> None:
    def recipe(model: str) -> Recipe:
        return load_recipe("recipes/tiny-arith.yaml", [f"model.path={model}", "rollout.engine=sglang",
                                                       "precision.rollout=fp8"])
    assert disk_form("sglang", "fp8") == "fp8" and disk_form("builtin", "fp8") is None
    with pytest.raises(PrecisionError, match=r"k/v projection .* is 64"):
        check_precision(recipe("builtin:tiny-arith"), None)
    check_precision(recipe("builtin:gpu-arith"), None)  # hidden 768, 12 x 64, k/v 4 x 64, MLP 2048
