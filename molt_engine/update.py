"""One trainer step on a batch of groups (advantages, minibatched PPO/GSPO optimizer steps against the proximal policy,
the breaker's verdict) and the batch's episode metrics."""
import contextlib
import math
import resource
from pathlib import Path

import torch
import torch.nn.functional as F

from . import dist, drills
from .algo import GROUP_ESTIMATORS, advantages, policy_loss
from .episode import Episode, collate, to_device, token_logprobs, uncollated
from .models import routers, routing_stats
from .scores import metric_means, scores


def train_step_fitting(model, optimizer, groups: list[list[Episode]], cfg, *, step: int, published: dict,
                       micro_batch_size: int | None, **kwargs) -> tuple[tuple, int | None]:
    """train_step, started over from `published` with micro-batches half the size (down to one episode) whenever it
    runs out of memory (`drills.oom_at`: its first try does). Returns train_step's results and the size that fit.
    More than one process: the ranks agree on running out in a forward (_agreed_memory), so all of them retry
    together; so do they in an optimizer step. One that runs out in a backward (the others are in its collectives)
    raises RestartSmaller at once: its exit ends the attempt (torchrun stops the others), not the group's timeout,
    and the restart starts from half the size (loop.Training notes it in the run's directory)."""
    first_try = True
    while True:
        results, error = None, None
        try:
            if first_try and dist.any_rank(drills.out_of_memory(cfg.drills, step, dist.rank(), "update")):
                raise _Agreed(f"drills.oom_at: out of memory injected at step {step}")
            results = train_step(model, optimizer, groups, cfg, step=step, published=published,
                                 micro_batch_size=micro_batch_size, **kwargs)
        except torch.OutOfMemoryError as e:
            error = e
        largest = micro_batch_size or sum(len(g) for g in groups)
        if error is not None and dist.world() > 1 and not isinstance(error, _Agreed):
            raise (RestartSmaller(largest // 2) if largest > 1 else error) from error
        if not dist.any_rank(error is not None):
            return results, micro_batch_size
        if largest == 1:
            raise error
        # As after a breaker trip, Adam's moments keep what optimizer steps before the error added.
        optimizer.zero_grad(set_to_none=True)
        dist.load_weights(model, published)
        torch.cuda.empty_cache()  # a no-op where CUDA was never initialised
        micro_batch_size, first_try = max(1, largest // 2), False


def train_step(model, optimizer, groups: list[list[Episode]], cfg, *, step: int, breaker, published: dict,
               reference=None, pad_id: int, micro_batch_size: int | None = None
               ) -> tuple[dict, dict | None, list[float], dict[int, list]]:
    """Update `model` on a batch (runs in a worker thread): `algo.epochs` passes over the batch, each split into
    `algo.minibatches` optimizer steps. The clip measures each step against the proximal policy, the weights at the
    start of this trainer step (`published`, as in decoupled PPO), and the IS weights correct from the behaviour
    policy to it. Returns the update's metrics and the weights to publish; None when the breaker refused a step:
    then `model` holds `published` again. Metrics average over the optimizer steps; `grad_norm` is their largest,
    the one the breaker judged. Also returns each episode's advantage and, for the episodes in the forward (by batch
    index), their tokens' log-probs under the proximal policy: what the samples record as the trainer's.
    Each forward/backward takes `micro_batch_size` episodes (None = a whole minibatch), gradients accumulating over
    the minibatch; forwards run under autocast in `model.dtype` while weights, gradients and AdamW stay fp32."""
    algo, episodes = cfg.algo, [e for g in groups for e in g]
    device = next(model.parameters()).device
    # An agent's episode may train as several rows (segments): the baselines count each episode once, by its first
    # row, and its later rows take its advantage.
    first = torch.tensor([e.opens_episode for e in episodes])
    if algo.estimator in GROUP_ESTIMATORS:
        adv = torch.cat([advantages(torch.tensor([[e.reward for e in one_per_episode(g)]]), algo.estimator)[0]
                         for g in groups])
    else:  # batch-level baseline: the whole batch (every rank's) is one "group"
        mine = [e.reward for e in one_per_episode(episodes)]
        ranks = dist.all_gather(mine)
        start = sum(map(len, ranks[:dist.rank()]))
        adv = advantages(torch.tensor([sum(ranks, [])]), algo.estimator)[0][start:start + len(mine)]
    adv = adv[first.cumsum(0) - 1]
    # Whole groups per minibatch (a group's prompt then runs once), in prompt order, the same in every epoch.
    bounds = [round(i * len(groups) / algo.minibatches) for i in range(algo.minibatches + 1)]
    starts = [sum(len(g) for g in groups[:b]) for b in bounds]
    parts = [_Minibatch(episodes, adv, range(a, b), algo.kl_coef, pad_id, micro_batch_size, device)
             for a, b in zip(starts, starts[1:])]
    # More than one process: the token mean is over every rank's minibatch (the all-reduce averages the gradients),
    # and every rank runs as many micro-batches (each backward is a collective): the fewer are padded.
    for part, tokens, count in zip(parts, dist.all_sum([p.action_tokens for p in parts]),
                                   dist.all_max([len(p.batches) for p in parts])):
        part.action_tokens = tokens / dist.world()
        part.pad(int(count))
    with torch.no_grad(), _autocast(cfg, device):  # the proximal log-probs of minibatches after the first
        for part in parts[1:]:                     # before any optimizer step
            for k, batch in enumerate(part.batches):
                with _agreed_memory():
                    part.prox[k] = _logprobs(model, batch, cfg, stats=False)[0]
    threshold = breaker.threshold()
    coef = algo.router_aux_coef if algo.router_aux_coef is not None else getattr(model.config, "router_aux_loss_coef", 0.0)
    norms, runs = [], []
    for part in [p for _ in range(algo.epochs) for p in parts]:
        optimizer.zero_grad(set_to_none=True)
        first, run = not norms, {}
        for k, batch in enumerate(part.batches):  # micro-batches: their gradients add up to the minibatch's
            with _autocast(cfg, device), _agreed_memory():
                logp, aux, moe_metrics = _logprobs(model, batch, cfg, stats=True)
                ref_logp = None
                if algo.kl_coef > 0:  # LoRA: no reference copy; the base is the policy with its adapters disabled
                    with torch.no_grad(), (model.disable_adapter() if reference is None else contextlib.nullcontext()):
                        ref_logp = token_logprobs(model if reference is None else reference, batch, cfg.loop.temperature)
            if part.prox[k] is None:  # the first minibatch of the first epoch: the model is still the proximal policy
                part.prox[k] = logp.detach()
            mask = batch["action_mask"]
            loss, stats = policy_loss(logp, part.prox[k], batch["behav_logp"], part.advs[k], mask, loss=algo.loss,
                                      clip_low=algo.clip_low, clip_high=algo.clip_high, is_level=algo.is_level,
                                      is_mode=algo.is_mode, is_low=algo.is_low, is_high=algo.is_high,
                                      kl_coef=algo.kl_coef, ref_logp=ref_logp, kl_estimator=algo.kl_estimator)
            real = k < len(part.keeps)  # else a padding micro-batch: it adds nothing
            loss = loss * (real * int(mask.sum()) / max(part.action_tokens, 1))  # the token mean over the minibatch
            if first and k == 0:
                loss = drills.poison_loss(cfg.drills, step, loss)
                if micro_batch_size == algo.micro_batch_size and drills.out_of_memory(cfg.drills, step, dist.rank(),
                                                                                      "backward"):
                    raise torch.OutOfMemoryError(f"drills.oom_at: out of memory injected in a backward at step {step}")
            (loss + coef * real * aux / len(part.keeps)).backward()
            dist.mark()
            weight = real * int(mask.sum()) / max(part.kept_tokens, 1)  # metrics: token means over the minibatch
            for key, value in {**stats, **moe_metrics}.items():
                run[key] = run.get(key, 0.0) + weight * value
            run["policy_loss"] = run.get("policy_loss", 0.0) + loss.item()
        if first and dist.rank() == 0:  # one rank's gradient: every rank must still skip the step
            drills.spike_gradient(cfg.drills, step, model)
        norms.append(dist.clip_grad_norm(model, algo.max_grad_norm))
        runs.append(run)
        if breaker.refuses(norms[-1]):
            break
        if norms[-1] > 0:  # no signal (all advantages 0): Adam's momentum alone would still move the weights
            with _agreed_memory("an optimizer step"):  # every rank steps here together: the norm is their largest
                optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    grad_norm = math.nan if any(math.isnan(n) for n in norms) else max(norms)
    tripped = breaker.check(step, grad_norm)
    weights = None if tripped else dist.full_weights(model)
    # Never publish (or checkpoint) non-finite weights: count a trip. A NaN or an infinity anywhere makes a sum
    # non-finite, and the sum needs no weight-sized temporaries (isfinite's were the whole step's peak).
    if weights is not None and not all(torch.isfinite(v.sum()) for v in weights.values()):
        breaker.check(step, math.nan)
        tripped, weights = True, None
    if tripped:  # back to the last published weights (Adam's moments keep what earlier minibatches added)
        dist.load_weights(model, published)
    metrics = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    metrics.update(grad_norm=grad_norm, lr=optimizer.param_groups[0]["lr"], breaker_tripped=float(tripped),
                   trained_fraction=sum(p.trained for p in parts) / len(episodes))
    if math.isfinite(threshold):
        metrics["breaker_threshold"] = threshold
    trainer_logprobs = {i: row for p in parts for keep, prox, batch in zip(p.keeps, p.prox, p.batches)
                        for i, row in zip(keep, uncollated(prox, range(len(keep)), [episodes[i] for i in keep],
                                                           batch["prompt_width"]))}
    return metrics, weights, adv.tolist(), trainer_logprobs


class _Minibatch:
    """A slice of the batch's episodes, collated once for all epochs. Episodes with advantage 0 add exactly 0 to the
    policy gradient: they stay out of the forward and backward (the bulk of a step once most groups are solved),
    while the token mean still counts their tokens. The KL term is nonzero everywhere, so with it on, every episode
    is trained, as is every episode a distillation teacher scored. The episodes kept go in micro-batches of `micro` (None = one), each collated onto `device`."""

    def __init__(self, episodes: list[Episode], adv: torch.Tensor, span: range, kl_coef: float, pad_id: int,
                 micro: int | None, device):
        keep = [i for i in span if adv[i] != 0 or kl_coef > 0 or "token_advantages" in episodes[i].info] or list(span)
        size = micro or len(keep)
        self.keeps = [keep[i:i + size] for i in range(0, len(keep), size)]
        self.batches = [to_device(collate([episodes[i] for i in k], pad_id), device) for k in self.keeps]
        self.advs = [adv[k].to(device)[:, None] + b["token_adv"] if "token_adv" in b else adv[k].to(device)
                     for k, b in zip(self.keeps, self.batches)]  # a teacher's per-token advantages added
        self.action_tokens = sum(episodes[i].n_actions for i in span)
        self.kept_tokens, self.trained = sum(int(b["action_mask"].sum()) for b in self.batches), len(keep)
        self.prox: list[torch.Tensor | None] = [None] * len(self.keeps)

    def pad(self, count: int):
        """Repeat the first micro-batch (weighted 0 in the loss) until there are `count`."""
        extra = count - len(self.batches)
        self.batches, self.advs, self.prox = (x + x[:1] * extra for x in (self.batches, self.advs, self.prox))


class RestartSmaller(torch.OutOfMemoryError):
    """This rank ran out of memory in a backward: the attempt ends, and the next starts from micro-batches of `size`."""
    def __init__(self, size: int):
        super().__init__(f"out of memory in a backward on rank {dist.rank()}: the next attempt takes micro-batches "
                         f"of {size} episodes")
        self.size = size


class _Agreed(torch.OutOfMemoryError):
    """Out of memory on some rank, raised by every rank together, so that all retry."""


@contextlib.contextmanager
def _agreed_memory(where: str = "a forward"):
    """Around forwards and optimizer steps, which every rank runs as often: if one rank ran out of memory, all raise
    here, before the next collective (a backward, a forward's buffer sync, the next norm) where the others would wait
    for it until the group's timeout."""
    error = None
    try:
        yield
    except torch.OutOfMemoryError as e:
        error = e
    if dist.any_rank(error is not None):
        raise _Agreed(f"out of memory in {where}{'' if error else ' on another rank'}") from error


def _autocast(cfg, device):
    """Mixed precision as PyTorch users expect it: fp32 weights and optimizer, forwards in `model.dtype`."""
    dtype = getattr(torch, cfg.model.dtype)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def _logprobs(model, batch: dict, cfg, stats: bool) -> tuple[torch.Tensor, torch.Tensor | float, dict]:
    """The training forward: the targets' log-probs and, for an MoE policy with `stats`, the balance loss and routing
    metrics. With routing replay, each action token goes through the experts the sampler recorded for it."""
    moe = routers(model) if "routes" in batch else []
    for l, router in enumerate(moe):  # without replay, all -1: every position routes freely
        routes = batch["routes"][:, :, l].reshape(-1, router.top_k)
        router.replay = routes if cfg.algo.routing_replay else torch.full_like(routes, -1)
    try:
        logp = token_logprobs(model, batch, cfg.loop.temperature)
        aux, moe_metrics = routing_stats(moe, batch["attention_mask"], batch["routes"],
                                         F.pad(batch["action_mask"], (0, 1))) if moe and stats else (0.0, {})
    finally:
        for router in moe:  # the logits hold the autograd graph: a model holding them can't be deep-copied
            router.replay = router.logits = None
    return logp, aux, moe_metrics


def memory_metrics(device: torch.device) -> dict:
    """The process's resident memory and, on a GPU, what torch holds there now and at most since the last step."""
    values = {"rss_gb": int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 1e9}
    if device.type == "cuda":
        values.update(gpu_mem_allocated_gb=torch.cuda.memory_allocated(device) / 1e9,
                      gpu_mem_peak_gb=torch.cuda.max_memory_allocated(device) / 1e9)
        torch.cuda.reset_peak_memory_stats(device)
    return values


def batch_metrics(groups: list[list[Episode]], version: int) -> dict:
    """What the batch's episodes say, whatever the update did with them: reward, pass rate, lengths, staleness."""
    rows = [e for g in groups for e in g]
    episodes = one_per_episode(rows)
    n, action_tokens = len(episodes), sum(e.n_actions for e in rows)
    rewards = torch.tensor([e.reward for e in episodes])
    staleness = torch.tensor([float(version - v) for e in rows for v, a in zip(e.versions, e.is_action) if a])
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if n > 1 else 0.0,
            "pass_rate": sum(e.info["success"] for e in episodes) / n, "response_length": action_tokens / n,
            "entropy": sum(e.info["entropy"] for e in rows) / max(action_tokens, 1),
            "staleness_mean": float(staleness.mean()) if len(staleness) else 0.0,
            "staleness_max": float(staleness.max()) if len(staleness) else 0.0,
            "tool_call_rate": sum(e.info["tool_calls"] for e in episodes) / n,
            "turns_mean": sum(e.info["turns"] for e in episodes) / n, **env_metrics(episodes)}


def eval_metrics(episodes: list[Episode]) -> dict:
    """An eval's numbers: reward, pass rate, tool-call rate and the env's own metrics, each `eval_`-prefixed."""
    episodes = one_per_episode(episodes)
    scored = scores([[(e.reward, e.info["success"])] for e in episodes], 1)  # an evaluation job's, named for a run
    return {"eval_reward": scored["mean_reward"], "eval_pass_rate": scored["pass@1"],
            "eval_tool_call_rate": sum(e.info["tool_calls"] for e in episodes) / len(episodes),
            **{f"eval_{k}": v for k, v in env_metrics(episodes).items()}}


def one_per_episode(rows: list[Episode]) -> list[Episode]:
    """An agent's episode may train as several rows (segments); its first row stands for it."""
    return [e for e in rows if e.opens_episode]


def env_metrics(episodes: list[Episode]) -> dict:
    """Chat envs' counts over the batch (tool_errors, template_prefix_breaks), and the means of the metrics envs
    report in Result.info["metrics"] (e.g. accuracy_strict) over the episodes that report them."""
    counts = {k: float(sum(e.info[k] for e in episodes)) for k in ("tool_errors", "template_prefix_breaks")
              if k in episodes[0].info}
    return {**counts, **metric_means([e.info.get("metrics", {}) for e in episodes])}
