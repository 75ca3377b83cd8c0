"""Block-wise e4m3 FP8 (core/quant/fp8.py): the DeepSeek-V3 / SGLang format — names, scale
shapes, ragged blocks, round-trip error bounds — and bit-for-bit agreement with transformers'
FineGrainedFP8 quantiser and dequantiser on block-aligned shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from milepost.core.quant.fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    QUANTIZATION_CONFIG,
    compiled_dequantize_fp8_blockwise,
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
    quantize_state_fp8,
    scale_name,
    scale_shape,
)


@pytest.mark.parametrize("shape,scales", [((128, 128), (1, 1)), ((256, 384), (2, 3)), ((200, 130), (2, 2)),
                                          ((1, 5), (1, 1)), ((129, 257), (2, 3))])
def test_values_are_e4m3_and_scales_are_one_per_128_by_128_block(shape, scales) -> None:
    q, s = quantize_fp8_blockwise(torch.randn(shape))
    assert q.dtype == FP8_DTYPE and q.shape == shape
    assert s.dtype == torch.float32 and tuple(s.shape) == scales == scale_shape(*shape)


def test_each_block_scale_is_its_max_over_448_and_the_max_lands_on_448() -> None:
    w = torch.randn(256, 256)
    w[:128, 128:] *= 10  # one block much larger: its scale alone changes
    q, s = quantize_fp8_blockwise(w)
    amax = w.view(2, 128, 2, 128).abs().amax(dim=(1, 3))
    assert torch.allclose(s, amax / FP8_MAX, rtol=1e-6)
    assert torch.equal(q.float().view(2, 128, 2, 128).abs().amax(dim=(1, 3)), torch.full((2, 2), FP8_MAX))


def test_ragged_edge_blocks_take_their_max_over_real_values_only() -> None:
    w = torch.randn(130, 200) * 0.01
    w[129, 199] = -3.0  # in the corner block (rows 128..129, cols 128..199)
    q, s = quantize_fp8_blockwise(w)
    assert float(s[1, 1]) == pytest.approx(3.0 / FP8_MAX, rel=1e-6)
    assert float(s[0, 0]) == pytest.approx(float(w[:128, :128].abs().max()) / FP8_MAX, rel=1e-6)
    assert float(q[129, 199].float()) == -FP8_MAX


def test_round_trip_error_is_within_e4m3s_half_ulp_and_subnormal_step() -> None:
    w = torch.randn(300, 260) * torch.logspace(-3, 0, 260)  # columns spanning three decades
    q, s = quantize_fp8_blockwise(w)
    back = dequantize_fp8_blockwise(q, s)
    per_elem_scale = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:300, :260]
    bound = w.abs() * 2**-4 + per_elem_scale * 2**-10
    assert bool(((back - w).abs() <= bound * (1 + 1e-5) + 1e-12).all())
    assert float((back - w).abs().max()) > 0  # it is lossy


def test_an_all_zero_block_gets_scale_one_and_stays_zero() -> None:
    w = torch.zeros(128, 256)
    w[:, 128:] = 1.0
    q, s = quantize_fp8_blockwise(w)
    assert s.tolist() == [[1.0, pytest.approx(1 / FP8_MAX)]]
    assert torch.equal(dequantize_fp8_blockwise(q, s)[:, :128], torch.zeros(128, 128))


def test_a_scale_of_the_wrong_shape_is_refused_naming_both_shapes() -> None:
    q, _ = quantize_fp8_blockwise(torch.randn(130, 10))
    with pytest.raises(ValueError, match=r"\[2, 1\].*\[1, 1\]"):
        dequantize_fp8_blockwise(q, torch.ones(1, 1))


def test_state_dict_gets_weight_scale_inv_beside_each_quantised_weight_only() -> None:
    state = {"l.q_proj.weight": torch.randn(256, 128), "l.norm.weight": torch.ones(128),
             "lm_head.weight": torch.randn(10, 128)}
    out = quantize_state_fp8(state, {"l.q_proj.weight"})
    assert set(out) == {"l.q_proj.weight", "l.q_proj.weight_scale_inv", "l.norm.weight", "lm_head.weight"}
    assert out["l.q_proj.weight"].dtype == FP8_DTYPE and out["l.q_proj.weight_scale_inv"].shape == (2, 1)
    assert out["lm_head.weight"] is state["lm_head.weight"]
    assert scale_name("a.weight") == "a.weight_scale_inv"
    assert QUANTIZATION_CONFIG["weight_block_size"] == [128, 128] and QUANTIZATION_CONFIG["fmt"] == "e4m3"


def test_matches_transformers_finegrained_fp8_bit_for_bit_on_aligned_shapes() -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Quantize, _dequantize_fp8_weight
    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=[128, 128],
                                                                                scale_fmt="float")))
    w = torch.randn(256, 384) * 0.1
    theirs = quantizer._quantize_one("x.weight", w)
    q, s = quantize_fp8_blockwise(w)
    assert torch.equal(q.view(torch.uint8), theirs["x.weight"].view(torch.uint8))
    assert torch.equal(s, theirs["x.weight_scale_inv"])
    assert torch.equal(dequantize_fp8_blockwise(q, s), _dequantize_fp8_weight(q, s, [128, 128], torch.float32))


def test_the_compiled_dequantisation_a_gpu_engine_uses_equals_the_eager_one_bit_for_bit() -> None:
    # compiled here on CPU (inductor), as Fp8Linear compiles it on CUDA: aligned and ragged
    # blocks, float32 and bf16 out, one compile for every shape (dynamic)
    torch.manual_seed(0)
    for shape in ((256, 384), (200, 130), (64, 16)):
        q, scale_inv = quantize_fp8_blockwise(torch.randn(*shape) * 3)
        for dtype in (torch.float32, torch.bfloat16):
            compiled = compiled_dequantize_fp8_blockwise()(q, scale_inv, dtype)
            assert compiled.dtype == dtype and torch.equal(compiled, dequantize_fp8_blockwise(q, scale_inv, dtype))
