"""One update on a fixed global batch, in one process or as a rank of `torchrun --nproc-per-node 2
tests/dist_support.py OUT STRATEGY [spike] [micro] [oom] [forward-oom] [step-oom] [reinforce]`, which writes each rank's result
to OUT/rank-R.pt for tests/test_dist.py (with a reduction of metrics only some ranks report, and the stall watch)."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_minibatches import make_cfg, sampled_groups  # noqa: E402

import molt_engine.update as update_mod  # noqa: E402
from molt_engine import dist  # noqa: E402
from molt_engine.breaker import Breaker  # noqa: E402
from molt_engine.models import char_tokenizer, load_policy  # noqa: E402
from molt_engine.update import train_step_fitting  # noqa: E402


def config(strategy="ddp", *flags):
    """spike: rank 0's gradient spikes; micro: micro-batches of 2 in 2 minibatches; oom: rank 1 runs out of memory
    once (the drill, before the update); forward-oom: rank 1 runs out in its first training forward, a real
    torch.OutOfMemoryError in the middle of the update; reinforce: the batch-level baseline."""
    algo = {"micro_batch_size": 2, "minibatches": 2} if "micro" in flags else {}
    if "reinforce" in flags:
        algo["estimator"] = "reinforce_baseline"
    return make_cfg().model_validate({
        **make_cfg().model_dump(), "algo": {**make_cfg().algo.model_dump(), **algo},
        "dist": {"nproc": 2, "strategy": strategy, "timeout_s": 60}, "breaker": {"abs_max": 100.0},
        "drills": {"spike_at": [0] if "spike" in flags else [], "oom_at": [0] if "oom" in flags else [],
                   "oom_rank": 1}})


def step(cfg) -> dict:
    """This rank's share of the 4 groups (all of them in one process), one update. Plain SGD at lr 1, so the
    weights move by exactly the clipped gradient: AdamW's first step is lr x sign(gradient), which turns the
    summation-order noise of gradients within ~1e-8 of zero into differences of up to 2 lr. With micro-batches,
    group 1 (rank 1's first) has two episodes of advantage 0, which stay out: rank 1 has fewer micro-batches."""
    tok = char_tokenizer()
    model, _ = load_policy(cfg.model, seed=0)
    groups = sampled_groups(model, tok)  # the same global batch on every rank
    if cfg.algo.micro_batch_size:
        for ep, reward in zip(groups[1], (0.0, 1.0, 2.0, 1.0)):
            ep.reward = reward
    start = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = dist.wrap(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg.dist)
    (metrics, weights, _, _), micro = train_step_fitting(
        model, optimizer, groups[dist.rank()::dist.world()], cfg, step=0, breaker=Breaker(cfg.breaker),
        published=start, pad_id=tok.pad_token_id, micro_batch_size=cfg.algo.micro_batch_size)
    return {"metrics": metrics, "weights": weights, "model": dist.full_weights(model), "start": start,
            "micro_batch_size": micro}


if __name__ == "__main__":
    cfg = config(*sys.argv[2:])
    dist.init(cfg.dist)
    if "forward-oom" in sys.argv[2:] and dist.rank() == 1:
        real, calls = update_mod._logprobs, []

        def out_of_memory(model, batch, cfg, stats):  # the model's forward ran (its collectives too), then this
            calls.append(stats)
            result = real(model, batch, cfg, stats)
            if stats and calls.count(True) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (injected after the first training forward)")
            return result
        update_mod._logprobs = out_of_memory
    if "step-oom" in sys.argv[2:] and dist.rank() == 1:  # rank 1's first optimizer step runs out, after the backward
        real_step, steps = torch.optim.SGD.step, []

        def step_out_of_memory(self, *args, **kwargs):
            steps.append(1)
            if len(steps) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (injected in the first optimizer step)")
            return real_step(self, *args, **kwargs)
        torch.optim.SGD.step = step_out_of_memory
    result = step(cfg)
    # An env metric and a count only rank 1's episodes reported, a name only rank 0 has, a mean over both
    result["reduced"] = dist.reduce_metrics({"reward_mean": float(dist.rank()), "tool_errors": 2.0,
                                             **({"accuracy_strict": 0.25, "agent_errors": 3.0} if dist.rank() else
                                                {"a_first": 7.0})})
    # Inside a step, the trainer stalls after twice the collective timeout without progress; between steps, never
    quick = cfg.dist.model_copy(update={"timeout_s": 0.05})
    dist.mark()
    result["stalled"] = [dist.stalled(quick)]
    time.sleep(0.2)
    result["stalled"].append(dist.stalled(quick))
    dist.mark(False)
    result["stalled"].append(dist.stalled(quick))
    torch.save(result, Path(sys.argv[1]) / f"rank-{dist.rank()}.pt")
    dist.close()
