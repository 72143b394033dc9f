"""One trainer step on a batch of groups (advantages, minibatched PPO/GSPO optimizer steps against the proximal policy,
the breaker's verdict) and the batch's episode metrics."""
import math

import torch
import torch.nn.functional as F

from . import dist, drills
from .algo import GROUP_ESTIMATORS, advantages, policy_loss
from .episode import Episode, collate, token_logprobs, uncollated
from .models import routers, routing_stats


def train_step(model, optimizer, groups: list[list[Episode]], cfg, *, step: int, breaker, published: dict,
               reference=None, pad_id: int) -> tuple[dict, dict | None, list[float], dict[int, list]]:
    """Update `model` on a batch (runs in a worker thread): `algo.epochs` passes over the batch, each split into
    `algo.minibatches` optimizer steps. The clip measures each step against the proximal policy, the weights at the
    start of this trainer step (`published`, as in decoupled PPO), and the IS weights correct from the behaviour
    policy to it. Returns the update's metrics and the weights to publish; None when the breaker refused a step:
    then `model` holds `published` again. Metrics average over the optimizer steps; `grad_norm` is their largest,
    the one the breaker judged. Also returns each episode's advantage and, for the episodes in the forward (by batch
    index), their tokens' log-probs under the proximal policy: what the samples record as the trainer's."""
    algo, episodes = cfg.algo, [e for g in groups for e in g]
    if algo.estimator in GROUP_ESTIMATORS:
        adv = torch.cat([advantages(torch.tensor([[e.reward for e in g]]), algo.estimator)[0] for g in groups])
    else:  # batch-level baseline: the whole batch is one "group"
        adv = advantages(torch.tensor([[e.reward for e in episodes]]), algo.estimator)[0]
    # Whole groups per minibatch (a group's prompt then runs once), in prompt order, the same in every epoch.
    bounds = [round(i * len(groups) / algo.minibatches) for i in range(algo.minibatches + 1)]
    starts = [sum(len(g) for g in groups[:b]) for b in bounds]
    parts = [_Minibatch(episodes, adv, range(a, b), algo.kl_coef, pad_id) for a, b in zip(starts, starts[1:])]
    # More than one process: the token mean is over every rank's minibatch (the all-reduce averages the gradients)
    for part, tokens in zip(parts, dist.all_sum([p.action_tokens for p in parts])):
        part.action_tokens = tokens / dist.world()
    with torch.no_grad():  # the proximal log-probs of minibatches after the first: before any optimizer step
        for part in parts[1:]:
            part.prox = _logprobs(model, part.batch, cfg, stats=False)[0]
    threshold = breaker.threshold()
    coef = algo.router_aux_coef if algo.router_aux_coef is not None else getattr(model.config, "router_aux_loss_coef", 0.0)
    norms, runs = [], []
    for part in [p for _ in range(algo.epochs) for p in parts]:
        logp, aux, moe_metrics = _logprobs(model, part.batch, cfg, stats=True)
        if part.prox is None:  # the first minibatch of the first epoch: the model is still the proximal policy
            part.prox = logp.detach()
        ref_logp = None
        if reference is not None:
            with torch.no_grad():
                ref_logp = token_logprobs(reference, part.batch, cfg.loop.temperature)
        mask = part.batch["action_mask"]
        loss, stats = policy_loss(
            logp, part.prox, part.batch["behav_logp"], part.adv, mask,
            loss=algo.loss, clip_low=algo.clip_low, clip_high=algo.clip_high, is_level=algo.is_level,
            is_mode=algo.is_mode, is_low=algo.is_low, is_high=algo.is_high, kl_coef=algo.kl_coef, ref_logp=ref_logp,
            kl_estimator=algo.kl_estimator)
        loss = loss * (int(mask.sum()) / max(part.action_tokens, 1))  # the token mean over the whole minibatch
        if not norms:
            loss = drills.poison_loss(cfg.drills, step, loss)
        optimizer.zero_grad(set_to_none=True)
        (loss + coef * aux).backward()
        if not norms and dist.rank() == 0:  # one rank's gradient: every rank must still skip the step
            drills.spike_gradient(cfg.drills, step, model)
        norms.append(dist.clip_grad_norm(model, algo.max_grad_norm))
        runs.append({"policy_loss": loss.item(), **stats, **moe_metrics})
        if breaker.refuses(norms[-1]):
            break
        if norms[-1] > 0:  # no signal (all advantages 0): Adam's momentum alone would still move the weights
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    grad_norm = math.nan if any(math.isnan(n) for n in norms) else max(norms)
    tripped = breaker.check(step, grad_norm)
    weights = None if tripped else dist.full_weights(model)
    if weights is not None and not all(torch.isfinite(v).all() for v in weights.values()):
        # Never publish (or checkpoint) non-finite weights: count a trip.
        breaker.check(step, math.nan)
        tripped, weights = True, None
    if tripped:  # back to the last published weights (Adam's moments keep what earlier minibatches added)
        dist.load_weights(model, published)
    metrics = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    metrics.update(grad_norm=grad_norm, lr=optimizer.param_groups[0]["lr"], breaker_tripped=float(tripped),
                   trained_fraction=sum(p.trained for p in parts) / len(episodes))
    if math.isfinite(threshold):
        metrics["breaker_threshold"] = threshold
    trainer_logprobs = {i: row for p in parts for i, row in zip(p.keep, uncollated(
        p.prox, range(len(p.keep)), [episodes[i] for i in p.keep], p.batch["prompt_width"]))}
    return metrics, weights, adv.tolist(), trainer_logprobs


class _Minibatch:
    """A slice of the batch's episodes, collated once for all epochs. Episodes with advantage 0 add exactly 0 to the
    policy gradient: they stay out of the forward and backward (the bulk of a step once most groups are solved),
    while the token mean still counts their tokens. The KL term is nonzero everywhere, so with it on, every episode
    is trained."""

    def __init__(self, episodes: list[Episode], adv: torch.Tensor, span: range, kl_coef: float, pad_id: int):
        keep = [i for i in span if adv[i] != 0 or kl_coef > 0] or list(span)
        self.keep = keep
        self.batch = collate([episodes[i] for i in keep], pad_id)
        self.adv = adv[keep]
        self.action_tokens = sum(episodes[i].n_actions for i in span)
        self.trained = len(keep)
        self.prox: torch.Tensor | None = None


def _logprobs(model, batch: dict, cfg, stats: bool) -> tuple[torch.Tensor, torch.Tensor | float, dict]:
    """The training forward: the targets' log-probs and, for an MoE policy with `stats`, the balance loss and routing
    metrics. With routing replay, each action token goes through the experts the sampler recorded for it."""
    moe = routers(model) if "routes" in batch else []
    for l, router in enumerate(moe):  # without replay, all -1: every position routes freely
        routes = batch["routes"][:, :, l].reshape(-1, router.top_k)
        router.replay = routes if cfg.algo.routing_replay else torch.full_like(routes, -1)
    try:
        logp = token_logprobs(model, batch, cfg.loop.temperature)
        aux, moe_metrics = (0.0, {})
        if moe and stats:
            aux, moe_metrics = routing_stats(moe, batch["attention_mask"], batch["routes"],
                                             F.pad(batch["action_mask"], (0, 1)))
    finally:
        for router in moe:  # the logits hold the autograd graph: a model holding them can't be deep-copied
            router.replay = router.logits = None
    return logp, aux, moe_metrics


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
