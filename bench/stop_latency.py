"""How long `molt train` takes from SIGTERM to exit (it finishes the step, writes a checkpoint, exits 0).

    python bench/stop_latency.py --repeats 3

Each repeat starts a max_digit run, waits until the progress bar shows a finished training step, sends SIGTERM and
prints the seconds until the process exited, its exit code and the step of the checkpoint it wrote.
"""
import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from molt_engine import checkpoint


def once(tmp: Path) -> tuple[float, int, int]:
    config = {"env": "max_digit", "loop": {"steps": 10_000, "groups_per_step": 4, "group_size": 4, "eval_every": 0},
              "warm_start": {"steps": 5}, "checkpoint": {"every": 0}}
    (tmp / "run.json").write_text(json.dumps(config))
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "train", "--config", str(tmp / "run.json"), "--out",
                             str(tmp / "run")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = ""
    while not re.search(r" [1-9]\d*/10000", seen):  # the progress bar shows a finished training step
        chunk = proc.stdout.read(64)
        if not chunk:
            raise SystemExit(f"molt train ended before a step:\n{seen}")
        seen += chunk
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait()
    seconds = time.monotonic() - start
    found = checkpoint.latest(tmp / "run" / "checkpoints")
    return seconds, code, torch.load(found / "state.pt", weights_only=False)["step"] if found else -1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print("| repeat | SIGTERM to exit, s | exit code | checkpoint step |")
    print("|---|---|---|---|")
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            seconds, code, step = once(Path(tmp))
        print(f"| {i} | {seconds:.2f} | {code} | {step} |", flush=True)


if __name__ == "__main__":
    main()
