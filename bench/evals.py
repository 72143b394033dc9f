"""Evaluation throughput: an evaluation job (the daemon's worker code) against the in-run eval, on the same policy.

    python bench/evals.py [--episodes 64] [--repeats 3] [--env max_digit]

One policy (the tiny preset from seed 0, saved as a run's best/ is), evaluated greedily on the same held-out seeds by
1) the evaluation job: `daemon.evals.evaluate`, what `python -m daemon.evals ID` runs, in this process (so without
the process start and the imports): it loads the policy, keeps CONCURRENT_EPISODES episodes in flight and commits
each episode with its sample to SQLite; 2) the in-run eval: `Training.evaluate`, the engine's periodic eval, all
episodes at once on its own sampler (its setup, like loading the policy, is not timed). Both at the run's torch
threads (loop.threads), alternating, `--repeats` times each in this one process: prints each repeat's episodes/s,
the medians and the job's median over the in-run eval's.
"""
import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest.mock import patch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from sqlalchemy import update  # noqa: E402

from daemon.db import eval_dir, run_dir, set_run  # noqa: E402
from daemon import evals  # noqa: E402
from daemon.eval_records import EvalRequest, get_eval, queue_eval  # noqa: E402
from daemon.evals import evaluate  # noqa: E402
from daemon.models import Evaluation  # noqa: E402
from daemon.records import Records  # noqa: E402
from molt_engine.config import RunConfig  # noqa: E402
from molt_engine.loop import Training  # noqa: E402
from molt_engine.models import load_policy  # noqa: E402
from molt_engine.inference.sampler import Sampler  # noqa: E402
from molt_engine.sink import NullSink  # noqa: E402


def policy_run(records: Records, env: str) -> tuple[int, Path]:
    """A completed run whose best/ is the tiny preset from seed 0: the policy both evaluate."""
    config = {"env": env, "loop": {"steps": 1}}
    run = records.create_run(config, name="bench-policy")
    best = run_dir(records.home, run["id"]) / "best"
    model, tokenizer = load_policy(RunConfig.model_validate(config).model, 0)
    model.save_pretrained(best)
    tokenizer.save_pretrained(best)
    with records.engine.begin() as conn:
        set_run(conn, run["id"], status="completed", summary={"best_step": 0})
    return run["id"], best


decode = Sampler.run


def job(records: Records, run_id: int, env: str, episodes: int) -> tuple[float, float]:
    """One evaluation job of the run's best policy, greedy: its episodes/s from its start (the policy's load) to its
    last record, and from its first episode's start (as the in-run eval is timed) to its last record."""
    request = EvalRequest(run_id=run_id, checkpoint="best", env=env, episodes=episodes, k=1, temperature=0.0)
    eval_id = queue_eval(records.engine, records.home, request)["id"]
    with records.engine.begin() as conn:  # as the daemon marks it when it starts its worker
        conn.execute(update(Evaluation).where(Evaluation.id == eval_id).values(status="running"))
    eval_dir(records.home, eval_id).mkdir(parents=True)
    decoding = []  # when its episodes start: its sampler's start, after the policy is loaded

    async def run(sampler):
        decoding.append(time.perf_counter())
        return await decode(sampler)

    t0 = time.perf_counter()
    with patch.object(Sampler, "run", run):
        asyncio.run(evaluate(records.engine, eval_id, eval_dir(records.home, eval_id)))
    t1 = time.perf_counter()
    done = get_eval(records.engine, eval_id)
    assert done["status"] == "completed" and done["metrics"]["episodes"] == episodes, done
    return episodes / (t1 - t0), episodes / (t1 - decoding[0])


def in_run(best: Path, env: str, episodes: int) -> float:
    """The engine's in-run eval of the same policy (greedy, the same held-out seeds): its episodes/s."""
    cfg = RunConfig.model_validate({"env": env, "model": {"path": str(best)}, "warm_start": {"steps": 0},
                                    "loop": {"steps": 1, "eval_every": 1, "eval_episodes": episodes}})
    training = Training(cfg, NullSink())

    async def timed() -> float:
        await training.prepare(resume=False)
        t0 = time.perf_counter()
        await training.evaluate(0)
        return time.perf_counter() - t0

    seconds = asyncio.run(timed())
    assert "eval_reward" in training.summary, "the in-run eval recorded no episode"
    return episodes / seconds


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--env", default="max_digit")
    p.add_argument("--in-flight", type=int, default=evals.CONCURRENT_EPISODES,
                   help="the job's episodes in flight at once (default: the worker's, CONCURRENT_EPISODES)")
    a = p.parse_args(argv)
    evals.CONCURRENT_EPISODES = a.in_flight
    threads = 1  # a run decodes its evals on one thread (Training keeps every thread but the updates' at one)
    with tempfile.TemporaryDirectory() as home:
        records = Records(home)
        run_id, best = policy_run(records, a.env)
        rates = {"job": [], "job_episodes": [], "in_run": []}
        for repeat in range(a.repeats):
            torch.set_num_threads(threads)  # the run's eval thread has one; the job the same, for a like pair
            whole, episodes_only = job(records, run_id, a.env, a.episodes)
            rates["job"].append(whole)
            rates["job_episodes"].append(episodes_only)
            rates["in_run"].append(in_run(best, a.env, a.episodes))
            print(f"repeat {repeat + 1}: job {whole:.1f} episodes/s ({episodes_only:.1f} from its first episode), "
                  f"in-run eval {rates['in_run'][-1]:.1f} episodes/s", flush=True)
        records.engine.dispose()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    result = {"episodes": a.episodes, "repeats": a.repeats, "threads": threads, "in_flight": a.in_flight, **medians,
              "ratio": medians["job"] / medians["in_run"],
              "ratio_episodes": medians["job_episodes"] / medians["in_run"], "load": os.getloadavg()}
    print(f"{a.env}, {a.episodes} greedy episodes, {a.in_flight} in flight, torch threads {threads}, load average "
          f"{' '.join(f'{x:.2f}' for x in result['load'])}; medians of {a.repeats}: job {result['job']:.1f} "
          f"episodes/s ({result['job_episodes']:.1f} from its first episode), in-run eval {result['in_run']:.1f} "
          f"episodes/s; job / in-run = {result['ratio']:.2f} ({result['ratio_episodes']:.2f})")
    return result


if __name__ == "__main__":
    main()
