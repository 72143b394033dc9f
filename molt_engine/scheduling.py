"""The loop's scheduling: admission by staleness, the rollout workers that run groups, and the batches they buffer."""
import asyncio
import time

from . import dist
from .algo import GROUP_ESTIMATORS
from .episode import Episode
from .rollout import EnvError, EnvFailure, PromptTooLong
from .update import one_per_episode


class Scheduling:
    """Training's rollout side (mixed into loop.Training, whose state it uses): which groups start, run and train."""

    def may_start(self) -> bool:
        """Admission: a new group starts only if no group in flight or buffered can be more than max_staleness versions
        old when trained (0 = one batch per version); on-policy while a breaker trip's cooldown lasts."""
        staleness = 0 if self.breaker.cooldown_left else self.cfg.loop.max_staleness
        return self.cursor - self.dropped_groups < (self.version + staleness + 1) * self.cfg.loop.groups_per_step

    def release(self, groups: int):
        """Groups started but never trained (failed, stale, filtered, refused) free their admission; holds `changed`."""
        self.dropped_groups += groups
        self.changed.notify_all()

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
            if group and self.scoring:  # the reward stage: a slow term holds neither this worker nor the sampler
                self.tasks.create_task(self.buffered(cursor, group))
            else:
                await self.buffered(cursor, group)

    async def buffered(self, cursor: int, group: list[Episode] | None):
        """Buffer a sampled group for training once its extra reward terms scored it (molt_rewards), or release it."""
        if group and self.scoring:
            group, counts = await self.scoring.score(group)
            for name, n in counts.items():
                self.counts[name] += n
            group = group if self.enough(group) else None
        async with self.changed:
            self.in_flight.discard(cursor)
            if group:
                self.buffer.append(group)
                self.changed.notify_all()
            else:
                self.release(1)

    def enough(self, rows: list[Episode]) -> bool:
        """Episodes enough to train on: two for a group estimator's baseline, else one."""
        return len(one_per_episode(rows)) >= (2 if self.cfg.algo.estimator in GROUP_ESTIMATORS else 1)

    async def run_group(self, cursor: int) -> list[Episode] | None:
        """group_size episodes of one prompt, concurrently. Env failures drop the episode; too many stop the run."""
        prompt = dist.prompt_index(cursor)  # more than one process: this rank's share of the prompts
        seed = (self.cfg.seed << 32) + prompt
        results = await asyncio.gather(*(self.rollout.episode(self.sampler, seed, prompt, j)
                                         for j in range(self.cfg.loop.group_size)), return_exceptions=True)
        episodes = []
        for r in results:
            if isinstance(r, EnvError):
                self.counts["prompt_too_long" if isinstance(r, PromptTooLong) else self.errors] += 1
                self.last_env_traceback = str(r)
            elif isinstance(r, BaseException):
                raise r
            else:
                episodes += r
            self.recent_env_errors.append(isinstance(r, EnvError))
        window = self.recent_env_errors
        if len(window) == window.maxlen and sum(window) > window.maxlen / 2:
            raise EnvFailure(f"{sum(window)} of the last {window.maxlen} episodes failed in env "
                             f"{self.cfg.env!r}; last error:\n{self.last_env_traceback}")
        return episodes if self.enough(episodes) else None

    async def agree_stop(self, batch) -> bool:
        """Stop now? More than one process: if any rank was asked, all stop at this step (a batch taken goes back)."""
        stop = batch is None if dist.world() == 1 else await asyncio.to_thread(dist.any_rank, batch is None)
        if stop and batch is not None:
            self.buffer[:0] = batch[0]
        self.stopping |= stop
        return stop

    async def next_batch(self) -> tuple[list[list[Episode]], float] | None:
        """groups_per_step groups, less (counted) those too stale or without signal; None on a stop (they go back)."""
        cfg, t0, batch = self.cfg, time.perf_counter(), []
        while len(batch) < cfg.loop.groups_per_step:
            async with self.changed:
                await self.changed.wait_for(lambda: self.buffer or self.stopping)
                if self.stopping:
                    self.buffer[:0] = batch
                    return None
                group = self.buffer.pop(0)
                stale = self.version - min(e.oldest_version for e in group) > cfg.loop.max_staleness
                # At most a batch's worth filtered per step: with every group flat, steps go on, and without signal
                # (the no-signal alert), rather than sampling forever
                flat = (cfg.algo.filter_zero_variance and len({e.reward for e in group}) == 1
                        and self.counts["groups_filtered"] < cfg.loop.groups_per_step
                        and "token_advantages" not in group[0].info)  # a teacher's: a signal of its own
                if stale or flat:
                    self.counts["stale_episodes_dropped" if stale else "groups_filtered"] += len(group) if stale else 1
                    self.release(1)
                    continue
            batch.append(group)
        batch.sort(key=lambda g: g[0].group)  # arrival order is timing; training order must not be
        return batch, time.perf_counter() - t0
