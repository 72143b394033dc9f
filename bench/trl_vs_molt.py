"""Benchmark: TRL GRPOTrainer vs molt_engine on max_digit, and our max_staleness 2 vs 0 under tool latency."""
# Part 1 trains the same warm-started tiny-dense policy with TRL's GRPOTrainer and with our engine on `max_digit`
# (same prompts, reward, group size, batch and optimizer settings) and reports completions per second and the wall
# time until the 10-step moving average of the training reward reaches 0.9.
# Part 2 trains ours on `calculator` with long-tail tool latency, once on-policy (max_staleness 0) and once with
# max_staleness 2, and reports completions per second and the final reward of each.
#
#     python bench/trl_vs_molt.py                # both parts, seeds 0 1 2 (tens of minutes on 2 cores)
#     python bench/trl_vs_molt.py --quick        # smoke test: tiny step counts, one seed
#     python bench/trl_vs_molt.py --part 1 --seeds 0 --trl-threads 1 2 --max-seconds 120
#
# Every run starts from the same weights: the engine's own supervised warm start (Rollout.warm_start, 70 steps on env
# demonstrations) runs once per seed and is saved with save_pretrained, and every trainer loads that directory.
# Timing starts after loading, at the start of RL, and never includes the warm start.
import argparse
import asyncio
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

import torch
import transformers

from molt_engine.config import ModelConfig, RunConfig, WarmStartConfig
from molt_engine.envs import make_env
from molt_engine.loop import NullSink, Training
from molt_engine.models import load_policy

# The hyperparameters both trainers share in part 1; each is written once and mapped to both config spellings below.
GROUP_SIZE = 8          # TRL num_generations
PROMPTS_PER_STEP = 16   # TRL: per_device_train_batch_size = 16 x 8 completions, one generation batch per step
LR = 3e-4               # the engine default (algo.lr)
MAX_GRAD_NORM = 1.0
TEMPERATURE = 1.0
MAX_NEW_TOKENS = 4      # = MaxDigit.max_tokens, the turn length our engine uses for this env
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
THRESHOLD, WINDOW = 0.9, 10   # "solved": the 10-step moving average of the training reward reaches 0.9
SAMPLES_PER_STEP = GROUP_SIZE * PROMPTS_PER_STEP

# Part 2: median tool call 50 ms, one in ten takes 500 ms.
CALCULATOR_WARM_START = {"steps": 100, "lr": 1e-3}   # the README's calculator recipe: greedy eval ~0.85, sampled ~0.4
LATENCY = {"tool_latency_ms": 50, "tail_prob": 0.1, "tail_ms": 500}
# Both runs of part 2 train at half the default lr: at 3e-4 the policy moves about 0.05 KL per version, so data two
# versions old lags (final eval 0.72-0.88 at max_staleness 2 vs 0.84-0.97 on-policy, 120 steps); at 1.5e-4 both reach
# the on-policy run's eval at 3e-4 or better.
PART2_LR = 1.5e-4


# ---- shared bookkeeping ------------------------------------------------------------------------------------------

class Timeline:
    """Per-step training reward with the wall time it was reported at (seconds since RL start)."""

    def __init__(self, max_seconds: float):
        self.max_seconds = max_seconds
        self.t0 = time.perf_counter()
        self.times: list[float] = []
        self.rewards: list[float] = []

    def start(self):
        self.t0 = time.perf_counter()

    def record(self, reward: float) -> bool:
        """Store one step; True once the run is over its time budget (the caller then stops after this step)."""
        self.times.append(time.perf_counter() - self.t0)
        self.rewards.append(reward)
        return self.times[-1] >= self.max_seconds

    def summary(self) -> dict:
        steps = len(self.rewards)
        seconds = self.times[-1] if steps else math.nan
        solved_step = next((i for i in range(WINDOW - 1, steps)
                            if sum(self.rewards[i - WINDOW + 1:i + 1]) / WINDOW >= THRESHOLD), None)
        return {
            "steps": steps,
            "seconds": seconds,
            # Only trained completions count: every step trains exactly SAMPLES_PER_STEP of them in both systems.
            "samples_per_s": steps * SAMPLES_PER_STEP / seconds if steps else math.nan,
            "time_to_solve": self.times[solved_step] if solved_step is not None else math.inf,
            "steps_to_solve": solved_step + 1 if solved_step is not None else None,
            "last10_reward": sum(self.rewards[-WINDOW:]) / len(self.rewards[-WINDOW:]) if steps else math.nan,
        }


class Timing(transformers.TrainerCallback):
    """TRL's side of a Timeline: started when training begins (at `threads` torch threads), every logged reward
    booked, training stopped once over the time budget."""

    def __init__(self, timeline: Timeline, threads: int):
        self.timeline, self.threads = timeline, threads

    def on_train_begin(self, args, state, control, **kwargs):
        torch.set_num_threads(self.threads)   # again here, in case trainer setup changed it
        self.timeline.start()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs and self.timeline.record(logs["reward"]):
            control.should_training_stop = True


class _Stop(Exception):
    """Raised from our sink to end a run at its time budget: it ends the run at once, with no final eval or save."""


class BenchSink(NullSink):
    """Our engine's sink: records every training step and the final eval, stops the run at its time budget."""

    def __init__(self, timeline: Timeline):
        self.timeline = timeline
        self.final_eval = None      # eval reward on the final weights; None if the run was cut by the time budget
        self.stale_dropped = 0
        self.staleness = []         # each step's mean age of the trained tokens, in versions
        self.breaker_trips = 0      # steps our gradient-norm breaker refused to apply (TRL has no such thing)

    def metrics(self, step, values):
        if "eval_reward" in values and step > 0:   # part 2 evals at step 0 and on the final weights only
            self.final_eval = values["eval_reward"]
        if "reward_mean" in values:
            self.stale_dropped += int(values.get("stale_episodes_dropped", 0))
            self.staleness.append(values.get("staleness_mean", 0.0))
            self.breaker_trips += int(values.get("breaker_tripped", 0))
            if self.timeline.record(values["reward_mean"]):
                raise _Stop

    def heartbeat(self, *args, **kwargs):   # the loop calls it about every second; nothing to do here
        pass


def isolated(run, *args):
    """run(*args) in a process of its own: a trainer's torch thread teams (TRL's main thread splits its ops over two)
    slow the next trainer in the same process, as libgomp throttles its waits once there are more team threads than
    cores."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run, *args).result()


def warm_started_policy(env: str, seed: int, out_dir: str, warm_start: dict) -> str:
    """Build the tiny-dense preset for `seed`, run our engine's supervised warm start on it, save it to out_dir.

    This is exactly what `molt train` does before RL (load_policy(ModelConfig(preset="tiny-dense"), seed), then
    Rollout.warm_start); saving it lets TRL and every configuration of ours start from identical weights.
    """
    cfg = RunConfig.model_validate({"env": env, "seed": seed, "warm_start": warm_start})
    run = Training(cfg, NullSink())
    asyncio.run(run.rollout.warm_start(run.model, run.pad_id, lambda: False))
    run.model.save_pretrained(out_dir)
    run.tokenizer.save_pretrained(out_dir)
    return out_dir


def run_ours(config: dict, max_seconds: float, final=None) -> dict:
    """One run of our engine; `final(model, tokenizer, seed)`, if given, scores the trained weights ("final")."""
    if "checkpoint" in RunConfig.model_fields:
        # No checkpoints: TRL saves nothing either (save_strategy="no"), and there is no run directory to write to.
        config = {**config, "checkpoint": {"every": 0}}
    cfg = RunConfig.model_validate(config)
    sink = BenchSink(Timeline(max_seconds))
    run = Training(cfg, sink)   # loads the policy and sets torch threads (loop.threads): not timed, as for TRL
    sink.timeline.start()
    try:
        asyncio.run(run.run())
    except* _Stop:
        pass
    summary = {**sink.timeline.summary(), "final_eval": sink.final_eval, "stale_dropped": sink.stale_dropped,
               "staleness": statistics.fmean(sink.staleness or [0.0]), "breaker_trips": sink.breaker_trips}
    if final:
        summary["final"] = final(run.model, run.processor, cfg.seed)
    return summary


# ---- part 1: TRL vs ours on max_digit ----------------------------------------------------------------------------

def train_seeds(seed: int, steps: int) -> list[int]:
    """The prompt seeds our engine trains on, in order: (run seed << 32) + cursor, 16 consecutive ones per step."""
    return [(seed << 32) + cursor for cursor in range(steps * PROMPTS_PER_STEP)]


def run_ours_max_digit(model_dir: str, seed: int, steps: int, max_seconds: float, staleness: int) -> dict:
    config = {
        "env": "max_digit", "seed": seed,
        "model": {"preset": None, "path": model_dir},
        "warm_start": {"steps": 0},   # already warm-started, like the model TRL gets
        "loop": {"steps": steps, "groups_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE,
                 "max_staleness": staleness, "temperature": TEMPERATURE, "eval_every": 0},
        "algo": {"estimator": "grpo", "loss": "ppo", "clip_low": CLIP_LOW, "clip_high": CLIP_HIGH,
                 "lr": LR, "weight_decay": 0.0, "max_grad_norm": MAX_GRAD_NORM, "kl_coef": 0.0},
    }
    return run_ours(config, max_seconds)


def run_trl_max_digit(model_dir: str, seed: int, steps: int, max_seconds: float, threads: int) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = load_policy(ModelConfig(preset=None, path=model_dir), seed)
    eos_id = tokenizer.eos_token_id

    # Our env's prompts, the same seeds in the same order as our engine (shuffle_dataset=False below).
    seeds = train_seeds(seed, steps)

    async def env_prompts():
        return [(await make_env("max_digit").reset(s)).text for s in seeds]
    dataset = Dataset.from_dict({"prompt": asyncio.run(env_prompts()), "seed": seeds})

    async def env_reward(prompts, completions, completion_ids, seed, **_):
        """The env's own step() as reward. Completions are decoded from the ids exactly as our engine does (up to
        eos, special tokens kept), not from TRL's skip_special_tokens text, so a stray <pad> costs both the same."""
        async def score(ids, s):
            env = make_env("max_digit")
            await env.reset(s)
            text = tokenizer.decode(ids[:-1] if ids and ids[-1] == eos_id else ids)
            return (await env.step(text)).reward
        return await asyncio.gather(*(score(ids, s) for ids, s in zip(completion_ids, seed)))

    timeline = Timeline(max_seconds)

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, report_to=[], disable_tqdm=True, seed=seed,
            max_steps=steps, logging_steps=1, save_strategy="no", eval_strategy="no",
            # One optimizer step = one generation batch = 16 prompts x 8 completions, as ours.
            num_generations=GROUP_SIZE, per_device_train_batch_size=SAMPLES_PER_STEP,
            gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, shuffle_dataset=False,
            # Sampling: plain temperature sampling, nothing filtered, completion capped at the env's turn length.
            max_completion_length=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_p=1.0, top_k=0,
            # Loss: PPO-clip with our asymmetric clip range, token mean over every completion token in the batch
            # ("dapo" = normalised by the active tokens of the whole generation batch = ours), group-std advantages
            # (= our "grpo" estimator), no KL, so no reference model.
            loss_type="dapo", epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH, scale_rewards="group", beta=0.0,
            # Optimizer: torch AdamW at a constant lr, as ours (TRL's default schedule decays linearly).
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            optim="adamw_torch", max_grad_norm=MAX_GRAD_NORM,
            # TRL turns checkpointing on by default; ours never recomputes activations.
            gradient_checkpointing=False,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=env_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Timing(timeline, threads)])
        trainer.remove_callback(transformers.PrinterCallback)   # it prints every step's log dict to stdout
        torch.set_num_threads(threads)
        trainer.train()
    return timeline.summary()


def part1(args) -> list[str]:
    ours = [f"ours (max_staleness {k})" for k in args.ours_staleness]
    trl = [f"TRL ({n} thr)" for n in args.trl_threads]
    rows = {name: [] for name in ours + trl}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as model_dir:
            log(f"part 1, seed {seed}: warm start")
            warm_started_policy("max_digit", seed, model_dir, {"steps": args.warm_steps})
            for name, k in zip(ours, args.ours_staleness):
                log(f"part 1, seed {seed}: {name}")
                rows[name].append(isolated(run_ours_max_digit, model_dir, seed, args.steps, args.max_seconds, k))
                log(f"  {fmt_run(rows[name][-1])}")
            for name, n in zip(trl, args.trl_threads):
                log(f"part 1, seed {seed}: {name}")
                rows[name].append(isolated(run_trl_max_digit, model_dir, seed, args.steps, args.max_seconds, n))
                log(f"  {fmt_run(rows[name][-1])}")

    out = [f"### Part 1: TRL GRPOTrainer vs ours, max_digit ({len(args.seeds)} seed(s): "
           f"{' '.join(map(str, args.seeds))}; cap {args.steps} steps or {args.max_seconds:g} s per run)", "",
           "Per run:", "",
           "| system | seed | steps | samples/s | time to 0.9 (s) | steps to 0.9 | last-10 reward |",
           "|---|---|---|---|---|---|---|"]
    for name, runs in rows.items():
        for seed, r in zip(args.seeds, runs):
            out.append(f"| {name} | {seed} | {r['steps']} | {r['samples_per_s']:.0f} | {fmt_time(r['time_to_solve'])}"
                       f" | {r['steps_to_solve'] or '-'} | {r['last10_reward']:.3f} |")

    medians = {name: (median(r["samples_per_s"] for r in runs), median(r["time_to_solve"] for r in runs),
                      f"{sum(math.isfinite(r['time_to_solve']) for r in runs)}/{len(runs)}")
               for name, runs in rows.items()}
    best_trl = max(trl, key=lambda name: medians[name][0])  # TRL at its fastest thread count
    trl_sps, trl_tts, _ = medians[best_trl]
    out += ["", f"Medians over seeds (time to 0.9 of a run that never got there counts as infinite); ratios against "
            f"{best_trl}, TRL's fastest setting:", "",
            "| system | samples/s | time to 0.9 (s) | reached 0.9 | samples/s vs TRL | TRL time / our time to 0.9 |",
            "|---|---|---|---|---|---|"]
    for name, (sps, tts, reached) in medians.items():
        ratios = f"{sps / trl_sps:.2f}x | {fmt_ratio(trl_tts, tts)}" if name in ours else "- | -"
        out.append(f"| {name} | {sps:.0f} | {fmt_time(tts)} | {reached} | {ratios} |")
    return out


# ---- part 2: ours, max_staleness 2 vs 0, calculator with long-tail tool latency ----------------------------------

def part2(args) -> list[str]:
    seed = args.seeds[0]
    results = {}
    with tempfile.TemporaryDirectory() as model_dir:
        # Warm start without latency: the demonstrations are identical (latency only sleeps). It is not timed.
        log(f"part 2, seed {seed}: warm start")
        warm_started_policy("calculator", seed, model_dir, CALCULATOR_WARM_START)
        for staleness in (0, 2):
            log(f"part 2, seed {seed}: max_staleness {staleness}")
            config = {
                "env": "calculator", "env_args": LATENCY, "seed": seed,
                "model": {"preset": None, "path": model_dir}, "warm_start": {"steps": 0},
                # eval_every = steps: one eval at step 0 (both runs pay it) and the final eval after the last step.
                "loop": {"steps": args.part2_steps, "max_staleness": staleness, "eval_every": args.part2_steps,
                         "eval_episodes": 64},
                "algo": {"lr": PART2_LR},
            }
            results[staleness] = isolated(run_ours, config, args.max_seconds)
            log(f"  {fmt_run(results[staleness])}, final eval {results[staleness]['final_eval']}")

    out = [f"### Part 2: ours on calculator with tool latency {LATENCY}, max_staleness 2 vs 0 (seed {seed}; "
           f"{args.part2_steps} steps or {args.max_seconds:g} s per run; lr {PART2_LR:g})", "",
           "| max_staleness | steps | samples/s | last-10 train reward | final eval reward | stale-dropped episodes |",
           "|---|---|---|---|---|---|"]
    for staleness, r in results.items():
        final_eval = "-" if r["final_eval"] is None else f"{r['final_eval']:.3f}"
        out.append(f"| {staleness} | {r['steps']} | {r['samples_per_s']:.0f} | {r['last10_reward']:.3f} | {final_eval}"
                   f" | {r['stale_dropped']} |")
    a, b = results[2], results[0]
    out += ["", f"samples/s ratio staleness 2 / 0: **{a['samples_per_s'] / b['samples_per_s']:.2f}x** (target >= 2x); "
                f"last-10 train reward {a['last10_reward']:.3f} vs {b['last10_reward']:.3f}"]
    return out


# ---- formatting and main -----------------------------------------------------------------------------------------

def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else math.nan


def fmt_time(seconds: float) -> str:
    return f"{seconds:.1f}" if math.isfinite(seconds) else "not reached"


def fmt_ratio(trl: float, ours: float) -> str:
    if math.isfinite(trl) and math.isfinite(ours):
        return f"{trl / ours:.2f}x"
    return "n/a (ours not reached)" if math.isfinite(trl) else "n/a (TRL not reached)" if math.isfinite(ours) else "n/a"


def fmt_run(r: dict) -> str:
    trips = f", breaker trips {r['breaker_trips']}" if r.get("breaker_trips") else ""
    return (f"{r['steps']} steps in {r['seconds']:.1f} s, {r['samples_per_s']:.0f} samples/s, "
            f"time to 0.9: {fmt_time(r['time_to_solve'])}, last-10 reward {r['last10_reward']:.3f}{trips}")


def log(message: str):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", choices=["1", "2", "all"], default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (part 2 uses the first)")
    parser.add_argument("--max-seconds", type=float, default=180.0, help="wall-time cap of each training run")
    parser.add_argument("--steps", type=int, default=200, help="part 1: step cap of each run")
    parser.add_argument("--part2-steps", type=int, default=120, help="part 2: steps of each run")
    parser.add_argument("--warm-steps", type=int, default=WarmStartConfig().steps,
                        help="part 1: supervised warm-start steps before RL (default: the engine's default)")
    parser.add_argument("--trl-threads", type=int, nargs="+", default=None,
                        help="torch threads for TRL runs, one row each (default: 1 and all cores); ours uses the "
                             "engine's default (loop.threads)")
    parser.add_argument("--ours-staleness", type=int, nargs="+", default=[0, 1],
                        help="part 1: our max_staleness settings (0 = on-policy like TRL; 1 overlaps rollout and update)")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny step counts, seed 0, TRL at 1 thread")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.part2_steps = 12, 4
        args.seeds = args.seeds or [0]
        args.trl_threads = args.trl_threads or [1]
    args.seeds = args.seeds or [0, 1, 2]
    args.trl_threads = args.trl_threads or sorted({1, os.cpu_count() or 1})

    # Library chatter (progress bars, TRL's advice on CPU runs) would bury the table.
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")

    lines = []
    if args.part in ("1", "all"):
        lines += part1(args) + [""]
    if args.part in ("2", "all"):
        lines += part2(args) + [""]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"trl {_trl_version()}, {os.cpu_count()} CPU cores\n")
    print("\n".join(lines))


def _trl_version() -> str:
    try:
        import trl
        return trl.__version__
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    main()
