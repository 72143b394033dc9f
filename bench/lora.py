"""LoRA vs full fine-tuning on the same task: max_digit (tiny-dense) and the chat calculator (tiny-chat), each variant
RL from the same saved full warm start (bench/chat_learning.py's `warm_started`), at the learning rate it needs.
Adapters on a randomly initialised network do not learn max_digit (a LoRA-only warm start ends at loss 2.65, full
at 0.36): LoRA adapts a policy that already exists, so every variant starts from that one.

    python bench/lora.py max_digit --seeds 0 1 2 --minutes 10
    python bench/lora.py calculator --seeds 0 --minutes 15
    python bench/lora.py max_digit --variants lora8 --steps 3        # a smoke run

Per variant and seed: RL steps and minutes until the 10-step average training reward reaches --target (or "-"), the
final greedy eval, the optimizer state's bytes (Adam's moments: trained parameters only), a checkpoint's bytes, the
trained parameters and the median samples/s. RL stops at the target, after --minutes, or after --steps.
"""
import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_learning import RECIPES as CHAT, Progress, warm_started  # noqa: E402

from molt_engine import checkpoint, train  # noqa: E402

TASKS = {
    "max_digit": {"env": "max_digit", "loop": {"groups_per_step": 16, "group_size": 8, "eval_every": 0}},
    "calculator": CHAT["calculator"],
}
# The learning rate each needs: adapters start at zero and move ~10x slower per step at the full model's lr.
VARIANTS = {"full": (None, {"max_digit": 3e-4, "calculator": 3e-4}),
            "lora8": ({"r": 8, "alpha": 16}, {"max_digit": 3e-3, "calculator": 1e-3}),
            "lora32": ({"r": 32, "alpha": 64}, {"max_digit": 3e-3, "calculator": 1e-3})}


class Measured(Progress):
    """Progress, plus each step's samples/s and the checkpoints' sizes."""

    def __init__(self, threshold: float):
        super().__init__("reward_mean", threshold)
        self.rates, self.checkpoint_bytes = [], None

    def metrics(self, step, values):
        if "samples_per_s" in values:
            self.rates.append(values["samples_per_s"])
        super().metrics(step, values)

    def checkpoint(self, step, path, **info):
        self.checkpoint_bytes = info["size_bytes"]


def run(task: str, variant: str, seed: int, args, base: Path | None) -> dict:
    lora, rates = VARIANTS[variant]
    config = json.loads(json.dumps(TASKS[task]))
    # one checkpoint: at the end or the stop
    config.update(seed=seed, algo={"lr": rates[task]}, checkpoint={"every": args.steps})
    config["loop"].update(steps=args.steps, eval_every=0)
    config["model"] = {**config.get("model", {}), **({"lora": lora} if lora else {})}
    if base is not None:  # RL from the saved full warm start
        config["model"].update(preset=None, path=str(base))
        config["warm_start"] = {"steps": 0}
    sink = Measured(args.target)
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        summary = train_until(config, sink, args, Path(out))
        latest = checkpoint.latest(Path(out) / "checkpoints")
        state = torch.load(latest / "state.pt", weights_only=False) if latest else {"optimizer": {"state": {}}}
    adam = state["optimizer"]["state"].values()  # per trained parameter: step, exp_avg, exp_avg_sq
    moments = sum(t.numel() * t.element_size() for s in adam for t in s.values() if t.dim() > 0)
    return {"task": task, "variant": variant, "seed": seed, "lr": rates[task], "steps": summary.get("step"),
            "reached": sink.reached, "eval_reward": summary.get("eval_reward"), "optimizer_bytes": moments,
            "checkpoint_bytes": sink.checkpoint_bytes, "trained_params": sum(s["exp_avg"].numel() for s in adam),
            "samples_per_s": round(statistics.median(sink.rates[1:] or [0]), 1),
            "minutes": round((time.perf_counter() - t0) / 60, 2)}


def train_until(config: dict, sink: Measured, args, out: Path) -> dict:
    """RL until the target, --minutes (a SIGINT: the run stops and checkpoints) or --steps; then one greedy eval of
    the final policy (resumed from the last checkpoint with nothing left to train, it evaluates at its step)."""
    def watchdog():
        while sink.reached is None and (sink.start is None or time.perf_counter() - sink.start < args.minutes * 60):
            if done.is_set():
                return
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)
    done = threading.Event()
    threading.Thread(target=watchdog, daemon=True).start()
    try:
        summary = train(config, sink, out_dir=out)
    finally:
        done.set()
    final = {**config, "loop": {**config["loop"], "steps": summary["step"], "eval_every": 10**6,
                                "eval_episodes": args.eval_episodes}}
    return {**summary, "eval_reward": train(final, out_dir=out, resume=True).get("eval_reward")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--eval-episodes", type=int, default=64)
    args = parser.parse_args()
    for seed in args.seeds:
        base = warm_started({**TASKS[args.task], "seed": seed}, Path(tempfile.gettempdir()) / "molt-warm-starts")
        for variant in args.variants:
            print(json.dumps(run(args.task, variant, seed, args, base)), flush=True)


if __name__ == "__main__":
    main()
