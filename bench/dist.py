"""Data-parallel ranks vs one process: samples/s of `dist.nproc` 2 ranks x 1 thread against 1 process x 1 thread on
the same config (max_digit, the same global batch), and where the time goes.

    python bench/dist.py                   # 1 process, then 2 ranks through torchrun; 60 steps each
    python bench/dist.py --steps 100 --strategy fsdp2

Prints one row per setup: the median samples/s over the RL steps after the first 5 (rank 0 reports the sum over
the ranks), the trainer's and the sampler's idle share, the median step time and the wall time of the whole run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from molt_engine import NullSink, train


class Collect(NullSink):
    def __init__(self):
        self.steps = {}

    def metrics(self, step, values):
        if "reward_mean" in values:
            self.steps[step] = values


def config(steps: int, nproc: int, strategy: str) -> dict:
    return {"env": "max_digit", "seed": 0, "loop": {"steps": steps, "eval_every": 0, "threads": 1},
            "checkpoint": {"every": 0}, "dist": {"nproc": nproc, "strategy": strategy}}


def rank_main(out: Path, steps: int, nproc: int, strategy: str):
    """One process or one rank: train, and (rank 0) write the per-step metrics to `out`."""
    sink, t0 = Collect(), time.perf_counter()
    train(config(steps, nproc, strategy), sink)
    if os.environ.get("RANK", "0") == "0":
        out.write_text(json.dumps({"steps": sink.steps, "wall_s": time.perf_counter() - t0}))


def summarize(name: str, result: dict) -> str:
    steps = [result["steps"][k] for k in sorted(result["steps"], key=int)][5:]
    med = {k: statistics.median(s[k] for s in steps)
           for k in ("samples_per_s", "trainer_idle_ratio", "sampler_idle_ratio")}
    step_s = statistics.median(128 / s["samples_per_s"] for s in steps)  # 16 groups x 8 episodes a step
    return (f"| {name} | {med['samples_per_s']:.0f} | {med['trainer_idle_ratio']:.2f} | "
            f"{med['sampler_idle_ratio']:.2f} | {step_s:.2f} | {result['wall_s']:.0f} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp2"])
    p.add_argument("--rank", nargs=4, help=argparse.SUPPRESS)  # out steps nproc strategy: run as one rank
    a = p.parse_args()
    if a.rank:
        return rank_main(Path(a.rank[0]), int(a.rank[1]), int(a.rank[2]), a.rank[3])
    print("| setup | samples/s | trainer idle | sampler idle | step s | wall s |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in (1, 2):
            out = Path(tmp) / f"{nproc}.json"
            args = [__file__, "--rank", str(out), str(a.steps), str(nproc), a.strategy]
            launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
            subprocess.run([sys.executable, *launcher, *args], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.DEVNULL)
            name = "1 process x 1 thread" if nproc == 1 else f"{nproc} ranks x 1 thread ({a.strategy})"
            print(summarize(name, json.loads(out.read_text())), flush=True)


if __name__ == "__main__":
    main()
