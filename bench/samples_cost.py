"""What recording samples costs: the same short training through the daemon's DbSink with recording on (the
defaults: 2 groups per step, 4 episodes per eval) and off (record.samples_per_step = eval_samples = 0).

    python bench/samples_cost.py [--steps 40] [--pairs 3]

Runs alternate on/off and their order within each pair. Prints each run's median samples/s (steps after the first
few), the median over pairs of the on/off ratio, and the CPU the recording takes, which machine noise cannot hide:
building the records (in the trainer's thread), the sink calls (on the event loop) and the extra CPU of the sink's
writer thread (on minus off), as shares of the training time.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.records import Records  # noqa: E402
from daemon.sink import DbSink  # noqa: E402
from molt_engine import loop, train  # noqa: E402

SKIP = 5  # the first steps of a run warm up allocators and caches


class Measured:
    """Forwards to the DbSink; keeps each step's samples/s and the time spent in samples() calls."""

    def __init__(self, inner):
        self.inner, self.rates, self.call_s = inner, [], 0.0

    def metrics(self, step, values):
        if "samples_per_s" in values:
            self.rates.append(values["samples_per_s"])
        self.inner.metrics(step, values)

    def samples(self, step, kind, records):
        t0 = time.perf_counter()
        self.inner.samples(step, kind, records)
        self.call_s += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self.inner, name)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--pairs", type=int, default=3)
    args = p.parse_args()
    base = {"env": "guess_number", "loop": {"steps": args.steps, "groups_per_step": 8, "group_size": 8,
                                            "max_staleness": 1, "eval_every": 10, "eval_episodes": 16},
            "warm_start": {"steps": 10}, "checkpoint": {"every": 0}}
    configs = {"on": base, "off": {**base, "record": {"samples_per_step": 0, "eval_samples": 0}}}

    build_s = 0.0  # building the train records, timed around the engine's own function (recording on only)
    build = loop.training_samples

    def timed_build(*a, **kw):
        nonlocal build_s
        t0 = time.perf_counter()
        out = build(*a, **kw)
        build_s += (time.perf_counter() - t0) if out else 0.0
        return out
    loop.training_samples = timed_build

    ratios, medians = [], {"on": [], "off": []}
    train_s = call_s = 0.0
    writer_s = {"on": 0.0, "off": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        api = Records(Path(tmp) / "home")
        for i in range(args.pairs):
            pair = {}
            for kind in (("off", "on") if i % 2 == 0 else ("on", "off")):
                run = api.create_run(configs[kind])
                sink = Measured(DbSink(api.engine, run["id"], 0, spool_dir=Path(tmp) / f"spool-{i}-{kind}"))
                t0 = time.perf_counter()
                train(configs[kind], sink)
                elapsed = time.perf_counter() - t0
                sink.inner.close()
                assert sink.inner.failures == 0
                writer_s[kind] += sink.inner.writer_cpu_s
                pair[kind] = statistics.median(sink.rates[SKIP:])
                medians[kind].append(pair[kind])
                if kind == "on":
                    train_s, call_s = train_s + elapsed, call_s + sink.call_s
                    stored = len(api.samples(run["id"], limit=100_000))
                print(f"  pair {i + 1} {kind:3s}: median {pair[kind]:6.1f} samples/s", flush=True)
            ratios.append(pair["on"] / pair["off"])
    cost = (1 - statistics.median(ratios)) * 100
    extra = writer_s["on"] - writer_s["off"]
    print(f"recording off: {statistics.median(medians['off']):.1f} samples/s   on: "
          f"{statistics.median(medians['on']):.1f} samples/s   cost (median of {args.pairs} paired ratios): "
          f"{cost:+.2f}%   ({args.steps} steps per run, 8 groups x 8 per step)")
    print(f"recording CPU: building records {build_s * 1e3:.0f} ms = {build_s / train_s * 100:.2f}% of the training "
          f"time, sink calls {call_s * 1e3:.0f} ms = {call_s / train_s * 100:.2f}%, writer thread "
          f"{extra * 1e3:.0f} ms = {extra / train_s * 100:.2f}%; total {(build_s + call_s + extra) / train_s * 100:.2f}% "
          f"({stored} samples in the last run)")


if __name__ == "__main__":
    main()
