"""The agent path vs the env path on the same task: the calculator agent (the OpenAI SDK against the run's loopback
server) vs the chat calculator env, on the same warm-started tiny-chat policy, 64 episodes at once.

    python bench/agents.py --steps 12 --pairs 3

A warm start of --warm-steps (lr 1e-3) on the chat calculator's demonstrations is saved once; every run loads it
(warm_start 0), so both paths sample from the same weights and make the same tool calls. groups_per_step 8 x
group_size 8: 64 episodes in flight, i.e. 64 agents at once on the agent path. Runs alternate env, agent, env, agent,
... (--pairs pairs), so load changes hit both. Prints per run the median samples/s over the steps after the first,
the mean decode batch (requests per decode step: sampler_occupancy x 64), requests per episode and agent errors;
then the median of the per-pair ratios agent/env samples/s and the overhead (1 - ratio).
"""
import argparse
import asyncio
import statistics
import tempfile

import torch

from molt_engine import NullSink, train
from molt_engine.chat import stop_ids
from molt_engine.config import RunConfig
from molt_engine.models import load_policy
from molt_engine.rollout import Rollout

IN_FLIGHT = 64


class Rates(NullSink):
    def __init__(self):
        self.rows = []

    def metrics(self, step, values):
        if "samples_per_s" in values:
            self.rows.append(values)


def warm_started(directory: str, steps: int):
    cfg = RunConfig.model_validate({"env": "chat_calculator", "model": {"preset": "tiny-chat"},
                                    "warm_start": {"steps": steps, "lr": 1e-3}})
    model, tok = load_policy(cfg.model, cfg.seed)
    rollout = Rollout(cfg, tok, model.config.max_position_embeddings, stop_ids(tok))
    loss = asyncio.run(rollout.warm_start(model, tok.pad_token_id, lambda: False))
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    print(f"warm start: {steps} steps, final loss {loss:.3f}", flush=True)


def run(env: str, directory: str, steps: int) -> dict:
    sink = Rates()
    summary = train({"env": env, "model": {"preset": None, "path": directory}, "seed": 0, "warm_start": {"steps": 0},
                     "loop": {"steps": steps, "groups_per_step": 8, "group_size": 8, "eval_every": 0},
                     "checkpoint": {"every": 0}}, sink)
    rows = sink.rows[1:]
    out = {"samples_per_s": statistics.median(r["samples_per_s"] for r in rows),
           "decode_batch": statistics.mean(r["sampler_occupancy"] for r in rows) * IN_FLIGHT,
           "tool_call_rate": statistics.mean(r["tool_call_rate"] for r in rows),
           "reward": statistics.mean(r["reward_mean"] for r in rows), "status": summary["status"]}
    if "agent_errors" in rows[0]:
        out.update(requests_per_episode=statistics.mean(r["agent_requests_per_episode"] for r in rows),
                   segments_per_episode=statistics.mean(r["segments_per_episode"] for r in rows),
                   agent_errors=sum(r["agent_errors"] for r in sink.rows))
    else:
        out["env_errors"] = sum(r["env_errors"] for r in sink.rows)
    print(f"  {env:17s} " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()),
          flush=True)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--warm-steps", type=int, default=150)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        warm_started(directory, args.warm_steps)
        ratios = []
        for pair in range(args.pairs):
            print(f"pair {pair}", flush=True)
            env = run("chat_calculator", directory, args.steps)
            agent = run("calculator_agent", directory, args.steps)
            ratios.append(agent["samples_per_s"] / env["samples_per_s"])
        ratio = statistics.median(ratios)
        print(f"agent/env samples/s per pair {[round(r, 3) for r in ratios]}; median {ratio:.3f}, "
              f"overhead {1 - ratio:.1%}")


if __name__ == "__main__":
    main()
