"""Unit tests for molt_engine.algo, pinned to hand-computed values (including empty masks and -inf log-probs)."""

import math

import pytest
import torch

from molt_engine.algo import (GROUP_ESTIMATORS, IS_LEVELS, IS_MODES, advantages, is_weights,
                              kl_penalty, masked_mean, policy_loss)

INF = float("inf")
NAN = float("nan")
T, F = True, False


def close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- advantages

# Group 0 is mixed, group 1 is all-equal (advantage must be 0, not nan).
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]])


def test_grpo_hand_values():
    # group 0: mean 0.5, centred ±0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.5773503
    # -> ±0.5 / (0.5773503 + 1e-4) = ±0.8658754; group 1: 0 / (0 + 1e-4) = 0
    a = 0.8658754
    close(advantages(REWARDS, "grpo"), [[a, -a, -a, a], [0.0, 0.0, 0.0, 0.0]])


def test_dr_grpo_hand_values():
    # r - group mean, no std normalisation
    close(advantages(REWARDS, "dr_grpo"), [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])


def test_rloo_hand_values():
    # r_0 = 1, mean of the others (0, 0, 1) = 1/3 -> 2/3; r_1 = 0, mean of (1, 0, 1) = 2/3 -> -2/3
    close(advantages(REWARDS, "rloo"), [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0, 0.0, 0.0, 0.0]])


def test_reinforce_baseline_hand_values():
    # all 8 rewards: mean 14/8 = 1.75; squared deviations 0.5625*2 + 3.0625*2 + 1.5625*4 = 13.5
    # unbiased std sqrt(13.5 / 7) = 1.3887301; -0.75/1.38873 = -0.5400617, -1.75/.. = -1.2601440, 1.25/.. = 0.9001029
    a, b, c = -0.5400617, -1.2601440, 0.9001029
    close(advantages(REWARDS, "reinforce_baseline", eps=0.0), [[a, b, b, a], [c, c, c, c]])


def test_reinforce_baseline_works_with_group_size_one():
    # [[1], [3]]: mean 2, std sqrt(2) -> ±1/sqrt(2) = ±0.7071068
    close(advantages(torch.tensor([[1.0], [3.0]]), "reinforce_baseline", eps=0.0), [[-0.7071068], [0.7071068]])
    # a single episode: std taken as 0 -> advantage 0, not nan
    close(advantages(torch.tensor([[5.0]]), "reinforce_baseline"), [[0.0]])


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_estimators_reject_group_size_one(estimator):
    with pytest.raises(ValueError, match="group_size"):
        advantages(torch.tensor([[1.0], [0.0]]), estimator)


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="ppo_gae"):
        advantages(REWARDS, "ppo_gae")


# ---------------------------------------------------------------- masked_mean

def test_masked_mean_ignores_garbage_and_handles_empty():
    x = torch.tensor([[1.0, 2.0, NAN], [3.0, -INF, 5.0]], requires_grad=True)
    mask = torch.tensor([[T, T, F], [T, F, F]])
    close(masked_mean(x, mask), 2.0)  # (1 + 2 + 3) / 3
    empty = masked_mean(x, torch.zeros_like(mask))
    close(empty, 0.0)
    empty.backward()
    close(x.grad, torch.zeros(2, 3))


# ---------------------------------------------------------------- importance weights

# rho = prox / behav per token: row 0 = [0.5, 1, 5], row 1 = [0.25, 1.5, <masked out: nan - -inf>].
# seq: row 0 = 0.5 * 1 * 5 = 2.5, row 1 = 0.25 * 1.5 = 0.375
# geo: row 0 = 2.5 ** (1/3) = 1.3572088, row 1 = 0.375 ** (1/2) = 0.6123724
# band: low 0.7, high 2.0
MASK = torch.tensor([[T, T, T], [T, T, F]])
BEHAV = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, -1.0, -INF]])
PROX = BEHAV + torch.log(torch.tensor([[0.5, 1.0, 5.0], [0.25, 1.5, 1.0]]))
PROX[1, 2] = NAN
G0, G1 = 1.3572088, 0.6123724
IS_CASES = {
    ("token", "trunc"): ([[0.5, 1, 2], [0.25, 1.5, 0]], [[F, F, T], [F, F, F]]),
    ("token", "clip"): ([[0.7, 1, 2], [0.7, 1.5, 0]], [[T, F, T], [T, F, F]]),
    ("token", "mask"): ([[0, 1, 0], [0, 1.5, 0]], [[T, F, T], [T, F, F]]),
    ("seq", "trunc"): ([[2, 2, 2], [0.375, 0.375, 0]], [[T, T, T], [F, F, F]]),
    ("seq", "clip"): ([[2, 2, 2], [0.7, 0.7, 0]], [[T, T, T], [T, T, F]]),
    ("seq", "mask"): ([[0, 0, 0], [0, 0, 0]], [[T, T, T], [T, T, F]]),
    ("geo", "trunc"): ([[G0, G0, G0], [G1, G1, 0]], [[F, F, F], [F, F, F]]),
    ("geo", "clip"): ([[G0, G0, G0], [0.7, 0.7, 0]], [[F, F, F], [T, T, F]]),
    ("geo", "mask"): ([[G0, G0, G0], [0, 0, 0]], [[F, F, F], [T, T, F]]),
    ("off", "trunc"): ([[1, 1, 1], [1, 1, 0]], [[F, F, F], [F, F, F]]),
}


@pytest.mark.parametrize("level,mode", IS_CASES)
def test_is_weights_hand_values(level, mode):
    expected_w, expected_filtered = IS_CASES[(level, mode)]
    w, filtered = is_weights(PROX, BEHAV, MASK, level, mode, low=0.7, high=2.0)
    close(w, expected_w)
    assert filtered.dtype == torch.bool
    assert filtered.tolist() == expected_filtered


def test_is_weights_cover_every_level_and_mode():
    assert {level for level, _ in IS_CASES} == set(IS_LEVELS)
    assert {mode for _, mode in IS_CASES} == set(IS_MODES)


def test_is_weights_with_underflowed_log_probs():
    # row 0: behav -inf -> log rho +inf, clamped to 20 -> truncated to high, filtered;
    #        prox -inf -> log rho clamped to -20 -> rho = exp(-20) = 2.0611536e-9, kept;
    #        both -inf -> nan log rho: undefined, weight 0 and filtered (in every mode)
    prox = torch.tensor([[-1.0, -INF, -INF], [0.0, 0.0, 0.0]])
    behav = torch.tensor([[-INF, -1.0, -INF], [0.0, 0.0, 0.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    w, filtered = is_weights(prox, behav, mask, "token", "trunc", 0.0, 2.0)
    close(w, [[2.0, 2.0611536e-9, 0.0], [1.0, 1.0, 1.0]])
    assert filtered.tolist() == [[T, F, T], [F, F, F]]
    w, filtered = is_weights(prox, behav, mask, "token", "mask", 0.0, 2.0)
    close(w, [[0.0, 2.0611536e-9, 0.0], [1.0, 1.0, 1.0]])
    assert filtered.tolist() == [[T, F, T], [F, F, F]]
    # a sequence holding an undefined token is dropped as a whole
    for level in ("seq", "geo"):
        for mode in IS_MODES:
            w, filtered = is_weights(prox, behav, mask, level, mode, 0.0, 2.0)
            close(w, [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
            assert filtered.tolist() == [[T, T, T], [F, F, F]]


def test_is_weights_empty_mask():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for level in IS_LEVELS:
        for mode in IS_MODES:
            w, filtered = is_weights(PROX, BEHAV, mask, level, mode, 0.7, 2.0)
            close(w, torch.zeros(2, 3))
            assert not filtered.any()


def test_is_weights_reject_unknown_names():
    with pytest.raises(ValueError, match="sentence"):
        is_weights(PROX, BEHAV, MASK, "sentence", "trunc", 0.0, 2.0)
    with pytest.raises(ValueError, match="squash"):
        is_weights(PROX, BEHAV, MASK, "token", "squash", 0.0, 2.0)


# ---------------------------------------------------------------- KL penalty

def test_kl_estimators_hand_values():
    logp = torch.tensor([0.0, -1.0, -2.0])
    ref = torch.tensor([-1.0, -1.0, 0.0])
    # d = ref - logp = [-1, 0, 2]
    close(kl_penalty(logp, ref, "k1"), [1.0, 0.0, -2.0])  # -d
    close(kl_penalty(logp, ref, "k2"), [0.5, 0.0, 2.0])  # d^2 / 2
    close(kl_penalty(logp, ref, "k3"), [0.3678794, 0.0, 4.3890561])  # e^-1 + 1 - 1, 0, e^2 - 2 - 1
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, ref, "k4")


def test_kl_penalty_stays_finite_with_infinite_log_probs():
    logp = torch.tensor([0.0, -INF, -INF, -1.0], requires_grad=True)
    ref = torch.tensor([-INF, 0.0, -INF, NAN])
    for estimator in ("k1", "k2", "k3"):
        kl = kl_penalty(logp, ref, estimator)
        assert torch.isfinite(kl).all()
        logp.grad = None
        kl.sum().backward()
        assert torch.isfinite(logp.grad).all()


# ---------------------------------------------------------------- policy loss

LOGP = [[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]]
ADV = torch.tensor([2.0, -1.0])
N_TOKENS = 5  # masked tokens in MASK


def leaf(values):
    return torch.tensor(values, requires_grad=True)


def test_ppo_on_policy_is_minus_mean_advantage():
    logp = leaf(LOGP)
    prox = logp.detach()
    loss, stats = policy_loss(logp, prox, prox, ADV, MASK)
    # r == 1 everywhere: loss = -(2 * 3 + (-1) * 2) / 5 = -0.8
    close(loss, -0.8)
    loss.backward()
    # d loss / d logp = -A * r / N = -A / 5 on masked tokens
    close(logp.grad, [[-0.4, -0.4, -0.4], [0.2, 0.2, 0.0]])
    assert stats == {"clip_ratio": 0.0, "is_filter_ratio": 0.0, "mismatch_abs": 0.0, "mismatch_kl": 0.0,
                     "kl_ref": 0.0, "ratio_mean": 1.0}


def test_ppo_clipping_zeroes_gradient():
    logp = leaf(LOGP)
    # r = exp(logp - prox) = exp(offset): token (0,0) r = e > 1.28 with A = 2 > 0 -> clipped to 1.28;
    # token (1,0) r = e^-1 = 0.368 < 0.8 with A = -1 -> min(-0.368, -0.8) = -0.8, clipped too.
    offset = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
    prox = logp.detach() - offset
    loss, stats = policy_loss(logp, prox, prox, ADV, MASK)
    # per token: -1.28*2, -2, -2 | +0.8, +1 -> sum -4.76 -> / 5 = -0.952
    close(loss, -0.952)
    loss.backward()
    close(logp.grad, [[0.0, -0.4, -0.4], [0.0, 0.2, 0.0]])
    assert stats["clip_ratio"] == pytest.approx(2 / 5)
    # (e + 1 + 1 + e^-1 + 1) / 5
    assert stats["ratio_mean"] == pytest.approx(1.2172323, rel=1e-6)


def test_ppo_importance_weight_and_mismatch_stats():
    logp = leaf(LOGP)
    prox = logp.detach()
    behav = prox.clone()
    behav[1, 1] -= math.log(4.0)  # rho = 4 -> truncated to is_high = 2, filtered
    loss, stats = policy_loss(logp, prox, behav, ADV, MASK, is_level="token", is_mode="trunc", is_high=2.0)
    # per token: -2, -2, -2 | +1, -2 * (1 * -1) = +2 -> sum -3 -> / 5 = -0.6
    close(loss, -0.6)
    loss.backward()
    close(logp.grad, [[-0.4, -0.4, -0.4], [0.2, 0.4, 0.0]])
    assert stats["is_filter_ratio"] == pytest.approx(1 / 5)
    assert stats["mismatch_abs"] == pytest.approx(math.log(4.0) / 5, rel=1e-6)  # 0.2772589
    # k3 with d = prox - behav = log 4: 4 - log 4 - 1 = 1.6137056, one token of five
    assert stats["mismatch_kl"] == pytest.approx(0.3227411, rel=1e-6)


def test_kl_term_is_added_to_the_loss():
    logp = leaf(LOGP)
    prox = logp.detach()
    ref = prox - 1.0  # d = ref - logp = -1 -> k3 = e^-1 + 1 - 1 = 0.3678794 per token
    loss, stats = policy_loss(logp, prox, prox, ADV, MASK, kl_coef=0.1, ref_logp=ref)
    close(loss, -0.8 + 0.1 * 0.3678794)  # -0.7632121
    assert stats["kl_ref"] == pytest.approx(0.3678794, rel=1e-6)
    # kl_coef 0: reported but not added
    loss, stats = policy_loss(logp, prox, prox, ADV, MASK, kl_coef=0.0, ref_logp=ref)
    close(loss, -0.8)
    assert stats["kl_ref"] == pytest.approx(0.3678794, rel=1e-6)


def test_gspo_sequence_ratio_and_clipping():
    logp = leaf(LOGP)
    # logp - prox = offset; the last slot of row 1 is masked out and must not count.
    offset = torch.tensor([[0.3, 0.6, 0.0], [0.1, -0.3, 9.0]])
    prox = logp.detach() - offset
    loss, stats = policy_loss(logp, prox, prox, ADV, MASK, loss="gspo")
    # row 0: s = exp((0.3 + 0.6 + 0) / 3) = e^0.3 = 1.3498588 > 1.28, A = 2 -> every token clipped (-1.28 * 2)
    #        (token-level PPO would leave token (0,2), r = 1, unclipped)
    # row 1: s = exp((0.1 - 0.3) / 2) = e^-0.1 = 0.9048374 inside [0.8, 1.28], A = -1 -> +0.9048374 per token
    # loss = (3 * -2.56 + 2 * 0.9048374) / 5 = -1.1740650
    close(loss, -1.1740650)
    loss.backward()
    # d s_t / d logp_t = s: row 0 clipped -> 0; row 1: -A * s / N = 0.9048374 / 5 = 0.1809675
    close(logp.grad, [[0.0, 0.0, 0.0], [0.1809675, 0.1809675, 0.0]])
    assert stats["clip_ratio"] == pytest.approx(3 / 5)
    # (3 * e^0.3 + 2 * e^-0.1) / 5
    assert stats["ratio_mean"] == pytest.approx(1.1718503, rel=1e-6)


def test_empty_mask_gives_zero_loss_grads_and_stats():
    logp = leaf([[-1.0, NAN, -INF], [-0.3, -1.2, 0.0]])
    prox = torch.tensor([[NAN, -INF, 0.0], [-INF, 1.0, 2.0]])
    behav = torch.tensor([[-INF, -INF, NAN], [0.0, NAN, -INF]])
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for loss_name in ("ppo", "gspo"):
        logp.grad = None
        loss, stats = policy_loss(logp, prox, behav, ADV, mask, loss=loss_name, kl_coef=0.1, ref_logp=behav)
        assert loss.item() == 0.0
        loss.backward()
        close(logp.grad, torch.zeros(2, 3))
        assert stats == dict.fromkeys(stats, 0.0) and len(stats) == 6


@pytest.mark.parametrize("loss_name", ["ppo", "gspo"])
@pytest.mark.parametrize("level", IS_LEVELS)
@pytest.mark.parametrize("mode", IS_MODES)
def test_infinite_log_probs_and_masked_garbage_stay_finite(loss_name, level, mode):
    # -inf where a probability underflowed (in logp/prox together, in behav, in ref), nan/inf in masked-out slots.
    logp = leaf([[-1.0, -INF, -0.5], [-0.3, -1.2, NAN]])
    prox = logp.detach().clone()
    prox[1, 2] = INF
    behav = torch.tensor([[-INF, -INF, -0.4], [-0.3, -1.0, -INF]])
    ref = torch.tensor([[-1.1, -INF, -INF], [-0.2, -1.0, NAN]])
    loss, stats = policy_loss(logp, prox, behav, ADV, MASK, loss=loss_name, is_level=level, is_mode=mode,
                              is_low=0.5, kl_coef=0.1, ref_logp=ref)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[1, 2] == 0.0  # masked-out slot gets no gradient
    assert all(math.isfinite(v) for v in stats.values())
    # the underflowed tokens are reported as filtered unless IS correction is off
    assert (stats["is_filter_ratio"] > 0) == (level != "off")


def test_policy_loss_rejects_unknown_names():
    logp = leaf(LOGP)
    prox = logp.detach()
    for kwargs, bad in [({"loss": "dpo"}, "dpo"), ({"is_level": "chunk"}, "chunk"),
                        ({"is_mode": "squash"}, "squash"), ({"kl_estimator": "k9"}, "k9")]:
        with pytest.raises(ValueError, match=bad):
            policy_loss(logp, prox, prox, ADV, MASK, **kwargs)
