"""One trainer step on a batch of groups (advantages, loss, the breaker's verdict, the optimizer step) and the batch's
episode metrics."""
import math

import torch
import torch.nn.functional as F

from . import drills
from .algo import GROUP_ESTIMATORS, advantages, policy_loss
from .episode import Episode, collate, token_logprobs
from .models import routers, routing_stats


def train_step(model, optimizer, groups: list[list[Episode]], cfg, *, step: int, breaker, published: dict,
               reference=None, pad_id: int) -> tuple[dict, dict | None]:
    """Update `model` on a batch (runs in a worker thread). Returns the update's metrics and the weights to publish,
    None when the breaker refused the update: then `model` holds `published` again (the last published weights)."""
    algo, episodes = cfg.algo, [e for g in groups for e in g]
    if algo.estimator in GROUP_ESTIMATORS:
        adv = torch.cat([advantages(torch.tensor([[e.reward for e in g]]), algo.estimator)[0] for g in groups])
    else:  # batch-level baseline: the whole batch is one "group"
        adv = advantages(torch.tensor([[e.reward for e in episodes]]), algo.estimator)[0]
    # Episodes with advantage 0 add exactly 0 to the policy gradient: leave them out of the forward and backward
    # (the bulk of a step once most groups are solved), keeping the token-mean over the whole batch's tokens.
    # The KL term is nonzero everywhere, so with it on, every episode is trained.
    keep = [i for i, a in enumerate(adv.tolist()) if a != 0 or algo.kl_coef > 0] or list(range(len(episodes)))
    batch = collate([episodes[i] for i in keep], pad_id)
    mask = batch["action_mask"]
    moe = routers(model) if "routes" in batch else []
    for l, router in enumerate(moe):  # without replay, all -1: every position routes freely
        routes = batch["routes"][:, :, l].reshape(-1, router.top_k)
        router.replay = routes if algo.routing_replay else torch.full_like(routes, -1)
    try:
        logp = token_logprobs(model, batch, cfg.loop.temperature)
        aux, moe_metrics = routing_stats(moe, batch["attention_mask"], batch["routes"],
                                         F.pad(mask, (0, 1))) if moe else (0.0, {})
    finally:
        for router in moe:  # the logits hold the autograd graph: a model holding them can't be deep-copied
            router.replay = router.logits = None
    ref_logp = None
    if reference is not None:
        with torch.no_grad():
            ref_logp = token_logprobs(reference, batch, cfg.loop.temperature)
    loss, stats = policy_loss(
        logp, logp.detach(), batch["behav_logp"], adv[keep], mask,
        loss=algo.loss, clip_low=algo.clip_low, clip_high=algo.clip_high, is_level=algo.is_level,
        is_mode=algo.is_mode, is_low=algo.is_low, is_high=algo.is_high, kl_coef=algo.kl_coef, ref_logp=ref_logp,
        kl_estimator=algo.kl_estimator)
    action_tokens = sum(e.n_actions for e in episodes)
    loss = drills.poison_loss(cfg.drills, step, loss * (int(mask.sum()) / max(action_tokens, 1)))
    optimizer.zero_grad(set_to_none=True)
    coef = algo.router_aux_coef if algo.router_aux_coef is not None else getattr(model.config, "router_aux_loss_coef", 0.0)
    (loss + coef * aux).backward()
    drills.spike_gradient(cfg.drills, step, model)
    threshold = breaker.threshold()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), algo.max_grad_norm))
    tripped = breaker.check(step, grad_norm)
    weights = None
    if not tripped:
        if grad_norm > 0:  # no signal (all advantages 0): Adam's momentum alone would still move the weights
            optimizer.step()
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if not all(torch.isfinite(v).all() for v in weights.values()):
            # Never publish (or checkpoint) non-finite weights: back to the last published ones, count a trip.
            model.load_state_dict(published)
            breaker.check(step, math.nan)
            tripped, weights = True, None
    optimizer.zero_grad(set_to_none=True)
    metrics = {"policy_loss": loss.item(), "grad_norm": grad_norm, "lr": optimizer.param_groups[0]["lr"],
               "trained_fraction": len(keep) / len(episodes), "breaker_tripped": float(tripped), **stats, **moe_metrics}
    if math.isfinite(threshold):
        metrics["breaker_threshold"] = threshold
    return metrics, weights


def batch_metrics(groups: list[list[Episode]], version: int) -> dict:
    """What the batch's episodes say, whatever the update did with them: reward, pass rate, lengths, staleness."""
    episodes = [e for g in groups for e in g]
    n, action_tokens = len(episodes), sum(e.n_actions for e in episodes)
    rewards = torch.tensor([e.reward for e in episodes])
    staleness = torch.tensor([version - v for e in episodes for v, a in zip(e.versions, e.is_action) if a],
                             dtype=torch.float32)
    return {
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if n > 1 else 0.0,
        "pass_rate": sum(e.info["success"] for e in episodes) / n,
        "entropy": sum(e.info["entropy"] for e in episodes) / max(action_tokens, 1),
        "response_length": action_tokens / n,
        "staleness_mean": float(staleness.mean()) if len(staleness) else 0.0,
        "staleness_max": float(staleness.max()) if len(staleness) else 0.0,
        "tool_call_rate": sum(e.info["tool_calls"] for e in episodes) / n,
        "turns_mean": sum(e.info["turns"] for e in episodes) / n,
    }
