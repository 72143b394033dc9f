"""The training loop: rollout workers, the sampler, the trainer and the evaluator in one asyncio.TaskGroup."""
import asyncio
import copy
import dataclasses
import math
import os
import random
import signal
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from . import checkpoint
from .algo import GROUP_ESTIMATORS, advantages, masked_mean, policy_loss
from .breaker import Breaker
from .config import RunConfig
from .envs import make_env
from .episode import Episode, collate, token_logprobs
from .models import load_policy, routers, routing_stats
from .sampler import Sampler
from .samples import record, training_samples

EVAL_SEEDS = 1 << 62        # held-out prompts: training seeds are (run seed << 32) + cursor, far below this
DEMO_SEEDS = 1 << 61


class Sink(Protocol):
    """Where the engine reports. The CLI prints; the daemon writes the database."""
    def metrics(self, step: int, values: dict[str, float]) -> None: ...
    def alert(self, kind: str, message: str, **data) -> None: ...
    def event(self, kind: str, message: str, **data) -> None: ...
    def checkpoint(self, step: int, path: str, **info) -> None: ...
    def samples(self, step: int, kind: str, records: list[dict]) -> None: ...  # optional; kind "train" or "eval"
    def heartbeat(self) -> None: ...  # optional; about every second while the event loop is alive


class NullSink:
    def metrics(self, step, values): pass
    def alert(self, kind, message, **data): pass
    def event(self, kind, message, **data): pass
    def checkpoint(self, step, path, **info): pass
    def samples(self, step, kind, records): pass
    def heartbeat(self): pass


class EnvFailure(RuntimeError):
    """Most recent episodes failed inside the env: the run stops, carrying the env's traceback."""


class _EnvError(Exception):
    """An env call raised; this episode is dropped and counted."""


class _Finished(Exception):
    """Ends the TaskGroup; the summary's status says why (completed, stopped, tripped)."""


def train(config: RunConfig | dict, sink: Sink | None = None, out_dir: str | Path | None = None,
          resume: bool = False) -> dict:
    """Train a policy as `config` says; returns a summary with a status. Invalid config raises pydantic's
    ValidationError. With `resume`, continue from the latest checkpoint in out_dir, if there is one."""
    cfg = config if isinstance(config, RunConfig) else RunConfig.model_validate(config)
    return asyncio.run(Run(cfg, sink or NullSink(), out_dir).run(resume))


class Run:
    def __init__(self, cfg: RunConfig, sink: Sink, out_dir=None):
        self.cfg, self.sink = cfg, sink
        torch.set_num_threads(cfg.loop.threads)
        self.out_dir = Path(out_dir) if out_dir else None
        self.model, self.processor = load_policy(cfg.model, cfg.seed)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)  # a VLM's processor wraps it
        if cfg.algo.router_freeze:  # no gradient, so neither AdamW nor weight decay ever touches them
            for router in routers(self.model):
                router.requires_grad_(False)
        self.eos_id, self.pad_id = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.algo.lr, weight_decay=cfg.algo.weight_decay)
        self.reference = None                    # frozen initial policy, only when the KL term is on
        self.sampler: Sampler | None = None      # made after the warm start, from a copy of the weights
        self.step = 0                            # trainer steps done, applied or skipped by the breaker
        self.version = 0                         # weights published to the sampler so far
        self.cursor = 0                          # next training prompt; the only source of prompt seeds
        self.requeued: list[int] = []            # prompts cut off by a stop or crash, to run again first
        self.in_flight: set[int] = set()
        self.dropped_groups = 0                  # groups started but never trained: they free admission
        self.buffer: list[list[Episode]] = []    # finished groups, not yet trained
        self.breaker = Breaker(cfg.breaker)
        self.stopping = False
        self.alerting: set[str] = set()          # alert kinds above threshold now: alert once per crossing
        self.recent_stale: deque = deque(maxlen=cfg.alerts.window)  # (dropped, trained) per step
        self.best: tuple[float, int] | None = None  # (eval reward, step) of the best checkpoint
        self.saved_at: int | None = None         # step of the newest checkpoint written or restored
        self.ckpt_dir = self.out_dir / "checkpoints" if self.out_dir else None
        self.changed = asyncio.Condition()       # buffer, version or drop counts changed
        self.recent_env_errors = deque(maxlen=cfg.loop.env_error_window)
        self.last_env_traceback = ""
        self.counts = {"env_errors": 0, "stale_dropped": 0, "groups_filtered": 0}
        self.eval_task: asyncio.Task | None = None
        self.summary: dict = {}

    # ---- the loop -------------------------------------------------------------------------------------------------

    async def run(self, resume: bool = False) -> dict:
        on_main_thread = threading.current_thread() is threading.main_thread()
        if on_main_thread:  # SIGTERM (the daemon's stop) and Ctrl-C: checkpoint, then leave cleanly
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, self.request_stop)
        try:
            await self.prepare(resume)
            loop = self.cfg.loop
            workers = loop.workers or loop.groups_per_step * (loop.max_staleness + 1)
            self.capacity = workers * loop.group_size
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.sampler.run())
                tg.create_task(self.heartbeat())
                for _ in range(workers):
                    tg.create_task(self.rollout_worker())
                tg.create_task(self.trainer())
        except* _Finished:
            pass
        except* Exception as group:  # a task failed: raise its own exception, not the TaskGroup's wrapper
            raise group.exceptions[0] from None
        finally:
            if on_main_thread:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    asyncio.get_running_loop().remove_signal_handler(sig)
        return self.summary

    async def prepare(self, resume: bool):
        """Restore the latest checkpoint, or start fresh (warm start, reference policy); then make the sampler."""
        if self.cfg.algo.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        found = checkpoint.latest(self.ckpt_dir) if resume and self.ckpt_dir else None
        if found:
            self.restore(found)
        elif self.cfg.warm_start.steps:
            await self.warm_start()
            if self.reference is not None:
                self.reference.load_state_dict(self.model.state_dict())
        self.sampler = Sampler(copy.deepcopy(self.model), self.eos_id, self.pad_id, self.cfg.loop.temperature,
                               version=self.version)

    def request_stop(self):
        self.stopping = True
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self):
        async with self.changed:
            self.changed.notify_all()

    async def heartbeat(self):
        # From the event loop itself: if anything blocks the loop (a hang), the heartbeats stop.
        beat = getattr(self.sink, "heartbeat", None)  # optional: a terminal needs no liveness signal
        while beat:
            beat()
            await asyncio.sleep(1.0)

    def may_start(self) -> bool:
        """Admission control: a new group may start only while the groups in flight or buffered cannot get older
        than max_staleness versions by the time the trainer reaches them (0 = exactly one batch per version).
        After a breaker trip, admission is strictly on-policy until the cooldown has passed."""
        loop = self.cfg.loop
        staleness = 0 if self.breaker.cooldown_left else loop.max_staleness
        return self.cursor - self.dropped_groups < (self.version + staleness + 1) * loop.groups_per_step

    async def rollout_worker(self):
        while True:
            async with self.changed:
                await self.changed.wait_for(lambda: self.requeued or self.may_start())
                if self.requeued:  # already counted as started when it was first admitted
                    cursor = self.requeued.pop(0)
                else:
                    cursor, self.cursor = self.cursor, self.cursor + 1
                self.in_flight.add(cursor)
            group = await self.run_group(cursor)
            async with self.changed:
                self.in_flight.discard(cursor)
                if group:
                    self.buffer.append(group)
                else:
                    self.dropped_groups += 1
                self.changed.notify_all()

    async def run_group(self, cursor: int) -> list[Episode] | None:
        """group_size episodes of one prompt, concurrently. Env failures drop the episode; too many stop the run."""
        seed = (self.cfg.seed << 32) + cursor
        results = await asyncio.gather(*(self.run_episode(seed, cursor, j) for j in range(self.cfg.loop.group_size)),
                                       return_exceptions=True)
        episodes = []
        for r in results:
            if isinstance(r, _EnvError):
                self.counts["env_errors"] += 1
                self.last_env_traceback = str(r)
            elif isinstance(r, BaseException):
                raise r
            else:
                episodes.append(r)
            self.recent_env_errors.append(isinstance(r, _EnvError))
        window = self.recent_env_errors
        if len(window) == window.maxlen and sum(window) > window.maxlen / 2:
            raise EnvFailure(f"{sum(window)} of the last {window.maxlen} episodes failed in env "
                             f"{self.cfg.env!r}; last error:\n{self.last_env_traceback}")
        need = 2 if self.cfg.algo.estimator in GROUP_ESTIMATORS else 1
        return episodes if len(episodes) >= need else None

    async def run_episode(self, seed: int, group: int, index: int, greedy: bool = False) -> Episode:
        """Alternate policy turns and env steps. Generated ids go into the record as sampled, never re-encoded;
        only env text is tokenized, and it is never trained."""
        env = make_env(self.cfg.env, self.cfg.env_args)
        drill = random.Random(hash((seed, index))) if self.cfg.drills.env_error_rate else None
        obs = await _env_call(env.reset(seed))
        ep = Episode(seed=seed, group=group)
        self.observe(ep, obs.text, obs.images)
        info = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "truncated": True, "entropy": 0.0}
        limit = self.model.config.get_text_config().max_position_embeddings
        for turn in range(env.max_turns):
            if len(ep.token_ids) + env.max_tokens > limit:
                break
            req = await self.sampler.generate(ep.token_ids, env.max_tokens, images=ep.images, greedy=greedy,
                                              seed=hash((self.cfg.seed, seed, index, turn)) & (2**62 - 1))
            ep.extend(req.ids, action=True, logprobs=req.logprobs, versions=req.versions, experts=req.experts,
                      entropies=req.entropies)
            info["entropy"] += sum(req.entropies)
            text = self.tokenizer.decode(req.ids[:-1] if req.ids[-1] == self.eos_id else req.ids)
            if drill and drill.random() < self.cfg.drills.env_error_rate:
                raise _EnvError("drill: injected env error (drills.env_error_rate)")
            result = await _env_call(env.step(text))
            ep.reward += result.reward
            info["turns"] += 1
            info["tool_calls"] += bool(result.info.get("tool_call"))
            info["tool_errors"] += bool(result.info.get("tool_error"))
            if result.terminated or result.truncated:
                info["truncated"] = result.truncated
                break
            self.observe(ep, result.observation, result.images)
        info["success"] = ep.reward >= env.success_reward
        ep.info = info
        return ep

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def observe(self, ep: Episode, text: str, images: list):
        """Append env text to the episode as non-action tokens. With images, the VLM's processor expands each
        image placeholder of the text into the image's tokens, and the pixel values join ep.images in order."""
        if not images:
            ep.extend(self.encode(text))
            return
        if self.processor is self.tokenizer:
            raise ValueError(f"env {self.cfg.env!r} sends images, but the policy is text-only (use a VLM preset)")
        out = self.processor(text=text, images=images, add_special_tokens=False, return_tensors="pt")
        ep.extend(out["input_ids"][0].tolist())
        ep.images += list(out["pixel_values"])

    async def trainer(self):
        loop = self.cfg.loop
        last = time.perf_counter()
        sampler_last = dict(self.sampler.stats)
        while self.step < loop.steps and not self.stopping:
            step = self.step
            if loop.eval_every and step % loop.eval_every == 0 and not (self.eval_task and not self.eval_task.done()):
                self.eval_task = asyncio.create_task(self.evaluate(step))  # never awaited here: eval never blocks
            self.run_drills(step)
            batch = await self.next_batch()
            if batch is None:  # stop requested while waiting for rollouts
                break
            groups, waited = batch
            metrics, weights, samples = await asyncio.to_thread(self.update, groups)
            self.step += 1
            if weights is None:
                weights = await self.on_trip(step, groups, metrics)
            version = self.version + (weights is not None)
            metrics["version"] = float(version)
            now = time.perf_counter()
            metrics.update(self.throughput(groups, now - last, waited, sampler_last))
            last, sampler_last = now, dict(self.sampler.stats)
            self.check_alerts(step, metrics, sum(len(g) for g in groups))
            self.sink.metrics(step, metrics)  # before the checkpoint: a checkpoint never gets ahead of the records
            if samples and hasattr(self.sink, "samples"):
                self.sink.samples(step, "train", samples)
            self.summary.update(metrics, step=self.step, version=version)
            every = self.cfg.checkpoint.every
            if self.ckpt_dir and ((every and self.step % every == 0) or self.stopping):
                # Before publishing: admission is still closed, so (on-policy) nothing is in flight.
                await self.save_checkpoint(version)
            async with self.changed:
                if weights is not None:
                    self.version = version
                    self.sampler.publish(weights, version)
                self.changed.notify_all()
        if self.stopping:
            if self.ckpt_dir and self.step > 0 and self.saved_at != self.step:
                await self.save_checkpoint(self.version)
            self.sink.event("stopped", f"stopped at step {self.step}; resume continues from here", step=self.step)
            self.summary.update(status="stopped", step=self.step, version=self.version)
            raise _Finished
        await self.finish()

    def run_drills(self, step: int):
        """Crash and hang drills, each once per step unless crash_repeat (remembered across restarts on disk)."""
        drills = self.cfg.drills
        for kind, steps in (("crash", drills.crash_at), ("hang", drills.hang_at)):
            if step not in steps:
                continue
            marker = self.out_dir / "drills" / f"{kind}-{step}" if self.out_dir else None
            if marker and marker.exists() and not (kind == "crash" and drills.crash_repeat):
                continue
            if marker:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
            if kind == "crash":
                os._exit(1)
            time.sleep(drills.hang_seconds)  # blocks the event loop on purpose: no heartbeat, no progress

    async def next_batch(self) -> tuple[list[list[Episode]], float] | None:
        """Take groups_per_step groups, dropping (and counting) those that are too stale or carry no signal.
        None if a stop was requested meanwhile (the groups taken so far go back to the buffer)."""
        cfg, t0 = self.cfg, time.perf_counter()
        batch = []
        while len(batch) < cfg.loop.groups_per_step:
            async with self.changed:
                await self.changed.wait_for(lambda: self.buffer or self.stopping)
                if self.stopping:
                    self.buffer[:0] = batch
                    return None
                group = self.buffer.pop(0)
                stale = self.version - min(e.oldest_version for e in group) > cfg.loop.max_staleness
                flat = cfg.algo.filter_zero_variance and len({e.reward for e in group}) == 1
                if stale or flat:
                    self.counts["stale_dropped" if stale else "groups_filtered"] += len(group) if stale else 1
                    self.dropped_groups += 1
                    self.changed.notify_all()
                    continue
            batch.append(group)
        batch.sort(key=lambda g: g[0].group)  # arrival order is timing; training order must not be
        return batch, time.perf_counter() - t0

    async def on_trip(self, step: int, groups, metrics) -> dict | None:
        """The breaker refused this update: force sync, alert, and roll back or give up if it keeps happening.
        Returns weights to publish (after a rollback) or None."""
        async with self.changed:
            # The refused batch frees admission for a replacement; buffered episodes of older versions are dropped.
            stale = [g for g in self.buffer if min(e.oldest_version for e in g) < self.version]
            self.buffer = [g for g in self.buffer if g not in stale]
            self.dropped_groups += len(groups) + len(stale)
            self.counts["stale_dropped"] += sum(len(g) for g in stale)
            self.changed.notify_all()
        action = (f"update skipped, nothing published, {sum(len(g) for g in stale)} stale buffered episodes "
                  f"dropped, admission on-policy for {self.cfg.breaker.cooldown} healthy steps")
        weights = None
        if self.breaker.recent_trips(step) >= self.cfg.breaker.max_trips:
            good = checkpoint.latest(self.ckpt_dir) if self.ckpt_dir else None
            if good is None or self.breaker.rollbacks >= self.cfg.breaker.max_rollbacks:
                self.sink.alert("breaker", f"step {step}: grad norm {metrics['grad_norm']:.4g}; "
                                f"{self.breaker.recent_trips(step)} trips, giving up: run tripped",
                                step=step, norm=metrics["grad_norm"], threshold=metrics.get("breaker_threshold"),
                                action="tripped")
                self.sink.metrics(step, metrics)
                self.summary.update(metrics, status="tripped", step=self.step, version=self.version)
                raise _Finished
            state = await asyncio.to_thread(checkpoint.load, good, self.model, self.reference)
            self.optimizer.load_state_dict(state["optimizer"])
            self.breaker.trips.clear()
            self.breaker.rollbacks += 1
            weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            action += f"; rolled back to {good.name}"
            self.sink.event("rollback", f"step {step}: rolled back to checkpoint {good.name}",
                            step=step, path=str(good))
        self.sink.alert("breaker", f"step {step}: grad norm {metrics['grad_norm']:.4g} above threshold "
                        f"{metrics.get('breaker_threshold', math.inf):.4g}; {action}", step=step,
                        norm=metrics["grad_norm"], threshold=metrics.get("breaker_threshold"), action=action)
        return weights

    def check_alerts(self, step: int, metrics: dict, trained: int):
        """Staleness and mismatch alerts: once when a metric crosses its threshold, again only after it recovered."""
        cfg = self.cfg.alerts
        self.recent_stale.append((metrics["stale_dropped"], trained))
        dropped = sum(d for d, _ in self.recent_stale)
        share = dropped / max(1, dropped + sum(t for _, t in self.recent_stale))
        metrics["stale_share"] = share
        checks = [
            ("stale_share", "staleness", share, cfg.stale_share,
             f"{share:.0%} of samples in the last {len(self.recent_stale)} steps were dropped as too stale"),
            ("staleness_max", "staleness", metrics["staleness_max"], cfg.staleness_max,
             f"a trained token was {metrics['staleness_max']:.0f} versions old"),
            ("mismatch_kl", "mismatch", metrics["mismatch_kl"], cfg.mismatch_kl,
             f"KL between behaviour and recomputed log-probs is {metrics['mismatch_kl']:.3g}"),
        ]
        for name, kind, value, threshold, message in checks:
            above = threshold is not None and value >= threshold if name == "staleness_max" else value > threshold
            if above and name not in self.alerting:
                self.sink.alert(kind, f"step {step}: {message} (threshold {threshold})", step=step, metric=name,
                                value=value, threshold=threshold)
            (self.alerting.add if above else self.alerting.discard)(name)

    def update(self, groups: list[list[Episode]]) -> tuple[dict, dict, list[dict]]:
        """One optimizer step on a batch (runs in a worker thread). Returns metrics, the weights to publish and the
        records of the batch's samples (record.samples_per_step groups)."""
        algo, episodes = self.cfg.algo, [e for g in groups for e in g]
        if algo.estimator in GROUP_ESTIMATORS:
            adv = torch.cat([advantages(torch.tensor([[e.reward for e in g]]), algo.estimator)[0] for g in groups])
        else:  # batch-level baseline: the whole batch is one "group"
            adv = advantages(torch.tensor([[e.reward for e in episodes]]), algo.estimator)[0]
        # Episodes with advantage 0 add exactly 0 to the policy gradient: leave them out of the forward and backward
        # (the bulk of a step once most groups are solved), keeping the token-mean over the whole batch's tokens.
        # The KL term is nonzero everywhere, so with it on, every episode is trained.
        keep = [i for i, a in enumerate(adv.tolist()) if a != 0 or algo.kl_coef > 0] or list(range(len(episodes)))
        batch = collate([episodes[i] for i in keep], self.pad_id)
        mask = batch["action_mask"]
        moe = routers(self.model) if "routes" in batch else []
        for l, router in enumerate(moe):  # without replay, all -1: every position routes freely
            routes = batch["routes"][:, :, l].reshape(-1, router.top_k)
            router.replay = routes if algo.routing_replay else torch.full_like(routes, -1)
        try:
            logp = token_logprobs(self.model, batch, self.cfg.loop.temperature)
            aux, moe_metrics = routing_stats(moe, batch["attention_mask"], batch["routes"],
                                             F.pad(mask, (0, 1))) if moe else (0.0, {})
        finally:
            for router in moe:  # the logits hold the autograd graph: a model holding them can't be deep-copied
                router.replay = router.logits = None
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logp = token_logprobs(self.reference, batch, self.cfg.loop.temperature)
        loss, stats = policy_loss(
            logp, logp.detach(), batch["behav_logp"], adv[keep], mask,
            loss=algo.loss, clip_low=algo.clip_low, clip_high=algo.clip_high, is_level=algo.is_level,
            is_mode=algo.is_mode, is_low=algo.is_low, is_high=algo.is_high, kl_coef=algo.kl_coef, ref_logp=ref_logp,
            kl_estimator=algo.kl_estimator)
        action_tokens = sum(e.n_actions for e in episodes)
        loss = loss * (int(mask.sum()) / max(action_tokens, 1))
        if self.step in self.cfg.drills.nan_at:
            loss = loss * math.nan
        self.optimizer.zero_grad(set_to_none=True)
        coef = algo.router_aux_coef if algo.router_aux_coef is not None else getattr(self.model.config, "router_aux_loss_coef", 0.0)
        (loss + coef * aux).backward()
        if self.step in self.cfg.drills.spike_at:  # a random direction, so it spikes even a zero gradient
            params = [p for p in self.model.parameters() if p.grad is not None]
            noise = [torch.randn(p.shape, generator=torch.Generator().manual_seed(self.step + i)) for i, p in enumerate(params)]
            scale = self.cfg.drills.spike_norm / float(torch.sqrt(sum((n ** 2).sum() for n in noise)))
            for p, n in zip(params, noise):
                p.grad.add_(n * scale)
        threshold = self.breaker.threshold()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), algo.max_grad_norm))
        tripped = self.breaker.check(self.step, grad_norm)
        weights = None
        if not tripped:
            if grad_norm > 0:  # no signal (all advantages 0): Adam's momentum alone would still move the weights
                self.optimizer.step()
            weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            if not all(torch.isfinite(v).all() for v in weights.values()):
                # Never publish (or checkpoint) non-finite weights: back to the last published ones, count a trip.
                self.model.load_state_dict(self.sampler.model.state_dict())
                self.breaker.check(self.step, math.nan)
                tripped, weights = True, None
        self.optimizer.zero_grad(set_to_none=True)
        rewards = torch.tensor([e.reward for e in episodes])
        staleness = torch.tensor([self.version - v for e in episodes for v, a in zip(e.versions, e.is_action) if a],
                                 dtype=torch.float32)
        metrics = {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "pass_rate": sum(e.info["success"] for e in episodes) / len(episodes),
            "policy_loss": loss.item(), "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"],
            "entropy": sum(e.info["entropy"] for e in episodes) / max(action_tokens, 1),
            "response_length": action_tokens / len(episodes), "trained_fraction": len(keep) / len(episodes),
            "staleness_mean": float(staleness.mean()) if len(staleness) else 0.0,
            "staleness_max": float(staleness.max()) if len(staleness) else 0.0,
            "tool_call_rate": sum(e.info["tool_calls"] for e in episodes) / len(episodes),
            "turns_mean": sum(e.info["turns"] for e in episodes) / len(episodes),
            "breaker_tripped": float(tripped), **stats, **moe_metrics,
        }
        if math.isfinite(threshold):
            metrics["breaker_threshold"] = threshold
        samples = training_samples(groups, adv.tolist(), keep, logp.detach(), batch["prompt_width"],
                                   self.cfg.record.samples_per_step, self.processor, self.version)
        return metrics, weights, samples

    def throughput(self, groups, seconds: float, waited: float, sampler_last: dict) -> dict:
        """Rates over the wall time since the previous step, and counters since then (reset after reporting)."""
        s = {k: self.sampler.stats[k] - sampler_last[k] for k in self.sampler.stats}
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return {
            "samples_per_s": sum(len(g) for g in groups) / seconds, "tokens_per_s": s["tokens"] / seconds,
            "trainer_idle_ratio": waited / seconds, "sampler_idle_ratio": min(1.0, s["idle_s"] / seconds),
            "sampler_occupancy": s["rows"] / max(s["steps"], 1) / self.capacity, **counts,
        }

    async def evaluate(self, step: int):
        """Greedy episodes on held-out seeds; they share the sampler but never the buffer or admission."""
        n = self.cfg.loop.eval_episodes
        results = await asyncio.gather(*(self.run_episode(EVAL_SEEDS + i, -1, 0, greedy=True) for i in range(n)),
                                       return_exceptions=True)
        episodes = [r for r in results if isinstance(r, Episode)]
        if episodes:
            values = {"eval_reward": sum(e.reward for e in episodes) / len(episodes),
                      "eval_pass_rate": sum(e.info["success"] for e in episodes) / len(episodes),
                      "eval_tool_call_rate": sum(e.info["tool_calls"] for e in episodes) / len(episodes)}
            self.sink.metrics(step, values)
            if hasattr(self.sink, "samples"):
                self.sink.samples(step, "eval", [record(e, self.processor, self.version)
                                                 for e in episodes[:self.cfg.record.eval_samples]])
            self.summary.update(values)
            if self.best is None or values["eval_reward"] > self.best[0]:
                self.best = (values["eval_reward"], step)

    async def finish(self):
        """Final eval on the final weights, then save them where plain transformers can load them."""
        if self.eval_task:
            await self.eval_task
        if self.cfg.loop.eval_every:
            await self.evaluate(self.version)
        self.summary["status"] = "completed"
        if self.out_dir:
            final = self.out_dir / "final"
            self.model.save_pretrained(final)
            self.processor.save_pretrained(final)
            self.sink.event("saved", f"final policy saved to {final}", path=str(final))
            self.summary["final_path"] = str(final)
        raise _Finished

    # ---- checkpoints ----------------------------------------------------------------------------------------------

    async def save_checkpoint(self, version: int):
        """Everything needed to continue exactly: weights, optimizer, RNGs, prompt cursor, untrained episodes."""
        state = {
            "step": self.step, "version": version, "cursor": self.cursor, "dropped_groups": self.dropped_groups,
            "requeued": sorted(self.in_flight) + self.requeued,  # cut off mid-episode: rerun them first
            "buffer": [[dataclasses.asdict(e) for e in g] for g in self.buffer],
            "counts": dict(self.counts), "recent_env_errors": list(self.recent_env_errors),
            "recent_stale": list(self.recent_stale), "alerting": sorted(self.alerting),
            "breaker": self.breaker.state_dict(), "best": self.best, "kl_coef": self.cfg.algo.kl_coef,
            "optimizer": self.optimizer.state_dict(),
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        }
        t0 = time.perf_counter()
        path = await asyncio.to_thread(checkpoint.save, self.ckpt_dir, self.step, self.model, self.processor, state,
                                       self.reference)
        best = f"step-{self.best[1]:06d}" if self.best else None
        await asyncio.to_thread(checkpoint.prune, self.ckpt_dir, self.cfg.checkpoint.keep, best)
        self.saved_at = self.step
        self.sink.checkpoint(self.step, str(path), version=version, size_bytes=checkpoint.size_bytes(path),
                             seconds=time.perf_counter() - t0)

    def restore(self, path: Path):
        state = checkpoint.load(path, self.model, self.reference)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.version, self.cursor = state["step"], state["version"], state["cursor"]
        self.dropped_groups, self.requeued = state["dropped_groups"], state["requeued"]
        self.buffer = [[Episode(**e) for e in g] for g in state["buffer"]]
        self.counts = state["counts"]
        self.recent_env_errors.extend(state["recent_env_errors"])
        self.recent_stale.extend(state["recent_stale"])
        self.alerting = set(state["alerting"])
        self.breaker.load_state_dict(state["breaker"])
        self.best = state["best"]
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        self.saved_at = self.step
        self.sink.event("resumed", f"resumed from {path.name}: step {self.step}, version {self.version}, "
                        f"{sum(map(len, self.buffer))} buffered episodes, {len(self.requeued)} prompts to rerun",
                        step=self.step, path=str(path))

    # ---- supervised warm start ------------------------------------------------------------------------------------

    async def warm_start(self):
        """A few supervised steps on env demonstrations: teaches the format so RL starts from a non-zero reward."""
        ws = self.cfg.warm_start
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=ws.lr)
        loss = math.nan
        for step in range(ws.steps):
            if self.stopping:  # a stop before RL began: nothing worth a checkpoint yet
                break
            seeds = range(DEMO_SEEDS + step * ws.batch_size, DEMO_SEEDS + (step + 1) * ws.batch_size)
            episodes = await asyncio.gather(*(self.demonstration(s) for s in seeds))
            batch = collate(episodes, self.pad_id)

            def sft_step():
                nll = -masked_mean(token_logprobs(self.model, batch, 1.0), batch["action_mask"])
                optimizer.zero_grad(set_to_none=True)
                nll.backward()
                optimizer.step()
                return nll.item()
            loss = await asyncio.to_thread(sft_step)
        self.sink.event("warm_start", f"{ws.steps} supervised steps on demonstrations, final loss {loss:.3f}",
                        steps=ws.steps, loss=loss)

    async def demonstration(self, seed: int) -> Episode:
        env = make_env(self.cfg.env, self.cfg.env_args)
        obs = await env.reset(seed)
        ep = Episode(seed=seed, group=-1)
        self.observe(ep, obs.text, obs.images)
        for action in env.demonstration(seed):
            ids = self.encode(action) + [self.eos_id]
            ep.extend(ids, action=True, logprobs=[0.0] * len(ids), versions=[0] * len(ids))
            result = await env.step(action)
            if result.terminated or result.truncated:
                break
            self.observe(ep, result.observation, result.images)
        return ep


async def _env_call(awaitable):
    try:
        return await awaitable
    except Exception as e:
        raise _EnvError("".join(traceback.format_exception(e))) from e
