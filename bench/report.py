"""What reporting over HTTP costs: a dashboard's ingest throughput with many external runs, and training's slowdown.

    python bench/report.py [--runs 20] [--steps-each 300] [--train-steps 40] [--repeats 1]

Starts `molt web` (a process of its own, as a dashboard is). 1) `--runs` HttpSinks report at once, each
`--steps-each` steps of 20 metrics as fast as they can: prints the metrics committed per second, all runs together,
and checks every one arrived exactly once. 2) The same short training with the daemon's DbSink and with the HttpSink
(alternating): prints the median samples/s of each and the slowdown in percent (the target is <= 2%).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from sqlalchemy import func, select  # noqa: E402
from sqlmodel import Session  # noqa: E402

from daemon.models import Attempt, Metric  # noqa: E402
from daemon.records import Records  # noqa: E402
from daemon.report import HttpSink  # noqa: E402
from daemon.sink import DbSink  # noqa: E402
from molt_engine import train  # noqa: E402

TOKEN = "bench-token"
SKIP = 5  # the first steps of a run warm up allocators and caches


def dashboard(home: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "MOLT_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "web", "--home", str(home), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=2)
            return proc
        except httpx.TransportError:
            assert proc.poll() is None and time.monotonic() < deadline, "molt web did not start"
            time.sleep(0.2)


def ingest_throughput(url: str, home: Path, tmp: Path, runs: int, steps: int) -> None:
    names = [f"m{i}" for i in range(20)]

    def report(i: int, sinks: list):
        sink = HttpSink(url, TOKEN, {"env": "max_digit"}, tmp / f"ingest-{i}")
        sinks.append(sink)
        for step in range(steps):
            sink.metrics(step, {name: step * 0.1 for name in names})
        sink.end("completed")

    sinks: list[HttpSink] = []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=report, args=(i, sinks)) for i in range(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    with Session(Records(home, migrate=False).engine) as s:
        counts = [s.scalar(select(func.count()).where(Metric.run_id == sink.run_id)) for sink in sinks]
    assert counts == [steps * len(names)] * runs, counts
    total = sum(counts)
    print(f"ingest: {runs} external runs x {steps} steps x {len(names)} metrics = {total} metrics in {elapsed:.1f} s: "
          f"{total / elapsed:,.0f} metrics/s committed, each exactly once", flush=True)


def slowdown(url: str, tmp: Path, steps: int, repeats: int) -> None:
    config = {"env": "max_digit", "loop": {"steps": steps, "groups_per_step": 4, "group_size": 4, "eval_every": 0},
              "warm_start": {"steps": 5}, "checkpoint": {"every": 0}}
    api = Records(tmp / "local-home")
    rates = {"db": [], "http": []}
    for i in range(repeats):
        for kind in (("db", "http") if i % 2 == 0 else ("http", "db")):
            if kind == "db":
                run = api.create_run(config)
                with Session(api.engine) as s:
                    attempt = Attempt(run_id=run["id"], number=1)
                    s.add(attempt)
                    s.commit()
                    sink = DbSink(api.engine, run["id"], attempt.id, spool_dir=tmp / f"spool-{i}")
            else:
                sink = HttpSink(url, TOKEN, config, tmp / f"http-{i}")
            seen = []
            metrics = sink.metrics
            sink.metrics = lambda step, values: (seen.append(values.get("samples_per_s")), metrics(step, values))
            train(config, sink, out_dir=tmp / f"out-{kind}-{i}")
            sink.end("completed") if kind == "http" else sink.close()
            rates[kind] += [r for r in seen if r is not None][SKIP:]
            print(f"  repeat {i + 1} {kind:4s}: median {statistics.median(rates[kind]):6.1f} samples/s", flush=True)
    db, http = statistics.median(rates["db"]), statistics.median(rates["http"])
    print(f"training: DbSink {db:.1f} samples/s, HttpSink {http:.1f} samples/s: slowdown {(db - http) / db * 100:+.2f}%"
          f" ({repeats} repeat(s) x {steps} steps)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--steps-each", type=int, default=300)
    p.add_argument("--train-steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        web = dashboard(tmp / "home", port)
        try:
            url = f"http://127.0.0.1:{port}"
            ingest_throughput(url, tmp / "home", tmp, args.runs, args.steps_each)
            if args.train_steps:
                slowdown(url, tmp, args.train_steps, args.repeats)
        finally:
            web.terminate()
            web.wait(30)


if __name__ == "__main__":
    main()
