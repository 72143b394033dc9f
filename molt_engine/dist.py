"""More than one process: torchrun's process group, the data-parallel model (DDP or FSDP2), full weights for the
sampler and checkpoints, and the reductions every rank enters in the same order. With one process, all no-ops."""
import ctypes
import math
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as td
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

FULL = StateDictOptions(full_state_dict=True)
SUMMED = {"samples_per_s", "tokens_per_s", "env_errors", "agent_errors", "tool_errors", "template_prefix_breaks",
          "stale_episodes_dropped", "groups_filtered"}  # else the mean
LARGEST = {"staleness_max", "grad_norm"}
_busy_since: float | None = None  # when this rank's trainer last made progress inside a step (None: between steps)


def init(cfg):
    """Join torchrun's process group when launched by it (its env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or td.is_initialized():
        return
    # A rank never outlives its launcher: when the daemon SIGKILLs the launcher, every rank goes with it.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    nccl = cfg.backend == "nccl" or (cfg.backend == "auto" and torch.cuda.is_available())
    # Several nodes: LOCAL_RANK is the rank's index on its own node (its GPU), RANK and WORLD_SIZE span every node
    # (the prompt split, who reports and writes checkpoints)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local < torch.cuda.device_count():  # this rank's GPU, for NCCL and torch.cuda's calls (see models.device_of)
        torch.cuda.set_device(local)
    # With NCCL, the model's collectives run on the GPUs and the loop's small reductions (CPU tensors, objects) on
    # gloo. Every collective gives up after timeout_s (gloo raises; NCCL's watchdog ends the process): a stuck
    # group ends the attempt, and the daemon restarts it.
    td.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", timeout=timedelta(seconds=cfg.timeout_s))


def mark(busy: bool = True):
    """The trainer makes progress inside a step now (a micro-batch done), or it is done with the step (busy False)."""
    global _busy_since
    _busy_since = time.monotonic() if busy else None


def stalled(cfg) -> bool:
    """More than one process, and the trainer has been inside a step without progress for twice the collective
    timeout: its group is stuck though no collective gave up (each would have by then). Then the heartbeat stops."""
    return world() > 1 and _busy_since is not None and time.monotonic() - _busy_since > 2 * cfg.timeout_s


def close():
    if td.is_initialized():
        td.destroy_process_group()


def rank() -> int:
    return td.get_rank() if td.is_initialized() else 0


def world() -> int:
    return td.get_world_size() if td.is_initialized() else 1


def local_config(cfg):
    """This rank's loop: its share of each batch (groups_per_step) and of the rollout workers (all: one process)."""
    loop = cfg.loop.model_copy(update={"groups_per_step": cfg.loop.groups_per_step // world(),
                                       "workers": cfg.loop.workers and -(-cfg.loop.workers // world())})
    return cfg.model_copy(update={"loop": loop})


def prompt_index(cursor: int) -> int:
    """The global prompt of this rank's `cursor`-th one: ranks take every world-th prompt, so none is shared."""
    return cursor * world() + rank()


def wrap(model, optimizer, cfg):
    """Make `model` data-parallel (sharded over the ranks with FSDP2, replicated with DDP) and point the optimizer at
    its new parameters, with the state it had."""
    if world() == 1:
        return model, optimizer
    # (Asked of a fresh optimizer, this would give it a phantom first step: bias correction would be off by one.)
    state = get_optimizer_state_dict(model, optimizer) if optimizer.state else None
    if cfg.strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        # One group, not one per decoder layer: the trainer's forward calls the model several times (the prefixes
        # rows share, then the rest) before one backward, and a layer's gradient is complete only when the whole
        # backward is done; so the parameters are gathered for the forward and backward and sharded between steps.
        fully_shard(model, reshard_after_forward=False)
    else:
        from torch.distributed._composable import replicate  # DDP, applied in place: the model keeps its class
        replicate(model)
    (group,) = optimizer.param_groups  # the trainer's one group, now over the wrapped parameters (same order)
    group["params"] = list(model.parameters())
    optimizer.state.clear()
    if state:
        set_optimizer_state_dict(model, optimizer, state)
    return model, optimizer


def full_weights(model) -> dict:
    """A copy of the full weights that train (gathered from every rank's shard with FSDP2: a collective). Tied weights (one
    tensor under two names, as Qwen2.5's embedding and head) stay one tensor: copied once, as save_pretrained expects."""
    weights = model.state_dict() if world() == 1 else get_model_state_dict(model, options=FULL)
    # Frozen parameters (LoRA's base, frozen routers) never change: shared, not copied (the base's 4 bytes a param).
    # More than one process: the state dict's tensors are gathered anew (FSDP2) or replicated ones (DDP): copied.
    copies = {(p.data_ptr(), p.shape, p.dtype): p.detach() for p in model.parameters()
              if not p.requires_grad and world() == 1}
    for v in weights.values():
        if (v.data_ptr(), v.shape, v.dtype) not in copies:
            copies[v.data_ptr(), v.shape, v.dtype] = v.detach().clone()
    return {k: copies[v.data_ptr(), v.shape, v.dtype] for k, v in weights.items()}


def load_weights(model, weights: dict):
    if world() == 1:
        model.load_state_dict(weights)
    else:
        set_model_state_dict(model, dict(weights), options=FULL)  # it replaces the dict's values with shards


def optimizer_state(model, optimizer) -> dict:
    """The optimizer's state as a checkpoint keeps it: whole on every rank (gathered with FSDP2). Before its first
    step, as it is: the gather would give it a phantom step (see wrap)."""
    whole = world() == 1 or not optimizer.state
    return optimizer.state_dict() if whole else get_optimizer_state_dict(model, optimizer, options=FULL)


def load_optimizer_state(model, optimizer, state: dict):
    if world() == 1 or not state["state"]:
        optimizer.load_state_dict(state)
    else:
        set_optimizer_state_dict(model, optimizer, state, options=FULL)


def clip_grad_norm(model, max_norm: float) -> float:
    """The gradient norm every rank judges and clips by: the largest over the ranks (they are equal unless one rank's
    gradient went wrong after the all-reduce, as in the spike drill), so every rank skips a tripped step together."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor over the shards
        norm = norm.full_tensor()
    if world() > 1:
        norms = [torch.zeros((), dtype=norm.dtype) for _ in range(world())]
        td.all_gather(norms, norm.detach().reshape(()).cpu())
        norm = torch.stack(norms)
        norm = norm.max() if torch.isfinite(norm).all() else torch.tensor(math.nan)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.to(params[0].grad.device) if params else norm)
    return float(norm)


def all_sum(values: list[float], op=td.ReduceOp.SUM) -> list[float]:
    if world() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    td.all_reduce(t, op)
    return t.tolist()


def all_max(values: list[float]) -> list[float]:
    return all_sum(values, td.ReduceOp.MAX)


def all_gather(value) -> list:
    """Every rank's `value` (any picklable object), in rank order."""
    if world() == 1:
        return [value]
    values = [None] * world()
    td.all_gather_object(values, value)
    return values


def any_rank(flag: bool) -> bool:
    return bool(all_sum([float(flag)])[0])


def reduce_metrics(metrics: dict) -> dict:
    """A step's metrics over all ranks: rates and counts summed, maxima the largest, the rest the mean."""
    if world() == 1:
        return metrics
    ranks = all_gather(metrics)  # a name may be missing on a rank (an env metric none of its episodes reported)
    vals = {k: torch.tensor([m[k] for m in ranks if k in m], dtype=torch.float64) for k in sorted(set().union(*ranks))}
    return {k: float(v.sum() if k in SUMMED else v.max() if k in LARGEST else v.mean()) for k, v in vals.items()}


def gather_ranks(state: dict) -> dict:
    """Rank 0's checkpoint state with every rank's own (cursor, buffer, RNG, ...) under "ranks" (a collective)."""
    if world() == 1:
        return state
    states = [None] * world() if rank() == 0 else None
    td.gather_object(state, states, dst=0)
    return {**state, "ranks": states} if rank() == 0 else state


def agreed(path):
    """The checkpoint every rank resumes from, the same one: each reads it from the run's directory, where rank 0
    wrote it, so every node must see that directory (shared storage)."""
    if len(seen := set(all_gather(path and path.name))) > 1:
        raise RuntimeError(f"the ranks see different checkpoints {seen}: every node must see the run's directory")
    return path


def rank_state(state: dict) -> dict:
    """This rank's view of a checkpoint's state."""
    ranks = state.get("ranks")
    if (len(ranks) if ranks else 1) != world():
        raise RuntimeError(f"the checkpoint was written by {len(ranks) if ranks else 1} process(es); this run has "
                           f"{world()}: resume with the same dist.nproc (x nodes)")
    return {**state, **ranks[rank()]} if ranks else state
