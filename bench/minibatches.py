"""PPO with minibatches: `algo.minibatches` 4 vs 1 on max_digit and calculator, training reward and samples/s.

    python bench/minibatches.py                      # both envs, 60 steps each, seed 0
    python bench/minibatches.py --env calculator --steps 100 --seeds 0 1
    python bench/minibatches.py --env calculator --minibatches 4 --lr 7.5e-5

Prints one row per (env, minibatches, seed): the mean training reward of the first and last 10 steps, the greedy
eval reward on the final weights, the mean clip_ratio, and the median samples/s over the RL steps.
"""
import argparse
import statistics
import time

from molt_engine import NullSink, train

CONFIGS = {
    "max_digit": {"env": "max_digit"},
    # The README's calculator recipe: a gentler warm start that learns to copy numbers.
    "calculator": {"env": "calculator", "warm_start": {"steps": 100, "lr": 1e-3}},
}


class Collect(NullSink):
    def __init__(self):
        self.steps, self.final_eval = {}, None

    def metrics(self, step, values):
        if "reward_mean" in values:
            self.steps[step] = values
        elif "eval_reward" in values:
            self.final_eval = values["eval_reward"]  # the last eval is the one on the final weights


def run(env: str, minibatches: int, seed: int, steps: int, lr: float) -> dict:
    sink = Collect()
    config = {**CONFIGS[env], "seed": seed, "algo": {"minibatches": minibatches, "lr": lr},
              "loop": {"steps": steps, "eval_every": steps, "eval_episodes": 64}, "checkpoint": {"every": 0}}
    t0 = time.perf_counter()
    train(config, sink)
    rewards = [sink.steps[s]["reward_mean"] for s in sorted(sink.steps)]
    return {"first10": statistics.mean(rewards[:10]), "last10": statistics.mean(rewards[-10:]),
            "eval": sink.final_eval, "clip": statistics.mean(v["clip_ratio"] for v in sink.steps.values()),
            "samples_per_s": statistics.median(v["samples_per_s"] for v in sink.steps.values()),
            "wall_s": time.perf_counter() - t0}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", choices=sorted(CONFIGS), nargs="+", default=["max_digit", "calculator"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--minibatches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--lr", type=float, default=3e-4, help="algo.lr of every run (the default's)")
    args = p.parse_args()
    print("| env | minibatches | seed | reward first 10 | reward last 10 | final eval | clip_ratio | samples/s | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for env in args.env:
        for k in args.minibatches:
            for seed in args.seeds:
                r = run(env, k, seed, args.steps, args.lr)
                print(f"| {env} | {k} | {seed} | {r['first10']:.3f} | {r['last10']:.3f} | {r['eval']:.3f} | "
                      f"{r['clip']:.4f} | {r['samples_per_s']:.0f} | {r['wall_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
