"""E. Live latency and long-series reads of the web app.

    python bench/app_latency.py [--points 1000000] [--live-seconds 20] [--page-rate 20] [--restarts 5]

1. Live: a `molt web` child process serves the data directory; a writer in this process records metrics through
   the daemon's own DbSink (the worker's code path) and, separately, by direct commits; a websocket client
   measures each metric's arrival time minus (a) the moment the worker handed it to its sink and (b) the moment it
   was committed. Prints p50 / p95 / max of both. (a) includes the sink's batching interval
   (daemon/sink.py FLUSH_EVERY_S), (b) is what the app adds. Measured twice: alone, then while another client
   requests the runs page (a full page of runs) `--page-rate` times a second. Bar: p95 <= 500 ms under that load.
   Then GET /wait on a run that has ended: it must answer at once, not after its timeout.
2. Long series: a 1,000,000-point series with an injected spike, NaN, +inf and -inf; GET /metrics?max_points=2000
   over HTTP: `--restarts` times, a fresh `molt web` child and its first request (cold: nothing cached in the app;
   the OS file cache is warm), then 20 more (warm). Prints the medians, the number of points returned and whether
   the spike, NaN and infinities are among them. Bar: <= 100 ms cold, all kept.
"""
import argparse
import asyncio
import json
import math
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

from daemon.records import Records  # noqa: E402
from daemon.models import Attempt  # noqa: E402
from daemon.sink import DbSink  # noqa: E402


def live(home: Path, child: Child, seconds: float, page_rate: float) -> dict:
    api = Records(home)
    run = api.create_run({"env": "max_digit"}, name=f"latency at {page_rate:g} pages/s")
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

    page_lat = []

    def pages(rate: float):
        """The runs page at a steady `rate`, each request on time whether or not the last one was slow."""
        browser = httpx.Client(base_url=child.base, headers={"Authorization": f"Bearer {child.token}"}, timeout=30)
        start = time.monotonic()
        for i in range(int(seconds * rate)):
            time.sleep(max(0.0, start + i / rate - time.monotonic()))
            sent = time.perf_counter()
            assert browser.get("/").status_code == 200
            page_lat.append(time.perf_counter() - sent)

    async def main():
        task = asyncio.create_task(client())
        await asyncio.sleep(1)  # connected and backfilled
        # 4 browsers at a quarter of the rate each: a slow page does not delay the next request
        load = [asyncio.to_thread(pages, page_rate / 4) for _ in range(4)] if page_rate else []
        await asyncio.gather(asyncio.to_thread(writer), *load)
        await task

    asyncio.run(main())
    sink.close()
    return {"via_sink": sink_lat, "committed": commit_lat, "page": page_lat}


def wait_ended(home: Path, child: Child) -> float:
    """Seconds GET /wait?timeout=20 takes on a run that has already ended."""
    run = Records(home).create_run({"env": "max_digit"}, name="ended")
    client = httpx.Client(base_url=child.base, headers={"Authorization": f"Bearer {child.token}"}, timeout=60)
    assert client.post(f"/api/v1/runs/{run['id']}/stop").json()["status"] == "stopped"  # queued: stops at once
    start = time.perf_counter()
    assert client.get(f"/api/v1/runs/{run['id']}/wait", params={"timeout": 20}).json()["status"] == "stopped"
    return time.perf_counter() - start


def long_series(home: Path, points: int, restarts: int) -> dict:
    api = Records(home)
    run = api.create_run({"env": "max_digit"}, name="long")
    rng = random.Random(1)
    spike, nan, inf, neg_inf = rng.sample(range(points), 4)
    special = {spike: 1e4, nan: None, inf: math.inf, neg_inf: -math.inf}   # None: SQLite's NULL, which means NaN
    con = sqlite3.connect(home / "molt.db", timeout=30)
    t0 = time.time()
    con.executemany("INSERT INTO metric (run_id, name, step, value, time) VALUES (?, 'grad_norm', ?, ?, ?)",
                    ((run["id"], i, special.get(i, 1 + rng.random()), t0 + i * 0.01) for i in range(points)))
    con.commit()
    url = f"/api/v1/runs/{run['id']}/metrics"
    params = {"names": "grad_norm", "max_points": 2000}
    cold, warm = [], []
    for _ in range(restarts):  # a fresh server each time: its first request finds nothing cached
        child = Child("web", home)
        try:
            client = httpx.Client(base_url=child.base, headers={"Authorization": f"Bearer {child.token}"},
                                  timeout=120)
            for i in range(21):
                start = time.perf_counter()
                body = client.get(url, params=params).json()
                (warm if i else cold).append(time.perf_counter() - start)
        finally:
            child.stop()
    series = body["series"]["grad_norm"]
    values = dict(zip(series["step"], series["value"]))
    return {"cold_s": cold, "warm_s": warm, "returned": len(series["step"]),
            "kept": {"spike": values.get(spike) == 1e4, "NaN": values.get(nan) == "NaN",
                     "+inf": values.get(inf) == "Infinity", "-inf": values.get(neg_inf) == "-Infinity"}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--points", type=int, default=1_000_000)
    p.add_argument("--live-seconds", type=float, default=20)
    p.add_argument("--page-rate", type=float, default=20, help="runs-page requests per second during part 1")
    p.add_argument("--runs", type=int, default=150, help="runs recorded before part 1 (the page shows 100)")
    p.add_argument("--restarts", type=int, default=5, help="cold requests: one per fresh server")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        api = Records(home)
        for i in range(a.runs):
            api.create_run({"env": "max_digit"}, name=f"listed {i}", tags=["bench"])
        child = Child("web", home)
        try:
            lat = {rate: live(home, child, a.live_seconds, rate) for rate in (0, a.page_rate)}
            waited = wait_ended(home, child)
        finally:
            child.stop()
        reads = long_series(home, a.points, a.restarts)
    for rate, got in lat.items():
        print(f"\n== E1. live latency: metric -> websocket client, "
              + (f"runs page requested {rate:g}x/s ==" if rate else "no other load =="))
        for label, key in [("handed to the worker's DbSink -> client", "via_sink"),
                           ("committed to SQLite -> client", "committed"), ("runs page (GET /)", "page")]:
            v = got[key]
            if v:
                print(f"{label:<42} n={len(v):4d}  p50 {statistics.median(v) * 1000:6.0f} ms  "
                      f"p95 {percentile(v, 95) * 1000:6.0f} ms  max {max(v) * 1000:6.0f} ms"
                      + ("  (bar: p95 <= 500 ms)" if rate and key != "page" else ""))
    print(f"\nGET /wait?timeout=20 on a run that has ended: {waited * 1000:.0f} ms (bar: at once, well under 20 s)")
    print(f"\n== E2. GET /metrics, {a.points:,}-point series, max_points=2000 (over HTTP) ==")
    c, w = reads["cold_s"], reads["warm_s"]
    print(f"cold (first request after a server start, x{len(c)}): median {statistics.median(c) * 1000:.1f} ms, "
          f"max {max(c) * 1000:.1f} ms (bar: <= 100 ms)  [{', '.join(f'{t * 1000:.0f}' for t in c)}]")
    print(f"warm (the next 20 requests, x{len(c)}): median {statistics.median(w) * 1000:.1f} ms, "
          f"p95 {percentile(w, 95) * 1000:.1f} ms, max {max(w) * 1000:.1f} ms")
    print(f"points returned: {reads['returned']}; kept: "
          + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in reads["kept"].items()))


if __name__ == "__main__":
    main()
