"""Tinker's built-in RL losses and the sampler's top_k / top_p cut, on small tensors worked out by hand."""
import math

import pytest
import torch

from app.tinker.sampler import truncated
from app.tinker.trainer import Refused, elementwise_loss

# The learner's log-probs p and the sampler's q: log(p/q) = [0.5, -0.5, 0], so the token ratios are
# [e^0.5 = 1.6487, e^-0.5 = 0.6065, 1], clipped to [0.8, 1.2] (the default thresholds): [1.2, 0.8, 1]
LEARNER, SAMPLED, ADVANTAGES = [-1.0, -2.0, -0.5], [-1.5, -1.5, -0.5], [1.0, 2.0, -1.0]


def loss_and_grad(loss_fn: str, config: dict | None = None, **more) -> tuple[list[float], list[float]]:
    logprobs = torch.tensor(LEARNER, requires_grad=True)
    loss = elementwise_loss(loss_fn, logprobs, {"logprobs": SAMPLED, "advantages": ADVANTAGES, **more}, config or {})
    loss.sum().backward()
    return loss.tolist(), logprobs.grad.tolist()


def test_cispo_weighs_the_log_prob_by_the_clipped_ratio_held_constant():
    loss, grad = loss_and_grad("cispo")
    # -clip(r) * log p * A = -[1.2 * -1 * 1, 0.8 * -2 * 2, 1 * -0.5 * -1] = [1.2, 3.2, -0.5]
    assert loss == pytest.approx([1.2, 3.2, -0.5])
    # the ratio is a constant: d/dlog p = -clip(r) * A = [-1.2, -1.6, 1], even where the ratio is clipped
    assert grad == pytest.approx([-1.2, -1.6, 1.0])
    # other thresholds: clip to [0.9, 1.1] gives [1.1, 0.9, 1]
    assert loss_and_grad("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})[0] == \
        pytest.approx([1.1, 3.6, -0.5])


def test_dro_is_the_log_prob_times_the_advantage_less_a_quadratic_penalty_on_the_log_ratio():
    loss, grad = loss_and_grad("dro", {"beta": 0.5})
    # -(log p * A - beta / 2 * log(p/q)^2) = -([-1, -4, 0.5] - 0.25 * [0.25, 0.25, 0]) = [1.0625, 4.0625, -0.5]
    assert loss == pytest.approx([1.0625, 4.0625, -0.5])
    # d/dlog p = -(A - beta * log(p/q)) = -([1, 2, -1] - 0.5 * [0.5, -0.5, 0]) = [-0.75, -2.25, 1]
    assert grad == pytest.approx([-0.75, -2.25, 1.0])
    with pytest.raises(Refused, match=r"loss_fn 'dro' needs loss_fn_config\['beta'\]"):
        loss_and_grad("dro")


def test_gspo_gives_every_token_the_sequence_ratio_of_the_marked_tokens_and_clips_that():
    loss, grad = loss_and_grad("gspo", sequence_ratio_mask=[0.0, 1.0, 1.0])
    # the marked tokens' mean log-ratio is (-0.5 + 0) / 2 = -0.25: every token's ratio is s = e^-0.25 = 0.7788
    # (the first token's own 1.6487 does not count), clipped to 0.8. min(s A, 0.8 A) = [s, 2s, -0.8]
    s = math.exp(-0.25)
    assert loss == pytest.approx([-s, -2 * s, 0.8])
    # each token has its own log-prob's gradient, times s: -s A where unclipped; none where the clip won
    assert grad == pytest.approx([-s, -2 * s, 0.0])
    with pytest.raises(Refused, match="sequence_ratio_mask marks no token"):
        loss_and_grad("gspo", sequence_ratio_mask=[0.0, 0.0, 0.0])
    with pytest.raises(Refused, match=r"loss_fn 'gspo' needs loss_fn_inputs\['sequence_ratio_mask'\]"):
        loss_and_grad("gspo")
    with pytest.raises(Refused, match=r"\['sequence_ratio_mask'\] has shape \(2,\): one value per target token"):
        loss_and_grad("gspo", sequence_ratio_mask=[1.0, 1.0])


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # softmax: e^[2, 1, 0, -1] / 11.475 = [0.644, 0.237, 0.087, 0.032]; the mass before each: [0, 0.644, 0.881, 0.968]
    kept = {(k, p): torch.isfinite(truncated(logits, k, p))[0].tolist()
            for k, p in [(-1, 1.0), (2, 1.0), (1, 1.0), (-1, 0.5), (-1, 0.8), (-1, 0.9), (3, 0.8), (4, 1.0)]}
    assert kept == {(-1, 1.0): [True] * 4, (2, 1.0): [True, True, False, False], (1, 1.0): [True, False, False, False],
                    (-1, 0.5): [True, False, False, False], (-1, 0.8): [True, True, False, False],
                    (-1, 0.9): [True, True, True, False], (3, 0.8): [True, True, False, False], (4, 1.0): [True] * 4}
    # what stays keeps its logit: log_softmax of the cut renormalises over the kept tokens
    assert torch.log_softmax(truncated(logits, 2, 1.0), -1)[0, :2].exp().tolist() == \
        pytest.approx([1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1))])
