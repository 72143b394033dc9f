"""Evaluation jobs: pass@k, the request and its records, the daemon's share of supervising them, and the worker."""
import argparse
import asyncio
import os
import signal
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import IO

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import create_engine, func, select, update
from sqlalchemy.dialects.sqlite import insert
from sqlalchemy.pool import NullPool
from sqlmodel import Session

from molt_engine.checkpoint import complete, resolve, step_of
from molt_engine.config import RunConfig

from .db import connect, data_home, hold_lock, lock_holder, run_dir
from .models import ACTIVE, Evaluation, Run, Sample, now

LIVE = ("running", "restarting", "stopping")    # a slot is taken: a worker lives or is about to
ENDED = ("completed", "failed", "stopped")
CONCURRENT_EPISODES = 64   # in flight at once: a kill loses at most these (16: half the episodes/s, bench/evals.py)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of a prompt of which c passed: 1 - C(n-c, k) / C(n, k), the
    chance that k of the n drawn without replacement hold at least one pass."""
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def scores(prompts: list[list[tuple[float, bool]]], k: int) -> dict:
    """pass@1, pass@k and avg@k (the mean reward of a prompt's samples), each averaged over the prompts, and the mean
    reward over all episodes, from each prompt's (reward, success) samples."""
    n_prompts, episodes = len(prompts), [e for p in prompts for e in p]
    return {"mean_reward": sum(r for r, _ in episodes) / len(episodes),
            "pass@1": sum(pass_at_k(len(p), sum(s for _, s in p), 1) for p in prompts) / n_prompts,
            f"pass@{k}": sum(pass_at_k(len(p), sum(s for _, s in p), k) for p in prompts) / n_prompts,
            f"avg@{k}": sum(sum(r for r, _ in p) / len(p) for p in prompts) / n_prompts}


class EvalInvalid(ValueError):
    """A request that names something that does not exist (a run, a checkpoint): `loc` is the field."""

    def __init__(self, loc: tuple, message: str):
        super().__init__(message)
        self.loc = loc


class EvalRequest(BaseModel):
    """The body of POST /api/v1/evals: a source (a run's checkpoint, or a model section), a target (an env with
    env_args, or a dataset file), and how to sample."""
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"examples": [
        {"run_id": 1, "checkpoint": "best", "env": "max_digit", "episodes": 64, "k": 4, "temperature": 1.0}]})
    run_id: int | None = Field(None, ge=1, le=2**62, description="the run whose checkpoint is evaluated")
    checkpoint: str | int = Field("best", description='"best", "final", "latest" or a checkpoint step')
    model: dict | None = Field(None, description="a model section (preset or path) to evaluate instead of a run")
    env: str | None = Field(None, description="the env; default: the run's")
    env_args: dict | None = Field(None, description="the env's arguments; default: the run's when its env")
    dataset: str | None = Field(None, min_length=1, description="a dataset file to evaluate on (the dataset env)")
    episodes: int = Field(64, ge=1, le=100_000, description="episodes in all: episodes / k prompts, k samples each")
    k: int = Field(1, ge=1, le=1024, description="samples per prompt (pass@k)")
    temperature: float = Field(0.0, ge=0, le=100, allow_inf_nan=False, description="0 = greedy")
    seed: int = Field(0, ge=0, lt=2**30, description="seeds the sampling")
    max_restarts: int = Field(3, ge=0, le=100, description="worker restarts after a crash")


def queue_eval(engine, home: Path, request: EvalRequest) -> dict:
    """Check the request (EvalInvalid names the field), resolve the source and the target, check them as a run
    config would be checked, and queue the evaluation."""
    if (request.run_id is None) == (request.model is None):
        raise EvalInvalid(("run_id",), "give run_id (with checkpoint) or model, not both")
    if request.k > request.episodes:
        raise EvalInvalid(("k",), f"k ({request.k}) is more than episodes ({request.episodes})")
    if request.episodes % request.k:
        raise EvalInvalid(("episodes",), f"episodes ({request.episodes}) must be a multiple of k ({request.k})")
    if request.dataset and (request.env or request.env_args):
        raise EvalInvalid(("dataset",), "give dataset or env/env_args, not both")
    step = path = None
    with Session(engine) as s:
        run = s.get(Run, request.run_id) if request.run_id else None
        if request.run_id and run is None:
            raise EvalInvalid(("run_id",), f"no run {request.run_id}")
        if run:
            path, step = policy_of(run, home, request.checkpoint)
            model = {**run.config["model"], "path": str(path)}
        else:
            model = request.model
        env = "dataset" if request.dataset else request.env or (run.config["env"] if run else None)
        if env is None:
            raise EvalInvalid(("env",), "give env (or dataset) to evaluate a model section on")
        env_args = ({"path": request.dataset} if request.dataset else request.env_args if request.env_args is not None
                    else run.config["env_args"] if run and env == run.config["env"] else {})
        try:
            cfg = RunConfig.model_validate({"env": env, "env_args": env_args, "model": model, "seed": request.seed})
        except ValidationError as e:
            error = e.errors()[0]
            raise EvalInvalid(tuple(error["loc"]) or ("env",), error["msg"]) from None
        config = {"model": cfg.model.model_dump(mode="json"), "env": env, "env_args": env_args,
                  **request.model_dump(include={"episodes", "k", "temperature", "seed"})}
        evaluation = Evaluation(run_id=request.run_id, checkpoint=str(request.checkpoint) if run else None,
                                step=step, policy_path=str(path) if path else cfg.model.path, config=config,
                                max_restarts=request.max_restarts)
        s.add(evaluation)
        s.flush()  # its id
        queued = as_dict(evaluation)
        s.commit()
        return queued


def policy_of(run: Run, home: Path, checkpoint: str | int) -> tuple[Path, int | None]:
    """The policy directory of a run's checkpoint, and the step it is from (None where unknown)."""
    out = run_dir(home, run.id)
    steps = [step_of(p) for p in complete(out / "checkpoints")]
    if isinstance(checkpoint, int) or (checkpoint.isascii() and checkpoint.isdigit()):
        if int(checkpoint) not in steps:
            raise EvalInvalid(("checkpoint",), f"run {run.id} has no checkpoint at step {checkpoint}; it has "
                                               f"{', '.join(map(str, steps)) or 'none'}")
        return resolve(out / "checkpoints", checkpoint) / "policy", int(checkpoint)
    if checkpoint == "latest":  # the one `latest` points to, as resume and rollback take
        if not (found := resolve(out / "checkpoints", "latest")):
            raise EvalInvalid(("checkpoint",), f"run {run.id} has no checkpoints")
        return found / "policy", step_of(found)
    if checkpoint in ("best", "final"):
        if not (out / checkpoint / "config.json").exists():
            raise EvalInvalid(("checkpoint",), f"run {run.id} has no {checkpoint} policy (best: written by its evals; "
                                               f"final: when it completes)")
        summary = run.summary or {}
        return out / checkpoint, summary.get("best_step") if checkpoint == "best" else summary.get("step")
    raise EvalInvalid(("checkpoint",), f'checkpoint must be "best", "final", "latest" or a step, not {checkpoint!r}')


def as_dict(e: Evaluation) -> dict:
    return {**e.model_dump(exclude={"results"}), "done": len(e.results)}


def get_eval(engine, eval_id: int) -> dict | None:
    with Session(engine) as s:
        e = s.get(Evaluation, eval_id)
        return as_dict(e) if e else None


def list_evals(engine, run_id: int | None = None, limit: int = 200) -> list[dict]:
    query = select(Evaluation).order_by(Evaluation.id.desc()).limit(limit)
    if run_id is not None:
        query = query.where(Evaluation.run_id == run_id)
    with Session(engine) as s:
        return [as_dict(e) for e in s.scalars(query)]


def stop_eval(engine, eval_id: int) -> bool:
    """A queued evaluation stops at once; a live one once the daemon has ended its worker. False: already ended."""
    with Session(engine) as s:
        for before, after in (("queued", "stopped"), ("running", "stopping"), ("restarting", "stopping")):
            values = {"status": after, **({"finished_at": now()} if after == "stopped" else {})}
            if s.execute(update(Evaluation).where(Evaluation.id == eval_id, Evaluation.status == before)
                         .values(**values)).rowcount:
                s.commit()
                return True
    return False


# ---- the daemon's share ---------------------------------------------------------------------------------------------

@dataclass
class EvalWorker:
    pid: int
    started: float                  # when started (or adopted): the first heartbeat is due FIRST_BEAT_S after
    proc: subprocess.Popen | None   # None: adopted from an earlier daemon
    log: IO | None = None
    gpus: tuple[str, ...] = ()
    term: bool = False
    hang: str | None = None         # why it was SIGKILLed as hung


class EvalWorkers:
    """The supervisor's evaluations, every poll: end the workers that exited (restart up to max_restarts, or record
    the stop), adopt or restart those an earlier daemon left, and start queued ones in the free slots and GPUs."""

    def __init__(self, supervisor):
        self.sup = supervisor
        self.workers: dict[int, EvalWorker] = {}

    def gpus(self) -> set[str]:
        return {g for w in self.workers.values() for g in w.gpus}

    def tick(self):
        from .supervisor import FIRST_BEAT_S  # here, not above: the supervisor imports this module
        engine = self.sup.engine
        with Session(engine) as s:
            for eval_id, w in list(self.workers.items()):
                status = s.scalar(select(Evaluation.status).where(Evaluation.id == eval_id))
                alive = w.proc.poll() is None if w.proc else lock_holder(eval_dir(self.sup.home, eval_id)
                                                                         / "worker.lock") is not None
                if not alive:
                    self.ended(s, eval_id, w.proc.returncode if w.proc else None)
                    continue
                beat = heartbeat_at(self.sup.home, eval_id)
                age = now() - max(beat or 0.0, w.started)
                limit = self.sup.heartbeat_timeout if beat else max(self.sup.heartbeat_timeout, FIRST_BEAT_S)
                if w.hang is None and age > limit:  # stopping or not: a hung worker would never end on SIGTERM
                    w.hang = f"hang: no heartbeat for {age:.0f}s" if beat else f"hang: no first heartbeat in {age:.0f}s"
                    _kill(w.pid, signal.SIGKILL)
                elif status == "stopping" and not w.term:
                    _kill(w.pid, signal.SIGTERM)
                    w.term = True
            for e in s.scalars(select(Evaluation).where(Evaluation.status.in_(LIVE),
                                                        Evaluation.id.not_in(list(self.workers)))).all():
                holder = lock_holder(eval_dir(self.sup.home, e.id) / "worker.lock")
                if holder and holder.isdigit():
                    gpus = tuple(filter(None, (e.gpus or "").split(",")))
                    self.workers[e.id] = EvalWorker(int(holder), now(), None, gpus=gpus)
                elif holder is None:  # its worker died with the last daemon: not its own failure
                    status = "stopped" if e.status == "stopping" else "restarting"
                    s.execute(update(Evaluation).where(Evaluation.id == e.id).values(status=status, pid=None))
            s.commit()
            runs = s.scalar(select(func.count()).where(Run.status.in_(ACTIVE)))
            free = self.sup.concurrency - runs - len(self.workers)
            waiting = s.scalars(select(Evaluation).where(Evaluation.status.in_(("restarting", "queued")))
                                .order_by(Evaluation.status != "restarting", Evaluation.id).limit(max(free, 0))).all()
            for e in waiting:
                needed = 1 if self.sup.gpus else 0
                gpus = self.sup.free_gpus()[:needed]
                if len(gpus) < needed:
                    break
                self.start(s, e, gpus)

    def ended(self, s: Session, eval_id: int, rc: int | None):
        w = self.workers.pop(eval_id)
        if w.log:
            w.log.close()
        e = s.get(Evaluation, eval_id, populate_existing=True)
        cause = w.hang or ("gone (adopted: exit status unknown)" if rc is None else
                           f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}")
        error = e.last_error if rc == 1 else f"worker {cause}"  # 1: it recorded its error
        if e.status == "stopping":
            values = {"status": "stopped", "finished_at": now()}
        elif e.status in ENDED:
            return
        elif e.restarts < e.max_restarts:
            values = {"status": "restarting", "restarts": e.restarts + 1, "last_error": error}
        else:
            values = {"status": "failed", "finished_at": now(), "last_error": error}
        s.execute(update(Evaluation).where(Evaluation.id == eval_id, Evaluation.status == e.status)
                  .values(pid=None, **values))
        s.commit()

    def start(self, s: Session, e: Evaluation, gpus: list[str]):
        if not s.execute(update(Evaluation).where(Evaluation.id == e.id, Evaluation.status == e.status).values(
                status="running", started_at=func.coalesce(Evaluation.started_at, now()),
                gpus=",".join(gpus) or None)).rowcount:
            return
        s.commit()
        directory = eval_dir(self.sup.home, e.id)
        directory.mkdir(parents=True, exist_ok=True)
        log = open(directory / "worker.log", "ab")
        (directory / "heartbeat").unlink(missing_ok=True)  # the last worker's: this one's first beat is still due
        root = str(Path(__file__).resolve().parent.parent)
        env = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", **os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        proc = subprocess.Popen([sys.executable, "-m", "daemon.evals", str(e.id), "--home", str(self.sup.home)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        s.execute(update(Evaluation).where(Evaluation.id == e.id).values(pid=proc.pid))
        s.commit()
        self.workers[e.id] = EvalWorker(proc.pid, now(), proc, log, tuple(gpus))


def _kill(pid: int, sig: int):
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def eval_dir(home: Path, eval_id: int) -> Path:
    return home / "evals" / str(eval_id)


def samples_db(directory: Path):
    """Where the episodes of a model section's evaluation are recorded, as no run holds them: the records' sample
    table (run_id 0) in a database of its own in the evaluation's directory."""
    engine = create_engine(f"sqlite:///{directory / 'samples.db'}", poolclass=NullPool, connect_args={"timeout": 30})
    Sample.__table__.create(engine, checkfirst=True)
    return engine


def heartbeat_at(home: Path, eval_id: int) -> float | None:
    """When the evaluation's worker last beat (its heartbeat file's mtime); None before its first beat."""
    try:
        return (eval_dir(home, eval_id) / "heartbeat").stat().st_mtime
    except FileNotFoundError:
        return None


# ---- the worker -----------------------------------------------------------------------------------------------------

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
        traceback.print_exc()
        with Session(engine) as s:
            s.execute(update(Evaluation).where(Evaluation.id == args.eval_id)
                      .values(last_error=f"{type(e).__name__}: {e}"[:4000]))
            s.commit()
        return 1
    finally:
        lock.close()


async def evaluate(engine, eval_id: int, directory: Path):
    from molt_engine.chat import stop_ids
    from molt_engine.envs import EVAL_SEEDS
    from molt_engine.models import load_policy
    from molt_engine.rollout import Rollout
    from molt_engine.sampler import Sampler
    from molt_engine.samples import record

    with Session(engine) as s:
        e = s.get(Evaluation, eval_id)
        c, run_id, results = e.config, e.run_id, dict(e.results)
    cfg = RunConfig.model_validate({"env": c["env"], "env_args": c["env_args"], "model": c["model"], "seed": c["seed"]})
    model, processor = load_policy(cfg.model, cfg.seed)
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
    set_results = update(Evaluation).where(Evaluation.id == eval_id)
    add_sample = insert(Sample).on_conflict_do_nothing() if own is None else insert(Sample).prefix_with("OR REPLACE")

    def save(position: int, prompt: int, ep, recorded: dict):
        sample = None
        if ep is not None:
            r = record(ep, processor, 0)
            sample = {"run_id": run_id or 0, "step": eval_id, "kind": "evaluation", "position": position,
                      "group_id": prompt, "version": 0, "time": now(),
                      **{name: r[name] for name in ("seed", "reward", "success", "turns", "tool_calls",
                                                    "tool_errors", "prompt", "text", "tokens", "images")}}
        if sample and own is not None:  # before its result: one killed in between is run again, replacing it
            with own.begin() as conn:
                conn.execute(add_sample, sample)
        with engine.begin() as conn:  # the result and a run's sample in one commit: a kill records both or neither
            conn.execute(set_results, {"results": recorded})
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
        # Off the event loop (it would hold up the sampler's steps), on one thread: the commits land in this order,
        # so the recorded results only ever grow
        await asyncio.get_running_loop().run_in_executor(writer, save, position, prompt, ep, dict(results))

    async def beat():  # from the event loop itself, as a run's worker beats: a blocked loop stops it
        while True:
            (directory / "heartbeat").touch()
            await asyncio.sleep(1.0)

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(sampler.run()), tg.create_task(beat())]
        await asyncio.gather(*(one(i) for i in range(c["episodes"]) if str(i) not in results))
        for task in tasks:
            task.cancel()
    writer.shutdown()
    with Session(engine) as s:
        s.execute(update(Evaluation).where(Evaluation.id == eval_id, Evaluation.status.in_(LIVE)).values(
            status="completed", metrics=eval_summary(results, k), finished_at=now(), pid=None))
        s.commit()


def eval_summary(results: dict, k: int) -> dict:
    """The metrics of finished episodes (position -> [reward, success, env metrics, error]): the scores, the mean
    reward's standard error, the errors, and the means of the env's own metrics over the episodes that report them."""
    ordered = [results[str(i)] for i in range(len(results))]
    prompts = [[(r[0], r[1]) for r in ordered[p:p + k]] for p in range(0, len(ordered), k)]
    reported = [r[2] for r in ordered]
    names = sorted({name for m in reported for name in m})
    rewards = [r[0] for r in ordered]
    mean = sum(rewards) / len(rewards)
    spread = sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1)  # the standard error, for comparing
    return {**scores(prompts, k), "mean_reward_se": (spread / len(rewards)) ** 0.5, "episodes": len(ordered),
            "errors": sum(r[3] is not None for r in ordered),
            **{name: sum(m[name] for m in reported if name in m) / sum(name in m for m in reported)
               for name in names}}


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
