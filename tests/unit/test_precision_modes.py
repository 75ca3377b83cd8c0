"""precision.train / precision.rollout (core/config.py, core/quant/modes.py): the fields, what
the schema refuses, what the device refuses (one line naming the field, the reason and the
fix; `milepost run` exits 2 and writes nothing), the engine flags each rollout mode gives,
and the TIS warning where the modes differ."""

from __future__ import annotations

import logging

import pytest

from milepost.cli import main
from milepost.core.quant.modes import Device, PrecisionError, check_precision, engine_flags, int4_dtype
from milepost.core.recipe_io import RecipeError, load_recipe

TINY = "recipes/tiny-arith.yaml"
CPU, A100, H200 = Device("cpu"), Device("cuda", (8, 0)), Device("cuda", (9, 0))


def _recipe(*overrides: str):
    return load_recipe(TINY, list(overrides))


def test_both_modes_default_to_fp32_and_the_old_train_precision_names_its_new_place() -> None:
    assert (_recipe().precision.train, _recipe().precision.rollout) == ("fp32", "fp32")
    with pytest.raises(RecipeError, match=r"train.precision moved to precision.train .*`precision: \{train: bf16\}`"):
        _recipe("train.precision=bf16")
    with pytest.raises(RecipeError, match=r"precision.rollout.*'int4_qat'"):
        _recipe("precision.rollout=int4_qat")  # int4_qat is a training mode; rollout serves int4


@pytest.mark.parametrize("overrides,needle", [
    (["precision.rollout=int4", "rollout.engine=sglang"],
     r"precision.rollout int4 is served by the built-in engine only.*set rollout.engine=builtin"),
    (["precision.train=int4_qat", "train.lora.rank=4"], r"with train.lora is not supported yet.*remove train.lora"),
    (["precision.rollout=fp8", "train.lora.rank=4"], r"with train.lora is not supported yet.*remove train.lora"),
])
def test_combinations_no_device_runs_are_refused_by_the_schema(overrides, needle) -> None:
    with pytest.raises(RecipeError, match=needle):
        _recipe(*overrides)


@pytest.mark.parametrize("overrides,device,needle", [
    (["precision.train=fp8"], H200, r"^precision.train fp8 is built for train.backend megatron only \(its linears' "
                                    r"GEMMs through torch._scaled_mm\), not train.backend torch; use train.backend "
                                    r"megatron or precision.train bf16$"),
    (["precision.train=fp8", "train.backend=megatron"], A100,
     r"train.backend megatron on this machine runs on a CUDA device of compute capability \(8, 0\)"),
    (["precision.train=fp8", "train.backend=megatron"], Device("cuda", (8, 6)),
     r"^precision.train fp8 needs a CUDA device of compute capability >= 8.9 .* use precision.train bf16$"),
])
def test_fp8_training_is_refused_with_the_backend_or_the_device_reason(overrides, device, needle) -> None:
    with pytest.raises(PrecisionError, match=needle):
        check_precision(_recipe(*overrides), (lambda: device) if device else None)


@pytest.mark.parametrize("device", [H200, CPU, None])
def test_fp8_training_with_megatron_passes_on_an_fp8_gpu_on_a_cpu_emulated_and_where_the_device_is_unknown(
        device) -> None:
    check_precision(_recipe("precision.train=fp8", "train.backend=megatron", "precision.rollout=bf16"),
                    (lambda: device) if device else None)


@pytest.mark.parametrize("device", [H200, A100, CPU, None])
def test_fp8_rollout_on_the_builtin_engine_passes_on_any_device(device) -> None:
    """It stores fp8 weights and computes in bf16: no FP8 kernel is needed (core/engine/quantized.py)."""
    check_precision(_recipe("precision.rollout=fp8"), (lambda: device) if device else None)


@pytest.mark.parametrize("train,rollout", [("fp32", "fp32"), ("bf16", "bf16"), ("int4_qat", "int4"), ("bf16", "fp32")])
def test_what_runs_on_a_cpu_passes_without_probing_the_device(train, rollout) -> None:
    def probe() -> Device:
        raise AssertionError("only fp8 needs the device")
    check_precision(_recipe(f"precision.train={train}", f"precision.rollout={rollout}"), probe)


def test_differing_modes_keep_tis_on_by_default_and_warn_when_it_is_turned_off(caplog) -> None:
    recipe = _recipe("precision.train=bf16", "precision.rollout=int4")
    assert recipe.algo.tis_cap == 2.0
    with caplog.at_level(logging.WARNING):
        check_precision(_recipe("precision.train=bf16", "algo.tis_cap=null"), None)
        check_precision(_recipe("precision.train=int4_qat", "precision.rollout=int4", "algo.tis_cap=null"), None)
    assert [r.getMessage() for r in caplog.records if "tis_cap" in r.getMessage()] == [
        "precision.train bf16 and precision.rollout fp32 compute different logprobs, and algo.tis_cap is null: "
        "nothing corrects for the gap (set algo.tis_cap, e.g. 2.0)"]


def test_each_rollout_mode_gives_sglang_spelled_engine_flags() -> None:
    assert engine_flags("fp32") == {"dtype": "float32"}
    assert engine_flags("bf16") == {"dtype": "bfloat16"}
    assert engine_flags("int4") == {"dtype": "float32", "quantization": "int4"}
    assert engine_flags("int4", "bfloat16") == {"dtype": "bfloat16", "quantization": "int4"}
    assert engine_flags("bf16", "float32") == {"dtype": "bfloat16"}  # only int4 follows the trainer


def test_int4_computes_in_bf16_where_megatron_trains_on_gpus_and_in_fp32_elsewhere() -> None:
    assert int4_dtype("megatron", on_gpu=True) == "bfloat16"
    assert int4_dtype("megatron", on_gpu=False) == "float32"
    assert int4_dtype("torch", on_gpu=True) == "float32"  # the torch backend keeps fp32 parameters
    assert int4_dtype("torch", on_gpu=False) == "float32"
    assert engine_flags("fp8") == {"dtype": "bfloat16", "quantization": "fp8"}


def test_milepost_run_refuses_fp8_training_on_the_torch_backend_with_exit_2_and_writes_nothing(tmp_path,
                                                                                                capsys) -> None:
    campaign = tmp_path / "c"
    code = main(["run", TINY, "--campaign", str(campaign), "--set", "precision.train=fp8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not campaign.exists()
    assert err[-1].startswith("milepost: precision.train fp8 is built for train.backend megatron only") \
        and len(err) == 1


def test_the_fp8_recipe_is_chosen_by_name_and_an_unknown_name_lists_the_known_ones() -> None:
    from typing import get_args

    from milepost.core.config import Fp8RecipeName
    from milepost.core.train.megatron.fp8 import RECIPES
    assert set(RECIPES) == set(get_args(Fp8RecipeName))  # one list of names, two places
    assert _recipe("precision.train=fp8", "train.backend=megatron").train.megatron.fp8_recipe == "tensorwise-fast"
    chosen = _recipe("train.backend=megatron", "train.megatron.fp8_recipe=tensorwise-fast-delayed")
    assert RECIPES[chosen.train.megatron.fp8_recipe].amax_history == 16
    with pytest.raises(RecipeError, match=r"train.megatron.fp8_recipe.*'rowwise'.*'tensorwise-fast'"):
        _recipe("train.megatron.fp8_recipe=fastest")
