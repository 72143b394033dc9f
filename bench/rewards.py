"""What reward terms cost the loop: (1) one extra function term on max_digit against none (samples/s), and (2) an
LLM judge that takes 500 ms a call, group size 8, against no judge: the sampler's and trainer's idle ratios, which
stay near the no-judge ones when judging overlaps sampling and training: at loop.max_staleness 1, and at
--judge-staleness, enough versions for a 500 ms call when a step takes a fraction of that.

    python bench/rewards.py [--steps 30] [--pairs 2] [--groups 8] [--judge-staleness 12]

Runs alternate within each pair. Prints each run's median samples/s and idle ratios over the steps after the first
few, and the median over pairs of the with/without samples/s ratio. The judge is a real OpenAI-compatible server on
localhost (uvicorn in a process of its own) that sleeps 500 ms and answers {"score": 1 if the answer holds a 9}.
"""
import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402

from molt_engine import train  # noqa: E402
from molt_engine.envs import load_user_envs  # noqa: E402

SKIP = 5  # the first steps warm up allocators and caches


class Rates:
    def __init__(self):
        self.steps = []

    def metrics(self, step, values):
        self.steps.append(values)

    def median(self, name):
        return statistics.median(v[name] for v in self.steps[SKIP:])

    def __getattr__(self, name):  # alert, event, checkpoint: not needed here
        return lambda *a, **k: None


def judge_server(latency_s: float) -> int:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        await asyncio.sleep(latency_s)
        score = float("9" in body["messages"][1]["content"].split("\nAnswer:\n", 1)[1])
        return {"id": "j", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": json.dumps({"score": score})}}]}
    with socket.socket() as s:  # a free port, for the server's process to bind
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A process of its own: in the trainer's, the server's requests would share its GIL and count as the loop's cost
    server = multiprocessing.get_context("fork").Process(
        target=uvicorn.run, args=(app,), kwargs={"host": "127.0.0.1", "port": port, "log_level": "warning"}, daemon=True)
    server.start()
    while True:  # up once it accepts a connection
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return port
        except ConnectionRefusedError:
            time.sleep(0.05)


def run(config: dict) -> Rates:
    rates = Rates()
    with tempfile.TemporaryDirectory() as out:
        train(config, rates, out_dir=out)
    return rates


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--groups", type=int, default=8, help="loop.groups_per_step (group size 8)")
    p.add_argument("--judge-staleness", type=int, default=12, help="loop.max_staleness of the second judged run")
    args = p.parse_args()
    terms = Path(tempfile.mkdtemp()) / "terms.py"
    terms.write_text("def length(prompt, completion, env_reward):\n    return -len(completion) / 10\n")
    os.environ["MOLT_ENVS"] = str(terms.parent)
    load_user_envs()
    base = {"env": "max_digit", "model": {"preset": "tiny-dense"}, "seed": 0, "checkpoint": {"every": 0},
            "loop": {"steps": args.steps, "groups_per_step": args.groups, "group_size": 8, "max_staleness": 1, "eval_every": 0},
            "warm_start": {"steps": 10}}
    term = {**base, "rewards": {"terms": [{"name": "length", "function": "terms:length", "weight": 0.1}]}}
    port = judge_server(0.5)
    judged = {**base, "rewards": {"terms": [{"name": "judge", "weight": 0.5, "judge": {
        "base_url": f"http://127.0.0.1:{port}/v1", "model": "judge", "timeout_s": 10}}]}}
    # The trainer waits unless a step's calls end within max_staleness steps: a call is 500 ms, a step here less
    ahead = {**judged, "loop": {**base["loop"], "max_staleness": args.judge_staleness}}
    ratios = []
    for pair in range(args.pairs):
        order = [("none", base), ("term", term), ("judge", judged), (f"judge staleness {args.judge_staleness}", ahead)]
        results = {name: run(config) for name, config in (order if pair % 2 == 0 else order[::-1])}
        for name, r in results.items():
            print(f"pair {pair} {name:18s}: samples/s {r.median('samples_per_s'):7.1f}  trainer idle "
                  f"{r.median('trainer_idle_ratio'):.2f}  sampler idle {r.median('sampler_idle_ratio'):.2f}", flush=True)
        ratios.append(results["term"].median("samples_per_s") / results["none"].median("samples_per_s"))
    print(f"one extra function term: samples/s ratio (with / without), median over pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
