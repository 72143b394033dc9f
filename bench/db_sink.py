"""What the database sink costs: the same short training with a NullSink and with the daemon's DbSink.

    python bench/db_sink.py [--steps 60] [--repeats 5]

Prints the median samples/s of each (over all steps after the first few, of repeats that alternate the two sinks
and their order) and the overhead in percent; the acceptance bar is <= 2%. Wall-clock throughput on a shared
machine is noisy, so it also prints what the sink costs in CPU, which noise cannot hide: the engine-side calls
(what the event loop pays) and the writer thread's CPU time, as shares of the training time.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlmodel import Session  # noqa: E402

from daemon.records import Records  # noqa: E402
from daemon.models import Attempt  # noqa: E402
from daemon.sink import DbSink  # noqa: E402
from molt_engine import NullSink, train  # noqa: E402

SKIP = 5  # the first steps of a run warm up allocators and caches


class Measured:
    """Forwards to the sink under test; keeps each step's samples/s and the time spent inside the sink's calls."""

    def __init__(self, inner):
        self.inner, self.rates, self.call_s = inner, [], 0.0

    def metrics(self, step, values):
        if "samples_per_s" in values:
            self.rates.append(values["samples_per_s"])
        t0 = time.perf_counter()
        self.inner.metrics(step, values)
        self.call_s += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self.inner, name)


def db_sink(api: Records, config: dict, spool: Path) -> DbSink:
    run = api.create_run(config)
    with Session(api.engine) as s:
        attempt = Attempt(run_id=run["id"], number=1)
        s.add(attempt)
        s.commit()
        return DbSink(api.engine, run["id"], attempt.id, spool_dir=spool)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    config = {"env": "max_digit", "loop": {"steps": args.steps, "groups_per_step": 4, "group_size": 4,
                                           "eval_every": 0}, "warm_start": {"steps": 5}, "checkpoint": {"every": 0}}
    rates = {"null": [], "db": []}
    train_s = call_s = writer_s = 0.0
    rows = 0
    with tempfile.TemporaryDirectory() as tmp:
        api = Records(Path(tmp) / "home")
        for i in range(args.repeats):
            for kind in (("null", "db") if i % 2 == 0 else ("db", "null")):
                inner = db_sink(api, config, Path(tmp) / f"spool{i}") if kind == "db" else NullSink()
                sink = Measured(inner)
                t0 = time.perf_counter()
                train(config, sink, out_dir=Path(tmp) / "out")
                elapsed = time.perf_counter() - t0
                if kind == "db":
                    inner.close()
                    assert inner.failures == 0
                    train_s, call_s, writer_s = train_s + elapsed, call_s + sink.call_s, writer_s + inner.writer_cpu_s
                    rows += len(api.metrics(inner.run_id))
                rates[kind] += sink.rates[SKIP:]
                print(f"  repeat {i + 1} {kind:4s}: median {statistics.median(sink.rates[SKIP:]):6.1f} samples/s",
                      flush=True)
    null, db = statistics.median(rates["null"]), statistics.median(rates["db"])
    print(f"null sink: {null:.1f} samples/s   db sink: {db:.1f} samples/s   overhead: {(null - db) / null * 100:+.2f}%"
          f"   ({args.repeats} repeats x {args.steps} steps each)")
    print(f"db sink CPU: engine-side calls {call_s * 1e3:.0f} ms = {call_s / train_s * 100:.2f}% of the training time,"
          f" writer thread {writer_s * 1e3:.0f} ms = {writer_s / train_s * 100:.2f}% ({rows} metric rows written)")


if __name__ == "__main__":
    main()
