"""Injected faults (config `drills`), so that users and tests can prove the alarms and the supervisor work."""
import math
import os
import time

import torch


def crash_or_hang(drills, step: int, out_dir):
    """Crash and hang drills, each once per step unless crash_repeat (remembered across restarts on disk)."""
    for kind, steps in (("crash", drills.crash_at), ("hang", drills.hang_at)):
        if step not in steps:
            continue
        marker = out_dir / "drills" / f"{kind}-{step}" if out_dir else None
        if marker and marker.exists() and not (kind == "crash" and drills.crash_repeat):
            continue
        if marker:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        if kind == "crash":
            os._exit(1)
        time.sleep(drills.hang_seconds)  # blocks the event loop on purpose: no heartbeat, no progress


def poison_loss(drills, step: int, loss: torch.Tensor) -> torch.Tensor:
    return loss * math.nan if step in drills.nan_at else loss


def spike_gradient(drills, step: int, model):
    """Add a gradient of norm spike_norm in a random direction, so that it spikes even a zero gradient."""
    if step not in drills.spike_at:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2: this rank's shard
    noise = [torch.randn(g.shape, generator=torch.Generator().manual_seed(step + i)) for i, g in enumerate(grads)]
    scale = drills.spike_norm / float(torch.sqrt(sum((n ** 2).sum() for n in noise)))
    for g, n in zip(grads, noise):
        g.add_((n * scale).to(g.device))


def out_of_memory(drills, step: int, rank: int, where: str) -> bool:
    """Whether this rank runs out of memory in the step's update (oom_rank: that rank only), `where` oom_in says."""
    return step in drills.oom_at and drills.oom_rank in (None, rank) and drills.oom_in == where
