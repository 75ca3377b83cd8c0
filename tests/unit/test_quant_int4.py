"""Group-wise symmetric INT4 (core/quant/int4.py): hand-computed values, shapes, ragged groups,
packing round trips, straight-through gradients, and which layers are quantised."""

from __future__ import annotations

import pytest
import torch

from milepost.core.quant.int4 import (
    GROUP_SIZE,
    MIN_SCALE,
    compiled_dequantize_packed,
    dequantize_int4,
    dequantize_packed,
    fake_quantize_int4,
    group_size,
    num_groups,
    pack_int4,
    quantize_int4,
    quantized_linears,
    unpack_int4,
)


def test_a_short_row_is_one_group_and_values_round_to_sevenths_of_its_max() -> None:
    w = torch.tensor([[0.7, -0.35, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_int4(w)
    assert group_size(4) == 4 and scale.shape == (2, 1)
    assert torch.allclose(scale, torch.tensor([[0.1], [MIN_SCALE]]))
    assert q.dtype == torch.int8 and q.tolist() == [[7, -4, 1, 0], [0, 0, 0, 0]]  # -3.5 rounds half to even
    assert torch.equal(dequantize_int4(q, scale), q.float() * scale)


def test_rows_of_128_or_more_use_groups_of_128_with_a_zero_padded_last_group() -> None:
    w = torch.randn(3, 300)
    q, scale = quantize_int4(w)
    assert (group_size(300), num_groups(300)) == (GROUP_SIZE, 3)
    assert q.shape == (3, 300) and scale.shape == (3, 3)
    assert torch.equal(scale[:, 2], w[:, 256:].abs().amax(dim=1) / 7)  # the pad never raises the max
    assert int(q.abs().max()) == 7 and int(q.min()) >= -7


def test_dequantised_weight_is_within_half_a_step_of_the_weight() -> None:
    w = torch.randn(64, 256) * 0.05
    q, scale = quantize_int4(w)
    err = (dequantize_int4(q, scale) - w).abs().view(64, 2, 128)
    assert bool((err <= scale.unsqueeze(-1) / 2 * (1 + 1e-6)).all())


def test_bf16_weights_are_quantised_in_float32_and_dequantised_back_to_bf16() -> None:
    w = torch.randn(8, 128).to(torch.bfloat16)
    q, scale = quantize_int4(w)
    assert torch.equal(q, quantize_int4(w.float())[0]) and scale.dtype == torch.float32
    assert dequantize_int4(q, scale, torch.bfloat16).dtype == torch.bfloat16


def test_fake_quantisation_is_the_served_weight_bit_for_bit_with_straight_through_gradients() -> None:
    w = (torch.randn(16, 256) * 0.02).requires_grad_()
    fq = fake_quantize_int4(w)
    assert torch.equal(fq, dequantize_int4(*quantize_int4(w)))
    assert torch.equal(unpack_int4(pack_int4(quantize_int4(w)[0]), 256), quantize_int4(w)[0])
    g = torch.randn(16, 256)
    fq.backward(g)
    assert torch.equal(w.grad, g)


@pytest.mark.parametrize("cols", [1, 7, 8, 9, 128, 130])
def test_packing_puts_eight_values_a_word_and_unpacks_exactly(cols: int) -> None:
    q = torch.randint(-7, 8, (5, cols), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, -(-cols // 8))
    assert torch.equal(unpack_int4(packed, cols), q)


def test_packing_layout_is_compressed_tensors_value_plus_8_low_nibble_first() -> None:
    q = torch.tensor([[-7, -6, -5, -4, -3, -2, -1, 7]], dtype=torch.int8)
    expected = sum((v + 8) << (4 * j) for j, v in enumerate(q[0].tolist()))  # 0xF7654321
    assert int(pack_int4(q)[0, 0]) & 0xFFFFFFFF == expected == 0xF7654321


def test_every_linear_but_the_output_head_and_moe_routers_is_quantised() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=20, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=False))
    names = set(quantized_linears(model))
    assert names == {f"model.layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                     "mlp.down_proj")}
    router = torch.nn.Module()
    router.gate = torch.nn.Linear(4, 2)
    assert quantized_linears(router) == {}


def test_the_compiled_dequantisation_a_gpu_engine_uses_equals_the_eager_one_bit_for_bit() -> None:
    # compiled here on CPU (inductor), as Int4Linear compiles it on CUDA: whole and ragged
    # groups, float32 and bf16 out, one compile for every shape (dynamic)
    torch.manual_seed(0)
    for shape in ((48, 256), (40, 200), (16, 24)):
        q, scale = quantize_int4(torch.randn(*shape))
        packed = pack_int4(q)
        for dtype in (torch.float32, torch.bfloat16):
            compiled = compiled_dequantize_packed()(packed, scale, shape[1], dtype)
            assert compiled.dtype == dtype and torch.equal(compiled, dequantize_packed(packed, scale, shape[1], dtype))
