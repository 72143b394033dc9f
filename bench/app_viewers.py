"""G. What 50 live viewers cost a training run: samples/s with 0 and with 50 websocket viewers.

    python bench/app_viewers.py [--viewers 50] [--steps 80] [--repeats 4]

One `molt serve` (real daemon, real workers). Runs of the same config alternate between no viewer and N viewers
(each a websocket client in this process that reads every message, as a browser tab would), `--repeats` times
each. Per run: the median of the engine's own samples_per_s over the steps after the first 5 (warm-up). Prints both
medians and the cost (bar: <= 5%): the median, over the pairs of neighbouring runs, of 1 - (with viewers / without).
The clients' own CPU is on this machine too, so this overstates the cost of viewers whose browsers run elsewhere.

Wall-clock throughput on a shared 2-core machine is noisy (the same config varies by tens of percent between runs),
so it also prints what noise cannot hide: the CPU time the web server process (uvicorn + the live poller) used per
second of training, with and without viewers; the difference is the viewers' cost as a share of one core.
"""
import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from app_common import FAST, Child

import httpx  # noqa: E402
import websockets  # noqa: E402

SKIP = 5


async def viewer(url: str, counts: list, index: int, done: asyncio.Event):
    async with websockets.connect(url, max_size=None) as ws:
        while not done.is_set():
            try:
                await asyncio.wait_for(ws.recv(), 0.5)
                counts[index] += 1
            except asyncio.TimeoutError:
                continue


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_run(child: Child, client: httpx.Client, config: dict, viewers: int) -> tuple[float, int, float]:
    cpu0, wall0 = cpu_seconds(child.proc.pid), time.monotonic()
    run = client.post("/api/v1/runs", json={"config": config, "name": f"viewers-{viewers}"}).json()
    url = child.base.replace("http", "ws") + f"/ws/runs/{run['id']}?token={child.token}"
    done, counts = asyncio.Event(), [0] * viewers
    tasks = [asyncio.create_task(viewer(url, counts, i, done)) for i in range(viewers)]
    while True:
        status = (await asyncio.to_thread(client.get, f"/api/v1/runs/{run['id']}/wait", params={"timeout": 30})).json()
        if status["status"] not in ("queued", "running", "restarting", "stopping"):
            break
    done.set()
    await asyncio.gather(*tasks)
    assert status["status"] == "completed", status
    rates = client.get(f"/api/v1/runs/{run['id']}/metrics", params={"names": "samples_per_s"}).json()
    values = rates["series"]["samples_per_s"]["value"][SKIP:]
    web_cpu_share = (cpu_seconds(child.proc.pid) - cpu0) / (time.monotonic() - wall0)
    return statistics.median(values), sum(counts), web_cpu_share


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--viewers", type=int, default=50)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--repeats", type=int, default=4)
    a = p.parse_args()
    config = {**FAST, "loop": {**FAST["loop"], "steps": a.steps}, "checkpoint": {"every": 0}}
    results, cpu = {0: [], a.viewers: []}, {0: [], a.viewers: []}
    with tempfile.TemporaryDirectory() as tmp:
        child = Child("serve", Path(tmp))
        client = httpx.Client(base_url=child.base, headers={"Authorization": f"Bearer {child.token}"}, timeout=60)
        try:
            order = [0, a.viewers, a.viewers, 0] * ((a.repeats + 1) // 2)
            for n in order[:2 * a.repeats]:
                started = time.monotonic()
                rate, messages, share = asyncio.run(one_run(child, client, config, n))
                results[n].append(rate)
                cpu[n].append(share)
                print(f"viewers {n:3d}: median {rate:7.1f} samples/s, web process {share * 100:4.1f}% of a core "
                      f"({messages} messages received, {time.monotonic() - started:.0f} s)", flush=True)
        finally:
            child.stop()
    base, loaded = statistics.median(results[0]), statistics.median(results[a.viewers])
    print(f"\n== G. {a.viewers} websocket viewers on a training run ==")
    print(f"no viewer:   {base:.1f} samples/s (runs: {', '.join(f'{r:.1f}' for r in results[0])})")
    print(f"{a.viewers} viewers: {loaded:.1f} samples/s (runs: {', '.join(f'{r:.1f}' for r in results[a.viewers])})")
    # each viewers run against the no-viewer run next to it (same pair of the alternation): drift over time cancels
    ratios = [v / b for b, v in zip(results[0], results[a.viewers])]
    print(f"cost: {(1 - statistics.median(ratios)) * 100:+.1f}% of samples/s, median of {len(ratios)} paired runs "
          f"({', '.join(f'{(1 - r) * 100:+.1f}%' for r in ratios)}); of the medians: {(1 - loaded / base) * 100:+.1f}% "
          f"(bar: <= 5%)")
    c0, c1 = statistics.median(cpu[0]), statistics.median(cpu[a.viewers])
    print(f"web process CPU: {c0 * 100:.1f}% of a core without viewers, {c1 * 100:.1f}% with {a.viewers}: "
          f"the viewers cost {(c1 - c0) * 100:.1f}% of one core")


if __name__ == "__main__":
    main()
