"""The evaluation worker, `python -m daemon.evals ID`: runs an evaluation's missing episodes, recording each as it
ends, then its metrics."""
import argparse
import asyncio
import os
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.dialects.sqlite import insert
from sqlmodel import Session

from molt_engine.config import RunConfig
from molt_engine.scores import metric_means, scores

from .db import connect, data_home, eval_dir, hold_lock
from .eval_jobs import UNRECORDED
from .eval_records import LIVE, samples_db
from .models import EvalResult, Evaluation, Sample, now

CONCURRENT_EPISODES = 64   # in flight at once: a kill loses at most these (16: half the episodes/s, bench/evals.py)


def main(argv=None) -> int:
    """`python -m daemon.evals ID --home DIR`: run the evaluation's missing episodes, recording each as it ends."""
    p = argparse.ArgumentParser(prog="python -m daemon.evals")
    p.add_argument("eval_id", type=int)
    p.add_argument("--home")
    args = p.parse_args(argv)
    home = data_home(args.home)
    directory = eval_dir(home, args.eval_id)
    directory.mkdir(parents=True, exist_ok=True)
    lock = hold_lock(directory / "worker.lock", str(os.getpid()))
    if lock is None:
        print(f"molt eval worker: another worker holds evaluation {args.eval_id}", file=sys.stderr)
        return 75
    engine = connect(home, migrate=False)
    try:
        asyncio.run(evaluate(engine, args.eval_id, directory))
        return 0
    except Exception as e:
        try:
            traceback.print_exc()
        except OSError:  # a full disk: the database may still take the error
            pass
        try:
            with Session(engine) as s:
                s.execute(update(Evaluation).where(Evaluation.id == args.eval_id)
                          .values(last_error=f"{type(e).__name__}: {e}"[:4000]))
                s.commit()
            return 1
        except Exception:  # a full disk takes the log and the database alike: the daemon says so
            return UNRECORDED
    finally:
        lock.close()


async def evaluate(engine, eval_id: int, directory: Path):
    from molt_engine import checkpoint
    from molt_engine.chat import stop_ids
    from molt_engine.envs import EVAL_SEEDS
    from molt_engine.models import load_policy
    from molt_engine.rollout import Rollout
    from molt_engine.inference.sampler import Sampler
    from molt_engine.samples import record

    with Session(engine) as s:
        e = s.get(Evaluation, eval_id)
        c, run_id = e.config, e.run_id
        results = {str(r.position): [r.reward, r.success, r.metrics, r.error]
                   for r in s.scalars(select(EvalResult).where(EvalResult.eval_id == eval_id))}
    cfg = RunConfig.model_validate({"env": c["env"], "env_args": c["env_args"], "model": c["model"], "seed": c["seed"]})
    model, processor = load_policy(cfg.model, c.get("base_seed", cfg.seed))  # a LoRA run's base: built as it was
    if c.get("adapter"):  # a LoRA run's checkpoint: its adapter on that base
        checkpoint.load_adapter(Path(c["adapter"]), model)
    if cfg.model.lora:  # the sampler decodes with the merged weights, as in a run
        model = model.merge_and_unload()
    tokenizer = getattr(processor, "tokenizer", processor)
    stops = stop_ids(tokenizer, getattr(model, "generation_config", None))
    rollout = Rollout(cfg, processor, model.config.get_text_config().max_position_embeddings, stops)
    import torch
    sampler = Sampler(model.to(getattr(torch, cfg.model.dtype)), stop_ids=stops, pad_id=tokenizer.pad_token_id,
                      temperature=c["temperature"] or 1.0)
    k, gate, writer = c["k"], asyncio.Semaphore(CONCURRENT_EPISODES), ThreadPoolExecutor(1)
    own = samples_db(directory) if run_id is None else None  # a model section's episodes: no run holds them
    print(f"molt eval worker: evaluation {eval_id}, {len(results)} of {c['episodes']} episodes already recorded",
          flush=True)

    # Core statements compiled once, with each episode's values as parameters (building an ORM statement per episode
    # cost ten times its commit)
    add_result = insert(EvalResult).on_conflict_do_nothing()  # appended: N episodes, N small writes
    add_sample = insert(Sample).on_conflict_do_nothing() if own is None else insert(Sample).prefix_with("OR REPLACE")

    def save(position: int, prompt: int, ep, result: list):
        sample = None
        if ep is not None:
            r = record(ep, processor, 0)
            sample = {"run_id": run_id or 0, "eval_id": eval_id, "step": eval_id, "kind": "evaluation",
                      "position": position,
                      "group_id": prompt, "version": 0, "time": now(),
                      **{name: r[name] for name in ("seed", "reward", "success", "turns", "tool_calls",
                                                    "tool_errors", "prompt", "text", "tokens", "images")}}
        if sample and own is not None:  # before its result: one killed in between is run again, replacing it
            with own.begin() as conn:
                conn.execute(add_sample, sample)
        with engine.begin() as conn:  # the result and a run's sample in one commit: a kill records both or neither
            conn.execute(add_result, dict(zip(("reward", "success", "metrics", "error"), result),
                                          eval_id=eval_id, position=position))
            if sample and own is None:
                conn.execute(add_sample, sample)

    async def one(position: int):
        async with gate:  # prompt p's k samples: the env's held-out seed p, sample index j
            prompt, j = divmod(position, k)
            try:
                ep = (await rollout.episode(sampler, EVAL_SEEDS + prompt, prompt, j, greedy=c["temperature"] == 0))[0]
                result = [ep.reward, bool(ep.info["success"]), ep.info.get("metrics", {}), None]
            except Exception as error:  # an env that fails counts as a failed episode, with its error
                ep, result = None, [0.0, False, {}, f"{type(error).__name__}: {error}"[:500]]
        results[str(position)] = result
        # Off the event loop (it would hold up the sampler's steps), on one thread: the commits land in this order
        await asyncio.get_running_loop().run_in_executor(writer, save, position, prompt, ep, result)

    async def beat():
        """The heartbeat carries progress (tokens sampled, episodes recorded) and beats only when it grows: a worker
        whose episodes wait on something that never comes ends as a hung one, as a blocked event loop does."""
        beaten = None
        while True:
            progress = f"{sampler.stats['tokens']} tokens sampled, {len(results)} episodes recorded"
            if progress != beaten:
                (directory / "heartbeat").write_text(progress)
                beaten = progress
            await asyncio.sleep(1.0)

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(sampler.run()), tg.create_task(beat())]
        if rollout.server:  # an agent's requests come to a loopback OpenAI server, as in a run
            tasks.append(tg.create_task(rollout.server.serve()))
        await asyncio.gather(*(one(i) for i in range(c["episodes"]) if str(i) not in results))
        for task in tasks:
            task.cancel()
    writer.shutdown()
    with Session(engine) as s:
        s.execute(update(Evaluation).where(Evaluation.id == eval_id, Evaluation.status.in_(LIVE)).values(
            status="completed", metrics=eval_summary(results, k), finished_at=now(), pid=None))
        s.commit()


def eval_summary(results: dict, k: int) -> dict:
    """The metrics of finished episodes (position -> [reward, success, env metrics, error]): the scores (with the
    mean reward's standard error), the errors, and the means of the env's own metrics over the episodes that report
    them."""
    ordered = [results[str(i)] for i in range(len(results))]
    prompts = [[(r[0], r[1]) for r in ordered[p:p + k]] for p in range(0, len(ordered), k)]
    return {**scores(prompts, k), "episodes": len(ordered), "errors": sum(r[3] is not None for r in ordered),
            **metric_means([r[2] for r in ordered])}


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
