"""RL maths for the trainer: advantage estimators, off-policy importance weights, KL penalties and policy losses."""

import torch

from .config import GROUP_ESTIMATORS

ESTIMATORS = (*GROUP_ESTIMATORS, "reinforce_baseline")
IS_LEVELS = ("off", "token", "seq", "geo")
IS_MODES = ("trunc", "clip", "mask")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSSES = ("ppo", "gspo")
# exp(20) ~ 5e8: far outside any sane trust region, yet finite (also after squaring or summing in float32).
MAX_LOG_RATIO = 20.0


def _check(kind: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {kind} {value!r}; expected one of {allowed}")


def advantages(rewards: torch.Tensor, estimator: str, eps: float = 1e-4) -> torch.Tensor:
    """Per-episode advantages from rewards [n_groups, G] (G episodes per prompt); returns the same shape."""
    _check("advantage estimator", estimator, ESTIMATORS)
    group_size = rewards.shape[1]
    if estimator in GROUP_ESTIMATORS and group_size < 2:
        raise ValueError(f"estimator {estimator!r} needs group_size >= 2, got group_size={group_size}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        return centered / (rewards.std(dim=1, keepdim=True) + eps)
    if estimator in ("dr_grpo", "rloo"):  # rloo: r_i - mean_{j != i} r_j, the group-centred reward x G / (G - 1)
        return centered * (group_size / (group_size - 1) if estimator == "rloo" else 1)
    # reinforce_baseline: one baseline over the whole batch. The unbiased std of a single value is nan; use 0.
    std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
    return (rewards - rewards.mean()) / (std + eps)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask==True; 0.0 (still differentiable w.r.t. x) when the mask is empty."""
    # where() rather than x * mask: nan/inf garbage outside the mask would survive a multiplication by 0.
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


def is_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
               level: str, mode: str, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights proximal/behaviour and which masked tokens fell outside [low, high]; both [B, T].

    A nan log-ratio (-inf - -inf: both policies underflowed) has no meaningful ratio: in every mode such a
    token gets weight 0 and counts as filtered; at "seq"/"geo" level it does so for its whole sequence.
    """
    _check("IS level", level, IS_LEVELS)
    _check("IS mode", mode, IS_MODES)
    if level == "off":
        return mask.to(prox_logp.dtype), torch.zeros_like(mask)
    # Weights are constants of the loss; garbage outside the mask is zeroed before it can be summed.
    log_rho = (prox_logp - behav_logp).detach()
    undefined = torch.isnan(log_rho) & mask
    log_rho = torch.where(mask & ~undefined, log_rho, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if level != "token":
        undefined = undefined.any(dim=1, keepdim=True) & mask
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1) if level == "geo" else 1  # geo: the per-token mean
        log_rho = (log_rho.sum(dim=1, keepdim=True) / lengths).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).expand_as(log_rho)
    rho = log_rho.exp()
    # trunc: capped at high; clip: clamped into [low, high]; mask: 0 outside [low, high]
    outside = rho > high if mode == "trunc" else (rho < low) | (rho > high)
    weights = torch.where(outside, 0.0, rho) if mode == "mask" else rho.clamp(low if mode == "clip" else None, high)
    weights = torch.where(mask & ~undefined, weights, 0.0)
    return weights, (outside | undefined) & mask


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from log-probs of tokens sampled from pi (Schulman's k1, k2, k3)."""
    _check("KL estimator", estimator, KL_ESTIMATORS)
    d = ref_logp - logp
    # -inf log-probs must not overflow exp() or poison gradients: a nan difference (-inf - -inf) reads as
    # "no difference", and the rest is clamped (zero gradient beyond the clamp).
    d = torch.where(torch.isnan(d), 0.0, d).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return -d if estimator == "k1" else 0.5 * d**2 if estimator == "k2" else d.exp() - d - 1


def policy_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, loss: str = "ppo", clip_low: float = 0.2, clip_high: float = 0.28,
                is_level: str = "token", is_mode: str = "trunc", is_low: float = 0.0, is_high: float = 2.0,
                kl_coef: float = 0.0, ref_logp: torch.Tensor | None = None, kl_estimator: str = "k3"
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean clipped policy-gradient loss (decoupled PPO or GSPO-token) with off-policy IS correction.

    logp [B, T] carries the gradient; prox_logp is the same policy detached; behav_logp was recorded by the
    sampler; advantages [B] holds one value per episode, or [B, T] one per token (distillation's); mask [B, T] marks the trained action tokens.
    Returns (scalar loss, stats as python floats). kl_ref is reported whenever ref_logp is given, and only
    enters the loss when kl_coef > 0.
    """
    _check("loss", loss, LOSSES)
    _check("KL estimator", kl_estimator, KL_ESTIMATORS)  # a bad config fails even while the KL term is off
    w, filtered = is_weights(prox_logp, behav_logp, mask, is_level, is_mode, is_low, is_high)
    # Sanitise before exp(): masked-out garbage and -inf - -inf must reach neither the loss nor the gradient.
    # Every later value is finite everywhere, so zero upstream gradients never meet an inf (0 * inf = nan).
    diff = logp - prox_logp.detach()
    diff = torch.where(mask & ~torch.isnan(diff), diff, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if loss == "ppo":
        ratio = diff.exp()
    else:
        # GSPO-token: each token's ratio has the value of its sequence's geometric-mean ratio, but its own gradient.
        log_s = diff.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        ratio = (diff - diff.detach() + log_s.detach()).exp()
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(ratio.dtype)
    unclipped, clipped = ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    total = masked_mean(-w * torch.minimum(unclipped, clipped), mask)

    kl = kl_penalty(logp, ref_logp, kl_estimator) if ref_logp is not None else torch.zeros_like(diff)
    if kl_coef > 0 and ref_logp is not None:
        total = total + kl_coef * masked_mean(kl, mask)

    with torch.no_grad():
        gap = prox_logp - behav_logp
        finite = mask & torch.isfinite(gap)  # underflowed tokens show up in is_filter_ratio instead
        stats = {"clip_ratio": masked_mean((clipped < unclipped).float(), mask),
                 "is_filter_ratio": masked_mean(filtered.float(), mask), "mismatch_abs": masked_mean(gap.abs(), finite),
                 "mismatch_kl": masked_mean(kl_penalty(behav_logp, prox_logp, "k3"), finite),
                 "kl_ref": masked_mean(kl, mask), "ratio_mean": masked_mean(ratio, mask)}
    return total, {name: value.item() for name, value in stats.items()}
