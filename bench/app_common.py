"""Shared by bench/app_*.py: start `molt serve` or `molt web` as a child process and read the URL it prints."""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FAST = {"env": "max_digit", "loop": {"steps": 30, "groups_per_step": 4, "group_size": 4, "eval_every": 0},
        "warm_start": {"steps": 5}, "checkpoint": {"every": 5}}


class Child:
    """`molt serve|web --home HOME --port 0`; .base and .token once it prints its ready-to-click URL."""

    def __init__(self, command: str, home: Path, *args: str):
        env = {**os.environ, "MOLT_HOME": str(home), "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": str(ROOT)}
        env.pop("MOLT_TOKEN", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", command, "--home", str(home), "--port", "0",
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=ROOT)
        self.lines = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 120
        while not (m := re.search(r"Molt Studio is ready: (http://\S+)", "".join(self.lines))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("molt printed no URL:\n" + "".join(self.lines))
            time.sleep(0.05)
        url = m.group(1)
        self.base, self.token = url.split("/?")[0], url.split("token=")[1]

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(120)


def percentile(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))]
