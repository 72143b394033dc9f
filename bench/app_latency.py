"""E. Live latency and long-series reads of the web app.

    python bench/app_latency.py [--points 1000000] [--live-seconds 20]

1. Live: a `molt web` child process serves the data directory; a writer in this process records metrics through
   the daemon's own DbSink (the worker's code path) and, separately, by direct commits; a websocket client
   measures each metric's arrival time minus (a) the moment the worker handed it to its sink and (b) the moment it
   was committed. Prints p50 / p95 / max of both. (a) includes the sink's batching interval
   (daemon/sink.py FLUSH_EVERY_S), (b) is what the app adds.
2. Long series: a 1,000,000-point series with an injected spike; GET /metrics?max_points=2000 over HTTP, the
   first (cold) request and 20 warm ones; prints the times, the number of points returned and whether the spike
   is among them. Bar: <= 100 ms, spike kept.
"""
import argparse
import asyncio
import json
import random
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from app_common import Child, percentile

import httpx  # noqa: E402  (after app_common put the repository on sys.path)
import websockets  # noqa: E402
from sqlmodel import Session  # noqa: E402

from daemon.api import Api  # noqa: E402
from daemon.models import Attempt  # noqa: E402
from daemon.sink import DbSink  # noqa: E402


def live(home: Path, child: Child, seconds: float) -> dict:
    api = Api(home)
    run = api.create_run({"env": "max_digit"}, name="latency")
    with Session(api.engine) as s:
        attempt = Attempt(run_id=run["id"], number=1)
        s.add(attempt)
        s.commit()
        attempt_id = attempt.id
    sink = DbSink(api.engine, run["id"], attempt_id)   # the worker's sink, default flush interval
    raw = sqlite3.connect(home / "molt.db", timeout=30, check_same_thread=False)
    sink_lat, commit_lat = [], []

    async def client():
        url = child.base.replace("http", "ws") + f"/ws/runs/{run['id']}?token={child.token}"
        async with websockets.connect(url, max_size=None) as ws:
            end = time.time() + seconds + 2
            while time.time() < end:
                try:
                    message = json.loads(await asyncio.wait_for(ws.recv(), 1))
                except asyncio.TimeoutError:
                    continue
                now = time.time()
                if message["type"] == "metrics" and not message.get("backfill"):
                    for name, series in message["series"].items():
                        target = {"via_sink": sink_lat, "committed": commit_lat}.get(name)
                        if target is not None:
                            target += [now - v for v in series["value"]]

    def writer():
        step = 0
        end = time.time() + seconds
        while time.time() < end:
            sink.metrics(step, {"via_sink": time.time()})   # value: when the worker handed it over
            time.sleep(0.05)
            raw.execute("INSERT INTO metric (run_id, name, step, value, time) VALUES (?, 'committed', ?, ?, ?)",
                        (run["id"], step, time.time(), time.time()))
            raw.commit()                                       # value: (just before) the commit
            step += 1
            time.sleep(0.05 + random.random() * 0.05)          # about 10 metrics/s of each kind, unsynchronised

    async def main():
        task = asyncio.create_task(client())
        await asyncio.sleep(1)  # connected and backfilled
        await asyncio.to_thread(writer)
        await task

    asyncio.run(main())
    sink.close()
    return {"via_sink": sink_lat, "committed": commit_lat}


def long_series(home: Path, child: Child, points: int) -> dict:
    api = Api(home)
    run = api.create_run({"env": "max_digit"}, name="long")
    spike_step = random.Random(1).randrange(points)
    con = sqlite3.connect(home / "molt.db", timeout=30)
    t0 = time.time()
    rng = random.Random(0)
    con.executemany("INSERT INTO metric (run_id, name, step, value, time) VALUES (?, 'grad_norm', ?, ?, ?)",
                    ((run["id"], i, 1e4 if i == spike_step else 1 + rng.random(), t0 + i * 0.01)
                     for i in range(points)))
    con.commit()
    client = httpx.Client(base_url=child.base, headers={"Authorization": f"Bearer {child.token}"}, timeout=120)
    url = f"/api/v1/runs/{run['id']}/metrics"
    params = {"names": "grad_norm", "max_points": 2000}
    times = []
    for _ in range(21):
        start = time.perf_counter()
        body = client.get(url, params=params).json()
        times.append(time.perf_counter() - start)
    series = body["series"]["grad_norm"]
    return {"cold_s": times[0], "warm_s": times[1:], "returned": len(series["step"]),
            "spike_kept": spike_step in series["step"] and max(series["value"]) == 1e4}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--points", type=int, default=1_000_000)
    p.add_argument("--live-seconds", type=float, default=20)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        Api(home)
        child = Child("web", home)
        try:
            lat = live(home, child, a.live_seconds)
            reads = long_series(home, child, a.points)
        finally:
            child.stop()
    print("\n== E1. live latency: metric -> websocket client ==")
    for label, key in [("handed to the worker's DbSink -> client", "via_sink"),
                       ("committed to SQLite -> client", "committed")]:
        v = lat[key]
        print(f"{label:<42} n={len(v):4d}  p50 {statistics.median(v) * 1000:6.0f} ms  "
              f"p95 {percentile(v, 95) * 1000:6.0f} ms  max {max(v) * 1000:6.0f} ms")
    print(f"\n== E2. GET /metrics, {a.points:,}-point series, max_points=2000 (over HTTP) ==")
    w = reads["warm_s"]
    print(f"first request (reads the series into the cache): {reads['cold_s'] * 1000:.0f} ms")
    print(f"next 20 requests: p50 {statistics.median(w) * 1000:.1f} ms, p95 {percentile(w, 95) * 1000:.1f} ms, "
          f"max {max(w) * 1000:.1f} ms")
    print(f"points returned: {reads['returned']}; injected spike kept: {reads['spike_kept']}")


if __name__ == "__main__":
    main()
