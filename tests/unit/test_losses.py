"""RL losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from milepost.core.algo.losses import (
    entropy_from_logits,
    gspo_token_loss,
    kl_penalty,
    masked_sum,
    ppo_clip_token_loss,
    rl_loss,
    rl_loss_on_device,
    sft_loss,
    tis_weights,
)
from milepost.core.config import AlgoConfig

LN = math.log


def close(actual: torch.Tensor, expected: list, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=atol, rtol=1e-5)


# Six tokens with old = 0, so ratio = exp(lp); clip range [0.8, 1.28].
PPO_RATIOS = [1.0, 1.5, 0.5, 0.5, 1.5, 5.0]
PPO_ADV = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]


def ppo_inputs(requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = torch.tensor([[LN(r) for r in PPO_RATIOS]], requires_grad=requires_grad)
    return lp, torch.zeros(1, 6), torch.tensor([PPO_ADV])


def test_policy_loss_takes_the_pessimistic_clipped_surrogate() -> None:
    # r=1  A=+1: min(1, 1) -> -1                     | r=1.5 A=+1: min(1.5, 1.28) -> -1.28 clipped
    # r=.5 A=+1: min(.5, .8) -> -.5                  | r=.5  A=-1: min(-.5, -.8) -> .8 clipped
    # r=1.5 A=-1: min(-1.5, -1.28) -> 1.5            | r=5   A=-1: min(-5, -1.28) -> 5
    loss, clipfrac = ppo_clip_token_loss(*ppo_inputs(), clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.0, -1.28, -0.5, 0.8, 1.5, 5.0]])
    close(clipfrac, [[0.0, 1.0, 0.0, 1.0, 0.0, 0.0]])


def test_policy_loss_applies_dual_clip_to_negative_advantages() -> None:
    # c=3: r=5, A=-1 -> min(5, 3*1) = 3 (counted as clipped); r=1.5 A=-1 stays 1.5 < 3
    loss, clipfrac = ppo_clip_token_loss(*ppo_inputs(), clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    close(loss, [[-1.0, -1.28, -0.5, 0.8, 1.5, 3.0]])
    close(clipfrac, [[0.0, 1.0, 0.0, 1.0, 0.0, 1.0]])


def test_dual_clip_leaves_positive_advantages_alone() -> None:
    # r=5, A=+1: min(5, 1.28) -> -1.28 whatever c is
    lp, old = torch.tensor([[LN(5.0)]]), torch.zeros(1, 1)
    loss, _ = ppo_clip_token_loss(lp, old, torch.ones(1, 1), 0.2, 0.28, dual_clip_c=3.0)
    close(loss, [[-1.28]])


def test_gradient_of_ppo_loss_is_zero_for_clipped_tokens() -> None:
    # unclipped tokens: d(-r*A)/d lp = -r*A -> [-1, ., -0.5, ., 1.5, .]; clipped ones get 0
    lp, old, adv = ppo_inputs(requires_grad=True)
    loss, _ = ppo_clip_token_loss(lp, old, adv, 0.2, 0.28, dual_clip_c=3.0)
    loss.sum().backward()
    close(lp.grad, [[-1.0, 0.0, -0.5, 0.0, 1.5, 0.0]])


def gspo_inputs(requires_grad: bool = False):
    # row 0: mask [1,1,0], lp-old = [ln 2, 0, garbage] -> s0 = exp(ln2 / 2) = sqrt(2) ~ 1.41421
    # row 1: mask [1,1,1], lp-old = [ln .9, 0, 0]       -> s1 = 0.9 ** (1/3) ~ 0.96549
    lp = torch.tensor([[LN(2.0), 0.0, 99.0], [LN(0.9), 0.0, 0.0]], requires_grad=requires_grad)
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 5.0], [-1.0, -1.0, -1.0]])  # masked 5 is ignored: A0 = 1
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return lp, old, adv, mask


def test_gspo_uses_one_length_normalised_ratio_per_sequence() -> None:
    # row 0: A=1, min(1.41421, 1.28) -> -1.28, clipped. row 1: A=-1, s1 in range -> 0.96549
    lp, old, adv, mask = gspo_inputs()
    loss, clipfrac = gspo_token_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    s1 = 0.9 ** (1 / 3)
    close(masked_sum(loss, mask).reshape(1), [2 * -1.28 + 3 * s1])
    close(loss[1], [s1, s1, s1])
    close(loss[0, :2], [-1.28, -1.28])
    close(clipfrac, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


def test_gspo_token_gradient_is_sequence_ratio_times_advantage_per_token() -> None:
    # d loss_it / d lp_t = -sg(s_i) * A_i -> row 1: +0.96549 on every token; row 0 clipped: 0
    lp, old, adv, mask = gspo_inputs(requires_grad=True)
    loss, _ = gspo_token_loss(lp, old, adv, mask, 0.2, 0.28)
    masked_sum(loss, mask).backward()
    s1 = 0.9 ** (1 / 3)
    close(lp.grad, [[0.0, 0.0, 0.0], [s1, s1, s1]])


def test_gspo_token_gradient_matches_sequence_level_gspo_averaged_per_sequence() -> None:
    lp = torch.tensor([[0.1, -0.05, 0.0], [0.02, 0.03, -0.01]], requires_grad=True)
    old, mask = torch.zeros(2, 3), torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([[0.5, 0.5, 0.5], [-2.0, -2.0, -2.0]])
    tok_loss, _ = gspo_token_loss(lp, old, adv, mask, 0.2, 0.28)
    lengths = mask.sum(-1)
    ((tok_loss * mask).sum(-1) / lengths).sum().backward()  # per-sequence token mean
    grad_token = lp.grad.clone()
    lp.grad = None
    s = torch.exp((lp * mask).sum(-1) / lengths)  # sequence-level ratio, all in clip range
    (-(s * adv[:, 0])).sum().backward()
    torch.testing.assert_close(grad_token * mask, lp.grad * mask)


def test_kl_penalty_estimators_match_their_formulas() -> None:
    # d = lp - ref = [0, 1, -1]: k1 = d ; k2 = d^2/2 ; k3 = exp(-d) + d - 1 = [0, 1/e, e - 2]
    lp, ref = torch.tensor([[0.0, 1.0, -1.0]]), torch.zeros(1, 3)
    close(kl_penalty(lp, ref, "k1"), [[0.0, 1.0, -1.0]])
    close(kl_penalty(lp, ref, "k2"), [[0.0, 0.5, 0.5]])
    close(kl_penalty(lp, ref, "k3"), [[0.0, math.exp(-1), math.e - 2]])


def test_kl_penalty_rejects_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")  # type: ignore[arg-type]


def test_entropy_from_logits_handles_uniform_peaked_and_masked_vocabularies() -> None:
    # [0, 0] -> ln 2 ; [0, -inf] -> 0 ; [0, ln 3] -> p = [.25, .75],
    # H = .25 ln 4 + .75 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    logits = torch.tensor([[[0.0, 0.0], [0.0, -math.inf], [0.0, LN(3.0)]]])
    close(entropy_from_logits(logits), [[LN(2.0), 0.0, 0.562335]])


def test_tis_weights_are_capped_and_detached() -> None:
    # old - engine = [0, ln 1.5, ln 3, -ln 2] -> [1, 1.5, min(3, 2), 0.5]
    old = torch.tensor([[0.0, LN(1.5), LN(3.0), -LN(2.0)]], requires_grad=True)
    w = tis_weights(old, torch.zeros(1, 4), cap=2.0)
    close(w, [[1.0, 1.5, 2.0, 0.5]])
    assert not w.requires_grad


def test_sft_loss_is_masked_negative_log_likelihood_over_the_normaliser() -> None:
    # -(-1 - 2) / 4 = 0.75 ; the masked -3 is ignored
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    close(sft_loss(lp, torch.tensor([[1, 1, 0]]), token_normalizer=4.0).reshape(1), [0.75])


def full_cfg(**kw) -> AlgoConfig:
    base = dict(loss="ppo", clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, tis_cap=2.0,
                kl_coef=0.1, kl_type="k1", entropy_coef=0.01)
    return AlgoConfig(**(base | kw))


def test_rl_loss_combines_policy_tis_kl_and_entropy_terms() -> None:
    # mask [1, 1, 0]; old = 0; lp = [0, ln .5, 7 (masked garbage)]; A = [1, -1, 1]
    # policy: t0 r=1 A=1 -> -1 ; t1 r=.5 A=-1 -> .8 (clipped)
    # tis = min(exp(old - engine), 2) with engine = [-ln 3, 0, 0] -> [2, 1, 1]
    # k1 = lp - ref = [.5, 1] ; entropy = [1, 2]
    # t0 = -1*2 + .1*.5 - .01*1 = -1.96 ; t1 = .8*1 + .1*1 - .01*2 = .88 ; (-1.96+.88)/2 = -0.54
    lp = torch.tensor([[0.0, LN(0.5), 7.0]])
    ref = lp - torch.tensor([[0.5, 1.0, 0.0]])
    engine = torch.tensor([[-LN(3.0), 0.0, 0.0]])
    loss, m = rl_loss(lp, torch.zeros(1, 3), engine, torch.tensor([[1.0, -1.0, 1.0]]),
                      torch.tensor([[1, 1, 0]]), full_cfg(), token_normalizer=2.0,
                      ref_logprobs=ref, entropy=torch.tensor([[1.0, 2.0, 9.0]]))
    close(loss.reshape(1), [-0.54])
    expected = {"loss/policy": (-2 + 0.8) / 2, "loss/kl": 1.5 / 2, "loss/entropy": 3 / 2,
                "loss/clipfrac": 1 / 2, "loss/tis_mean": 3 / 2, "loss/ratio_mean": 1.5 / 2}
    assert m.keys() == expected.keys()
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, abs=1e-6), key
        assert isinstance(m[key], float)


def test_rl_loss_without_tis_uses_unit_weights() -> None:
    # policy [-1, .8] unweighted, no kl/entropy: (-1 + .8) / 2 = -0.1 ; tis_mean = 2/2 = 1
    cfg = full_cfg(tis_cap=None, kl_coef=0.0, entropy_coef=0.0)
    lp = torch.tensor([[0.0, LN(0.5)]])
    loss, m = rl_loss(lp, torch.zeros(1, 2), torch.full((1, 2), -5.0), torch.tensor([[1.0, -1.0]]),
                      torch.ones(1, 2), cfg, token_normalizer=2.0)
    close(loss.reshape(1), [-0.1])
    assert m["loss/tis_mean"] == pytest.approx(1.0)
    assert m["loss/kl"] == 0.0 and m["loss/entropy"] == 0.0


def test_rl_loss_on_device_keeps_every_metric_a_tensor_of_the_same_value() -> None:
    lp = torch.tensor([[0.0, LN(0.5), 7.0]])
    args = (lp, torch.zeros(1, 3), torch.tensor([[-LN(3.0), 0.0, 0.0]]), torch.tensor([[1.0, -1.0, 1.0]]),
            torch.tensor([[1, 1, 0]]), full_cfg(kl_coef=0.0, entropy_coef=0.0), 2.0)
    loss, floats = rl_loss(*args)
    loss_t, tensors = rl_loss_on_device(*args)
    assert torch.equal(loss, loss_t) and tensors.keys() == floats.keys()
    for key, value in tensors.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad, key
        assert value.item() == floats[key], key
    assert tensors["loss/kl"].item() == 0.0  # no ref logprobs: a zero, as rl_loss reports


def test_rl_loss_requires_ref_logprobs_when_kl_coef_is_positive() -> None:
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        rl_loss(z, z, z, z, torch.ones(1, 2), full_cfg(entropy_coef=0.0), 2.0)


def test_rl_loss_requires_entropy_when_entropy_coef_is_positive() -> None:
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="entropy"):
        rl_loss(z, z, z, z, torch.ones(1, 2), full_cfg(kl_coef=0.0), 2.0)


@pytest.mark.parametrize("loss_name", ["ppo", "gspo"])
def test_rl_loss_over_two_micro_batches_with_global_normaliser_equals_full_batch(loss_name: str) -> None:
    g = torch.Generator().manual_seed(0)
    B, T = 4, 5
    lp = (torch.randn(B, T, generator=g) * 0.3 - 1.0).requires_grad_()
    old, engine, ref = (lp.detach() + 0.2 * torch.randn(B, T, generator=g) for _ in range(3))
    adv = torch.randn(B, 1, generator=g).expand(B, T)
    ent = torch.rand(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1
    cfg = full_cfg(loss=loss_name, kl_type="k3")
    n_tokens = float(mask.sum())

    def run(sl: slice):
        return rl_loss(lp[sl], old[sl], engine[sl], adv[sl], mask[sl], cfg, n_tokens,
                       ref_logprobs=ref[sl], entropy=ent[sl])

    full_loss, full_m = run(slice(0, B))
    (full_grad,) = torch.autograd.grad(full_loss, lp)
    (loss_a, m_a), (loss_b, m_b) = run(slice(0, 2)), run(slice(2, B))
    (split_grad,) = torch.autograd.grad(loss_a + loss_b, lp)
    torch.testing.assert_close(loss_a + loss_b, full_loss)
    torch.testing.assert_close(split_grad, full_grad)
    for key in full_m:
        assert m_a[key] + m_b[key] == pytest.approx(full_m[key], abs=1e-6), key
