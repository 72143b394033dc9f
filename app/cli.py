"""The `molt` command line: `molt train` runs the engine headless in this terminal."""
import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="molt", description="Molt Studio: RL for language-model agents.")
    commands = parser.add_subparsers(dest="command", required=True)

    t = commands.add_parser("train", help="train a policy in this terminal (no server)")
    t.add_argument("--config", type=Path, help="JSON run config; the flags below override it")
    t.add_argument("--env", help="environment name, e.g. max_digit, calculator, guess_number")
    t.add_argument("--preset", help="built-in model, e.g. tiny-dense")
    t.add_argument("--model-path", help="local Hugging Face causal-LM directory instead of a preset")
    t.add_argument("--steps", type=int, help="optimizer steps")
    t.add_argument("--max-staleness", type=int, help="policy versions a sample may lag; 0 = on-policy")
    t.add_argument("--seed", type=int)
    t.add_argument("--out", type=Path, help="output directory (default runs/<env>-<time>)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --out (its saved config is used unless --config)")
    t.set_defaults(func=cmd_train)

    args = parser.parse_args(argv)
    sys.exit(args.func(args))


def cmd_train(args) -> int:
    from molt_engine import RunConfig, config_errors, train
    from molt_engine.config import ValidationError

    if args.resume and not args.out:
        print("--resume needs --out, the directory of the run to continue", file=sys.stderr)
        return 2
    saved = args.out / "config.json" if args.out else None
    if args.config:
        config = json.loads(args.config.read_text())
    elif args.resume and saved.exists():
        config = json.loads(saved.read_text())
    else:
        config = {}
    for key, value in [("env", args.env), ("seed", args.seed)]:
        if value is not None:
            config[key] = value
    if args.preset or args.model_path:
        config["model"] = {"preset": args.preset, "path": args.model_path}
    for key, value in [("steps", args.steps), ("max_staleness", args.max_staleness)]:
        if value is not None:
            config.setdefault("loop", {})[key] = value
    try:
        cfg = RunConfig.model_validate(config)
    except ValidationError as e:
        print("invalid config:\n  " + "\n  ".join(config_errors(e)), file=sys.stderr)
        return 2
    out = args.out or Path("runs") / f"{cfg.env}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=1))
    sink = ProgressSink(cfg.loop.steps)
    try:
        summary = train(cfg, sink, out_dir=out, resume=args.resume)
    finally:
        sink.bar.close()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}, indent=1))
    return 0


class ProgressSink:
    """A progress bar with the step, the reward and its 10-step moving average."""

    def __init__(self, steps: int):
        from tqdm import tqdm
        self.bar = tqdm(total=steps, unit="step", dynamic_ncols=True)
        self.rewards = []
        self.postfix = {}

    def metrics(self, step, values):
        if "reward_mean" in values:
            self.rewards.append(values["reward_mean"])
            self.postfix.update(reward=f"{values['reward_mean']:.2f}", avg10=f"{sum(self.rewards[-10:]) / len(self.rewards[-10:]):.2f}")
            self.bar.update(step + 1 - self.bar.n)  # a resumed run starts mid-way
        if "eval_reward" in values:
            self.postfix["eval"] = f"{values['eval_reward']:.2f}"
        self.bar.set_postfix(self.postfix, refresh=True)

    def alert(self, kind, message, **data):
        self.bar.write(f"ALERT {kind}: {message}")

    def event(self, kind, message, **data):
        self.bar.write(f"{kind}: {message}")

    def checkpoint(self, step, path, **info):
        pass

    def heartbeat(self):
        pass


if __name__ == "__main__":
    main()
