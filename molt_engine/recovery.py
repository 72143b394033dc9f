"""The loop's recovery: checkpoints that continue exactly (save, restore), the breaker's trips (sync, roll back)."""
import asyncio
import dataclasses
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from . import checkpoint, dist
from .episode import Episode


class Finished(Exception):
    """Ends the TaskGroup; the summary's status says why (completed, stopped, tripped)."""


class Recovery:
    """Training's checkpoints and trips (mixed into loop.Training, whose state it uses)."""

    async def save_checkpoint(self, version: int, weights: dict):
        """All needed to continue exactly (weights, optimizer, RNGs, cursor, untrained episodes); rank 0 writes."""
        state = {"step": self.step, "version": version, "cursor": self.cursor, "dropped_groups": self.dropped_groups,
                 "requeued": sorted(self.in_flight) + self.requeued,  # cut off mid-episode: rerun them first
                 "buffer": [[dataclasses.asdict(e) for e in g] for g in self.buffer],
                 "counts": dict(self.counts), "recent_env_errors": list(self.recent_env_errors),
                 "micro_batch_size": self.micro_batch_size,  # halved by an out-of-memory: kept across restarts
                 **self.alerts.state_dict(), "breaker": self.breaker.state_dict(), "best": self.best,
                 "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}}
        t0 = time.perf_counter()
        state = await asyncio.to_thread(dist.gather_ranks, state)
        state["optimizer"] = await asyncio.to_thread(dist.optimizer_state, self.model, self.optimizer)
        self.saved_at = self.step
        if dist.rank() > 0:
            return
        path = await asyncio.to_thread(checkpoint.save, self.ckpt_dir, self.step, self.sampler.model, self.processor,
                                       state, self.reference, weights, self.cfg.drills, self.cfg.model.lora)
        await asyncio.to_thread(checkpoint.prune, self.ckpt_dir, self.cfg.checkpoint.keep)
        self.sink.checkpoint(self.step, str(path), version=version, size_bytes=checkpoint.size_bytes(path),
                             seconds=time.perf_counter() - t0)

    def restore(self, path: Path):
        state = dist.rank_state(checkpoint.load(path, self.model, self.reference))
        dist.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.step, self.version, self.cursor = state["step"], state["version"], state["cursor"]
        self.dropped_groups, self.requeued, self.best = state["dropped_groups"], state["requeued"], state["best"]
        self.micro_batch_size = state.get("micro_batch_size", self.micro_batch_size)  # older checkpoints: the config's
        self.buffer = [[Episode(**e) for e in g] for g in state["buffer"]]
        self.counts.update((k, v) for k, v in state["counts"].items() if k in self.counts)  # older names: left out
        self.recent_env_errors.extend(state["recent_env_errors"])
        self.alerts.load_state_dict(state)
        self.breaker.load_state_dict(state["breaker"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        self.saved_at = self.step
        self.sink.event("resumed", f"resumed from {path.name}: step {self.step}, version {self.version}, "
                        f"{sum(map(len, self.buffer))} buffered episodes, {len(self.requeued)} prompts to rerun",
                        step=self.step, path=str(path))

    async def on_trip(self, step: int, groups, metrics) -> dict | None:
        """The breaker refused this update: force sync, alert, roll back (returns its weights) or give up."""
        async with self.changed:
            # The refused batch frees admission for a replacement; buffered episodes of older versions are dropped.
            stale = [g for g in self.buffer if min(e.oldest_version for e in g) < self.version]
            self.buffer = [g for g in self.buffer if g not in stale]
            self.counts["stale_episodes_dropped"] += sum(len(g) for g in stale)
            self.release(len(groups) + len(stale))
        action = (f"update skipped, nothing published, {sum(len(g) for g in stale)} stale buffered episodes "
                  f"dropped, admission on-policy for {self.cfg.breaker.cooldown} healthy steps")
        weights = None
        if self.breaker.recent_trips(step) >= self.cfg.breaker.max_trips:
            good = dist.agreed(checkpoint.latest(self.ckpt_dir) if self.ckpt_dir else None)  # every rank's, as prepare
            if good is None or self.breaker.rollbacks >= self.cfg.breaker.max_rollbacks:
                self.sink.alert("breaker", f"step {step}: grad norm {metrics['grad_norm']:.4g}; "
                                f"{self.breaker.recent_trips(step)} trips, giving up: run tripped",
                                step=step, norm=metrics["grad_norm"], threshold=metrics.get("breaker_threshold"),
                                action="tripped")
                self.sink.metrics(step, metrics)
                self.summary.update(metrics, status="tripped", step=self.step, version=self.version)
                raise Finished
            state = await asyncio.to_thread(checkpoint.load, good, self.model, self.reference)
            dist.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
            self.breaker.trips.clear()
            self.breaker.rollbacks += 1
            weights = dist.full_weights(self.model)
            action += f"; rolled back to {good.name}"
            self.sink.event("rollback", f"step {step}: rolled back to checkpoint {good.name}", step=step, path=str(good))
        self.sink.alert("breaker", f"step {step}: grad norm {metrics['grad_norm']:.4g} above threshold "
                        f"{metrics.get('breaker_threshold', math.inf):.4g}; {action}", step=step,
                        norm=metrics["grad_norm"], threshold=metrics.get("breaker_threshold"), action=action)
        return weights
