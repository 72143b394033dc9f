"""Evaluation jobs' records: the request (POST /api/v1/evals), queueing it, reading and stopping evaluations, and
where an evaluation's files and a model section's samples are kept."""
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import create_engine, func, inspect, select, update
from sqlalchemy.pool import NullPool
from sqlmodel import Session

from molt_engine.checkpoint import complete, resolve, step_of
from molt_engine.config import RunConfig

from .db import run_dir
from .models import EvalResult, Evaluation, Run, Sample, now

LIVE = ("running", "restarting", "stopping")    # a slot is taken: a worker lives or is about to
ENDED = ("completed", "failed", "stopped")


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
    temperature: float | None = Field(None, ge=0, le=100, allow_inf_nan=False, description=(
        "0 = greedy; not given: greedy with k 1, with k > 1 the run's own loop.temperature (a model section's: "
        "the default loop.temperature)"))
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
    if request.k > 1 and request.temperature == 0:  # greedy: a prompt's k samples are one reply k times (only an
        # explicit 0 is refused: left out, k > 1 samples at the run's temperature, as `molt eval --k 4` always did)
        raise EvalInvalid(("k",), f"k ({request.k}) needs a temperature above 0: at temperature 0 a prompt's "
                                  f"{request.k} samples are the same greedy reply, so pass@{request.k} would be pass@1")
    if request.dataset and (request.env or request.env_args):
        raise EvalInvalid(("dataset",), "give dataset or env/env_args, not both")
    step = path = None
    with Session(engine) as s:
        run = s.get(Run, request.run_id) if request.run_id else None
        if request.run_id and run is None:
            raise EvalInvalid(("run_id",), f"no run {request.run_id}")
        if run:
            path, step = policy_of(run, home, request.checkpoint)
            adapter = (path / "adapter_config.json").exists()  # a LoRA run's adapter: the worker loads it on its base
            model = run.config["model"] if adapter else {**run.config["model"], "path": str(path)}
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
        temperature = request.temperature
        if temperature is None:
            temperature = 0.0 if request.k == 1 else (run.config if run else cfg.model_dump())["loop"]["temperature"]
        config = {"model": cfg.model.model_dump(mode="json"), "env": env, "env_args": env_args,
                  **request.model_dump(include={"episodes", "k", "seed"}), "temperature": temperature,
                  **({"adapter": str(path), "base_seed": run.config["seed"]} if run and adapter else {})}
        evaluation = Evaluation(run_id=request.run_id, checkpoint=str(request.checkpoint) if run else None,
                                step=step, policy_path=str(path) if path else cfg.model.path, config=config,
                                max_restarts=request.max_restarts)
        s.add(evaluation)
        s.flush()  # its id
        queued = as_dict(evaluation, 0)
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
        # a full model; a LoRA run's without lora.save_merged: only its adapter
        path = out / checkpoint if (out / checkpoint / "config.json").exists() else out / checkpoint / "adapter"
        if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
            raise EvalInvalid(("checkpoint",), f"run {run.id} has no {checkpoint} policy (best: written by its evals; "
                                               f"final: when it completes)")
        summary = run.summary or {}
        return path, summary.get("best_step") if checkpoint == "best" else summary.get("step")
    raise EvalInvalid(("checkpoint",), f'checkpoint must be "best", "final", "latest" or a step, not {checkpoint!r}')


def as_dict(e: Evaluation, done: int) -> dict:
    """The evaluation with `done`, its episodes recorded so far."""
    return {**e.model_dump(), "done": done}


def recorded(s: Session, eval_ids: list[int]) -> dict[int, int]:
    """Each evaluation's recorded episodes, counted in one query."""
    return dict(s.execute(select(EvalResult.eval_id, func.count()).where(EvalResult.eval_id.in_(eval_ids))
                          .group_by(EvalResult.eval_id)).all())


def get_eval(engine, eval_id: int) -> dict | None:
    with Session(engine) as s:
        e = s.get(Evaluation, eval_id)
        return as_dict(e, recorded(s, [eval_id]).get(eval_id, 0)) if e else None


def list_evals(engine, run_id: int | None = None, limit: int = 200) -> list[dict]:
    query = select(Evaluation).order_by(Evaluation.id.desc()).limit(limit)
    if run_id is not None:
        query = query.where(Evaluation.run_id == run_id)
    with Session(engine) as s:
        evals = s.scalars(query).all()
        done = recorded(s, [e.id for e in evals])
        return [as_dict(e, done.get(e.id, 0)) for e in evals]


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


def samples_db(directory: Path):
    """Where the episodes of a model section's evaluation are recorded, as no run holds them: the records' sample
    table (run_id 0) in a database of its own in the evaluation's directory."""
    engine = create_engine(f"sqlite:///{directory / 'samples.db'}", poolclass=NullPool, connect_args={"timeout": 30})
    Sample.__table__.create(engine, checkfirst=True)
    with engine.begin() as conn:  # made before samples had eval_id (migration 0010_eval_samples): all its own
        if "eval_id" not in {c["name"] for c in inspect(conn).get_columns("sample")}:
            conn.exec_driver_sql("ALTER TABLE sample ADD COLUMN eval_id INTEGER")
            conn.execute(update(Sample).values(eval_id=Sample.step))
    return engine
