"""What mirroring costs training: the same short run with all four trackers on (W&B offline, MLflow on a SQLite file,
TensorBoard, Trackio local) and with none, each through a DbSink as a daemon run has it.

    python bench/trackers.py [--steps 40] [--pairs 2]

Runs alternate on/off and their order within each pair. Prints each run's median samples/s (steps after the first
few), its CPU seconds (this process: the trackers' threads included, W&B's own service process not), the median
over pairs of the on/off ratio, what the trackers dropped (should be 0), and the CPU each tracker's thread spent
starting and sending records (per step). On a busy machine the CPU seconds are
the steadier measure: samples/s moves with other loads more than by what the trackers take.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.records import Records  # noqa: E402
from daemon.sink import DbSink  # noqa: E402
from daemon.trackers import TRACKERS, Mirror  # noqa: E402
from molt_engine import RunConfig, train  # noqa: E402

SKIP = 5  # the first steps of a run warm up allocators and caches (and the trackers start: imports, MLflow's tables)


CPU = {}  # (tracker, "start" or "records") -> CPU seconds of its thread, all runs together


def timed(name: str, cls):
    """The tracker, with the CPU time its thread spends starting it and sending records counted in CPU."""
    def count(key, method):
        def call(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                CPU[name, key] = CPU.get((name, key), 0.0) + time.thread_time() - t0
        return call
    return type(cls.__name__, (cls,), {"__init__": count("start", cls.__init__),
                                       **{m: count("records", getattr(cls, m)) for m in ("metrics", "text", "samples")}})


class Rates:
    """Forwards to the sink; keeps each step's samples/s."""

    def __init__(self, inner):
        self.inner, self.rates = inner, []

    def metrics(self, step, values):
        if "samples_per_s" in values:
            self.rates.append(values["samples_per_s"])
        self.inner.metrics(step, values)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run(config: dict, root: Path, name: str) -> tuple[float, float, int]:
    """A run's median samples/s, its CPU seconds, and the records its trackers dropped."""
    api = Records(root / "home")
    cfg = RunConfig.model_validate(config)
    db = DbSink(api.engine, api.create_run(config, name=name)["id"], 0, spool_dir=root / name)
    mirror = Mirror(db, cfg, root / name, name) if cfg.report.to else None
    measured, cpu = Rates(mirror or db), time.process_time()
    summary = train(cfg, measured, out_dir=root / name)
    if mirror:
        mirror.close(summary["status"])
    db.close()
    return statistics.median(measured.rates[SKIP:]), time.process_time() - cpu, mirror.dropped if mirror else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--pairs", type=int, default=2)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="molt-bench-trackers-"))
    os.environ.setdefault("TRACKIO_DIR", str(root / "trackio"))
    os.environ.setdefault("WANDB_SILENT", "true")
    base = {"env": "guess_number", "loop": {"steps": args.steps, "groups_per_step": 8, "group_size": 8,
                                            "max_staleness": 1, "eval_every": 10, "eval_episodes": 16},
            "warm_start": {"steps": 10}, "checkpoint": {"every": 20}}
    on = {**base, "report": {"to": ["wandb", "mlflow", "tensorboard", "trackio"], "samples_every": 5,
                             "wandb": {"mode": "offline"}, "mlflow": {"tracking_uri": f"sqlite:///{root}/mlflow.db"}}}
    for name, cls in TRACKERS.items():
        TRACKERS[name] = timed(name, cls)
    ratios = []
    for pair in range(args.pairs):
        order = [("on", on), ("off", base)] if pair % 2 == 0 else [("off", base), ("on", on)]
        rates = {}
        for kind, config in order:
            rates[kind], cpu, dropped = run(config, root, f"{kind}-{pair}")
            print(f"pair {pair} {kind:3}: median {rates[kind]:.2f} samples/s, {cpu:.1f} CPU s, {dropped} records "
                  "dropped", flush=True)
        ratios.append(rates["on"] / rates["off"])
    print(f"samples/s on/off: median ratio {statistics.median(ratios):.3f} over {args.pairs} pairs "
          f"({', '.join(f'{r:.3f}' for r in ratios)}); data in {root}")
    steps = args.pairs * args.steps
    for name in TRACKERS:  # the first start imports the tracker's package; MLflow's first creates its tables
        print(f"{name}: start {CPU.get((name, 'start'), 0) / args.pairs:.2f} CPU s per run (mean), records "
              f"{1000 * CPU.get((name, 'records'), 0) / steps:.1f} CPU ms per step")


if __name__ == "__main__":
    main()
