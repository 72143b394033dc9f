"""Reward terms beyond the env's own: functions, reward models and LLM judges, weighted into each finished episode's
reward, and a distillation teacher's per-token advantages. The loop's reward stage (molt_engine/scheduling.py) loads this package by name when a run has terms, and
scores each sampled group in a task of its own, so a slow term holds neither the rollout workers nor the trainer."""
import asyncio
import inspect
from collections import Counter
from functools import partial

from molt_engine.envs import resolve

from .judges import Judge
from .models import RewardModel
from .teacher import Teacher

__all__ = ["Scoring"]


class Scoring:
    """The run's reward terms (config.RewardsConfig), applied to one group of rows at a time."""

    def __init__(self, cfg, tokenizer, trainer_device):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.terms = [(term, self.make(term, trainer_device)) for term in cfg.terms]
        self.teacher = cfg.teacher and Teacher(cfg.teacher, tokenizer, trainer_device if
                                               cfg.teacher.device == "trainer" else cfg.teacher.device)
        # Counted per step (the loop reports and resets them): a failed or timed-out judge try each
        self.counters = ("judge_errors", "judge_timeouts") if any(t.judge for t in cfg.terms) else ()

    @staticmethod
    def make(term, trainer_device):
        if term.model:
            return RewardModel(term.model, trainer_device if term.device == "trainer" else term.device)
        if term.judge:
            return Judge(term.judge, trainer_device if term.device == "trainer" else term.device)
        function = resolve(term.function, {}, "reward function")

        async def scored(texts, counts, latencies):  # one call per episode; a sync function in a thread
            call = function if inspect.iscoroutinefunction(function) else partial(asyncio.to_thread, function)
            return [float(await call(prompt=p, completion=c, env_reward=r)) for p, c, r in texts]
        return scored

    async def score(self, rows: list) -> tuple[list, dict]:
        """The group's rows with their rewards combined (an agent's segments share their episode's), less the
        episodes a failed judge dropped; and the counts of failures. Each term's raw value is the metric reward/NAME
        of the episode's first row, the judges' mean latency judge_latency_s."""
        episodes = []  # an episode's rows: its first row, then its later segments
        for row in rows:
            if row.opens_episode:
                episodes.append([row])
            else:
                episodes[-1].append(row)
        texts = [self.text(e[-1]) + (e[0].reward,) for e in episodes]  # the last segment holds the most context
        counts, latencies = Counter(dict.fromkeys(self.counters, 0)), [[] for _ in episodes]
        values = await asyncio.gather(*(scorer(texts, counts, latencies) for _, scorer in self.terms))
        if self.teacher:  # sets each row's token advantages, whatever the terms say of its episode
            await self.teacher(rows)
        kept = []
        for i, episode in enumerate(episodes):
            raw = {term.name: v[i] for (term, _), v in zip(self.terms, values)}
            if None in raw.values():  # a judge that failed with on_error "drop"
                continue
            weighted = [term.weight * normalized(v, i, term.normalize) for (term, _), v in zip(self.terms, values)]
            first = episode[0]
            metrics = first.info.setdefault("metrics", {})
            metrics.update({"reward/env": first.reward, **{f"reward/{k}": v for k, v in raw.items()}})
            if latencies[i]:
                metrics["judge_latency_s"] = sum(latencies[i]) / len(latencies[i])
            reward = self.cfg.env_weight * first.reward + sum(weighted)
            for row in episode:
                row.reward = reward
            kept += episode
        return kept, counts

    def text(self, row) -> tuple[str, str]:
        """(prompt, completion): the row's text before its first action and from it on, special tokens left out."""
        first = row.is_action.index(True) if any(row.is_action) else len(row.token_ids)
        decode = partial(self.tokenizer.decode, skip_special_tokens=True)
        return decode(row.token_ids[:first]), decode(row.token_ids[first:])


def normalized(values: list, i: int, how: str) -> float:
    """values[i], or with how "group" standardised among the group's values (those of dropped episodes left out)."""
    if how == "none":
        return values[i]
    present = [v for v in values if v is not None]
    mean = sum(present) / len(present)
    std = (sum((v - mean) ** 2 for v in present) / len(present)) ** 0.5
    return (values[i] - mean) / (std + 1e-6)
