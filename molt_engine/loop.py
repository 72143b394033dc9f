"""The training loop: rollout workers, the sampler, the trainer and the evaluator in one asyncio.TaskGroup."""
import asyncio
import copy
import math
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Protocol

import torch

from .algo import GROUP_ESTIMATORS, advantages, masked_mean, policy_loss
from .config import RunConfig
from .envs import make_env
from .episode import Episode, collate, token_logprobs
from .models import load_policy
from .sampler import Sampler

EVAL_SEEDS = 1 << 62        # held-out prompts: training seeds are (run seed << 32) + cursor, far below this
DEMO_SEEDS = 1 << 61


class Sink(Protocol):
    """Where the engine reports. The CLI prints; the daemon writes the database."""
    def metrics(self, step: int, values: dict[str, float]) -> None: ...
    def alert(self, kind: str, message: str, **data) -> None: ...
    def event(self, kind: str, message: str, **data) -> None: ...
    def checkpoint(self, step: int, path: str, **info) -> None: ...


class NullSink:
    def metrics(self, step, values): pass
    def alert(self, kind, message, **data): pass
    def event(self, kind, message, **data): pass
    def checkpoint(self, step, path, **info): pass


class EnvFailure(RuntimeError):
    """Most recent episodes failed inside the env: the run stops, carrying the env's traceback."""


class _EnvError(Exception):
    """An env call raised; this episode is dropped and counted."""


class _Finished(Exception):
    pass


def train(config: RunConfig | dict, sink: Sink | None = None, out_dir: str | Path | None = None) -> dict:
    """Train a policy as `config` says; returns a summary. Invalid config raises pydantic's ValidationError."""
    cfg = config if isinstance(config, RunConfig) else RunConfig.model_validate(config)
    return asyncio.run(Run(cfg, sink or NullSink(), out_dir).run())


class Run:
    def __init__(self, cfg: RunConfig, sink: Sink, out_dir=None):
        self.cfg, self.sink = cfg, sink
        torch.set_num_threads(cfg.loop.threads)
        self.out_dir = Path(out_dir) if out_dir else None
        self.model, self.tokenizer = load_policy(cfg.model, cfg.seed)
        self.eos_id, self.pad_id = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.algo.lr, weight_decay=cfg.algo.weight_decay)
        self.reference = None                    # frozen initial policy, only when the KL term is on
        self.sampler: Sampler | None = None      # made after the warm start, from a copy of the weights
        self.version = 0                         # = optimizer steps taken = the sampler's newest weights
        self.cursor = 0                          # next training prompt; the only source of prompt seeds
        self.dropped_groups = 0                  # groups started but never trained: they free admission
        self.buffer: list[list[Episode]] = []    # finished groups, not yet trained
        self.changed = asyncio.Condition()       # buffer, version or drop counts changed
        self.recent_env_errors = deque(maxlen=cfg.loop.env_error_window)
        self.last_env_traceback = ""
        self.counts = {"env_errors": 0, "stale_dropped": 0, "groups_filtered": 0}
        self.eval_task: asyncio.Task | None = None
        self.summary: dict = {}

    # ---- the loop -------------------------------------------------------------------------------------------------

    async def run(self) -> dict:
        if self.cfg.warm_start.steps:
            await self.warm_start()
        if self.cfg.algo.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.sampler = Sampler(copy.deepcopy(self.model), self.eos_id, self.pad_id, self.cfg.loop.temperature,
                               version=self.version)
        loop = self.cfg.loop
        workers = loop.workers or loop.groups_per_step * (loop.max_staleness + 1)
        self.capacity = workers * loop.group_size
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.sampler.run())
                for _ in range(workers):
                    tg.create_task(self.rollout_worker())
                tg.create_task(self.trainer())
        except* _Finished:
            pass
        return self.summary

    def may_start(self) -> bool:
        """Admission control: a new group may start only while the groups in flight or buffered cannot get older
        than max_staleness versions by the time the trainer reaches them (0 = exactly one batch per version)."""
        loop = self.cfg.loop
        return self.cursor - self.dropped_groups < (self.version + loop.max_staleness + 1) * loop.groups_per_step

    async def rollout_worker(self):
        while True:
            async with self.changed:
                await self.changed.wait_for(self.may_start)
                cursor, self.cursor = self.cursor, self.cursor + 1
            group = await self.run_group(cursor)
            async with self.changed:
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
        obs = await _env_call(env.reset(seed))
        ep = Episode(seed=seed, group=group, images=list(obs.images))
        ep.extend(self.encode(obs.text))
        info = {"turns": 0, "tool_calls": 0, "truncated": True}
        limit = self.model.config.max_position_embeddings
        for turn in range(env.max_turns):
            if len(ep.token_ids) + env.max_tokens > limit:
                break
            req = await self.sampler.generate(ep.token_ids, env.max_tokens, greedy=greedy,
                                              seed=hash((self.cfg.seed, seed, index, turn)) & (2**62 - 1))
            ep.extend(req.ids, action=True, logprobs=req.logprobs, versions=req.versions)
            text = self.tokenizer.decode(req.ids[:-1] if req.ids[-1] == self.eos_id else req.ids)
            result = await _env_call(env.step(text))
            ep.reward += result.reward
            info["turns"] += 1
            info["tool_calls"] += bool(result.info.get("tool_call"))
            if result.terminated or result.truncated:
                info["truncated"] = result.truncated
                break
            ep.extend(self.encode(result.observation))
            ep.images += result.images
        info["success"] = ep.reward >= env.success_reward
        ep.info = info
        return ep

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    async def trainer(self):
        loop = self.cfg.loop
        last = time.perf_counter()
        sampler_last = dict(self.sampler.stats)
        while self.version < loop.steps:
            step = self.version
            if loop.eval_every and step % loop.eval_every == 0 and not (self.eval_task and not self.eval_task.done()):
                self.eval_task = asyncio.create_task(self.evaluate(step))  # never awaited here: eval never blocks
            groups, waited = await self.next_batch()
            metrics, weights = await asyncio.to_thread(self.update, groups)
            async with self.changed:
                self.version += 1
                self.sampler.publish(weights, self.version)
                self.changed.notify_all()
            now = time.perf_counter()
            metrics.update(self.throughput(groups, now - last, waited, sampler_last))
            last, sampler_last = now, dict(self.sampler.stats)
            self.sink.metrics(step, metrics)
            self.summary = {"steps": self.version, **metrics}
        await self.finish()

    async def next_batch(self) -> tuple[list[list[Episode]], float]:
        """Take groups_per_step groups, dropping (and counting) those that are too stale or carry no signal."""
        cfg, t0 = self.cfg, time.perf_counter()
        batch = []
        while len(batch) < cfg.loop.groups_per_step:
            async with self.changed:
                await self.changed.wait_for(lambda: self.buffer)
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

    def update(self, groups: list[list[Episode]]) -> tuple[dict, dict]:
        """One optimizer step on a batch (runs in a worker thread). Returns metrics and the weights to publish."""
        algo, episodes = self.cfg.algo, [e for g in groups for e in g]
        if algo.estimator in GROUP_ESTIMATORS:
            adv = torch.cat([advantages(torch.tensor([[e.reward for e in g]]), algo.estimator)[0] for g in groups])
        else:  # batch-level baseline: the whole batch is one "group"
            adv = advantages(torch.tensor([[e.reward for e in episodes]]), algo.estimator)[0]
        batch = collate(episodes, self.pad_id)
        mask = batch["action_mask"]
        logp, entropy = token_logprobs(self.model, batch, self.cfg.loop.temperature, with_entropy=True)
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logp = token_logprobs(self.reference, batch, self.cfg.loop.temperature)
        loss, stats = policy_loss(
            logp, logp.detach(), batch["behav_logp"], adv, mask, loss=algo.loss, clip_low=algo.clip_low,
            clip_high=algo.clip_high, is_level=algo.is_level, is_mode=algo.is_mode, is_low=algo.is_low,
            is_high=algo.is_high, kl_coef=algo.kl_coef, ref_logp=ref_logp, kl_estimator=algo.kl_estimator)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), algo.max_grad_norm))
        if grad_norm > 0:  # no signal (all advantages 0): Adam's momentum alone would still move the weights
            self.optimizer.step()
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        rewards = torch.tensor([e.reward for e in episodes])
        staleness = (self.version - batch["versions"])[mask].float()
        metrics = {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "pass_rate": sum(e.info["success"] for e in episodes) / len(episodes),
            "policy_loss": loss.item(), "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"],
            "entropy": float(masked_mean(entropy, mask)),
            "response_length": sum(e.n_actions for e in episodes) / len(episodes),
            "staleness_mean": float(staleness.mean()) if len(staleness) else 0.0,
            "staleness_max": float(staleness.max()) if len(staleness) else 0.0,
            "tool_call_rate": sum(e.info["tool_calls"] for e in episodes) / len(episodes),
            "turns_mean": sum(e.info["turns"] for e in episodes) / len(episodes),
            "version": float(self.version + 1), **stats,
        }
        return metrics, weights

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
            self.summary.update(values)

    async def finish(self):
        """Final eval on the final weights, then save them where plain transformers can load them."""
        if self.eval_task:
            await self.eval_task
        if self.cfg.loop.eval_every:
            await self.evaluate(self.version)
        if self.out_dir:
            final = self.out_dir / "final"
            self.model.save_pretrained(final)
            self.tokenizer.save_pretrained(final)
            self.sink.event("saved", f"final policy saved to {final}", path=str(final))
            self.summary["final_path"] = str(final)
        raise _Finished

    # ---- supervised warm start ------------------------------------------------------------------------------------

    async def warm_start(self):
        """A few supervised steps on env demonstrations: teaches the format so RL starts from a non-zero reward."""
        ws = self.cfg.warm_start
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=ws.lr)
        loss = math.nan
        for step in range(ws.steps):
            seeds = range(DEMO_SEEDS + step * ws.batch_size, DEMO_SEEDS + (step + 1) * ws.batch_size)
            episodes = [await self.demonstration(s) for s in seeds]
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
        ep = Episode(seed=seed, group=-1, images=list(obs.images))
        ep.extend(self.encode(obs.text))
        for action in env.demonstration(seed):
            ids = self.encode(action) + [self.eos_id]
            ep.extend(ids, action=True, logprobs=[0.0] * len(ids), versions=[0] * len(ids))
            result = await env.step(action)
            if result.terminated or result.truncated:
                break
            ep.extend(self.encode(result.observation))
        return ep


async def _env_call(awaitable):
    try:
        return await awaitable
    except Exception as e:
        raise _EnvError("".join(traceback.format_exception(e))) from e
