"""The records for the app and scripts: create, list, stop, resume and read runs (Records, with *_records.py)."""
import math
import shutil
import time
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import case, delete, func, select, text, update
from sqlmodel import Session

from molt_engine.config import RunConfig

from .daemon_records import DaemonRecords
from .db import add_event, connect, data_home, eval_dir, row_dict, run_dir, set_run
from .models import (ACTIVE, TERMINAL, Alert, Attempt, Checkpoint, Event, Metric, Evaluation, MetricBucket,
                     PolicyVersion, Run, Sample, now)
from .sample_records import SampleRecords
from .sweep_records import SweepRecords

RUN_SORTS = ("created", "status", "env", "model", "steps", "reward", "duration", "best_eval")

Tag = Annotated[str, Field(min_length=1, max_length=64, pattern=r"\S")]


class RunRequest(BaseModel):
    """A request to queue a run: the body of POST /api/v1/runs, what the launch form builds, what create_run checks.
    A pydantic ValidationError names each bad field by its path (("config", "loop", "steps"), ("tags", 0))."""
    # strict: `false` must not become 0; extra=forbid: a misspelt key is an error, not ignored
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"examples": [
        {"name": "first", "config": {"env": "max_digit", "model": {"preset": "tiny-dense"}, "loop": {"steps": 60},
                                     "seed": 0}, "tags": ["demo"]}]})
    name: str | None = Field(None, min_length=1, max_length=200, pattern=r"\S")
    config: RunConfig = Field(description="the run config (molt_engine/config.py); defaults fill the rest")
    tags: list[Tag] = Field(default_factory=list, max_length=50)
    max_restarts: int = Field(3, ge=0, le=100, description="automatic restarts from the latest checkpoint")


class RunNotFound(KeyError):
    pass


class Conflict(ValueError):
    """The run's status does not allow the request (e.g. resume a completed run)."""


class Records(SampleRecords, DaemonRecords, SweepRecords):
    """Everything the app needs, over the database in the data directory (migrated on open). The daemon need not
    run: requests are records (a queued run, a `stopping` status) that the daemon acts on within a poll interval.
    Rows come back as plain dicts; times are unix seconds; a metric value of NaN comes back as float('nan')."""

    def __init__(self, home: str | Path | None = None, migrate: bool = True):
        self.home = data_home(home)
        self.engine = connect(self.home, migrate=migrate)

    # ---- runs -----------------------------------------------------------------------------------------------------

    def create_run(self, config: dict, name: str | None = None, tags: list[str] | None = None,
                   max_restarts: int = 3) -> dict:
        """Validate (RunRequest) and queue a run. Raises pydantic's ValidationError."""
        return self.queue_run(RunRequest.model_validate({"config": config, "name": name, "tags": tags or [],
                                                         "max_restarts": max_restarts}))

    def queue_run(self, request: RunRequest) -> dict:
        cfg = request.config
        run = Run(name=(request.name or f"{cfg.env}-{time.strftime('%Y%m%d-%H%M%S')}").strip(), tags=request.tags,
                  config=cfg.model_dump(mode="json"),  # every default frozen in: later default changes never alter it
                  total_steps=cfg.loop.steps, max_restarts=request.max_restarts)
        with Session(self.engine) as s:
            s.add(run)
            s.flush()  # the id, for the event; one commit then makes both visible to the daemon together
            add_event(s, run.id, "queued", f"run queued: {run.name}")
            queued = self._run_dict(s, row_dict(run))  # as queued: the daemon may start it once committed
            s.commit()
            return queued

    def list_runs(self, status: str | list[str] | None = None, tag: str | None = None,
                  limit: int | None = None, before: int | None = None, env: str | None = None,
                  q: str | None = None, archived: bool | None = None, sort: str = "created",
                  descending: bool = True, offset: int | None = None, config: bool = True) -> list[dict]:
        """Newest first (or by `sort`, one of RUN_SORTS); with `before`, only the runs older than that run id (the
        next page). `q` matches the name, notes or a tag (case-insensitive for ASCII); `archived` None = both.
        Each run has its `env`, `model` (path, else preset) and `lora_r` (None without LoRA); `config=False` leaves
        out the rest of the config (the runs page: decoding 100 configs was most of its time)."""
        best_eval = (select(func.max(Metric.value)).where(Metric.run_id == Run.id, Metric.name == "eval_reward")
                     .scalar_subquery())  # NaN is stored as NULL: max() skips it
        keys = {"created": Run.id, "status": Run.status, "env": func.json_extract(Run.config, "$.env"),
                "model": func.coalesce(func.json_extract(Run.config, "$.model.path"),
                                       func.json_extract(Run.config, "$.model.preset")),
                "steps": Run.step, "reward": Run.reward, "duration": duration_sql(now()),
                "best_eval": best_eval}
        if sort not in keys:
            raise ValueError(f"sort must be one of {', '.join(RUN_SORTS)}, not {sort!r}")
        order = keys[sort].desc() if descending else keys[sort].asc()
        columns = [c for c in Run.__table__.columns if config or c.name != "config"]  # plain rows: no ORM objects
        q_ = (select(*columns, keys["env"].label("env"), keys["model"].label("model"),
                     func.json_extract(Run.config, "$.model.lora.r").label("lora_r"))
              .order_by(order, Run.id.desc()).limit(limit).offset(offset))
        if before is not None:
            q_ = q_.where(Run.id < before)
        if status:
            q_ = q_.where(Run.status.in_([status] if isinstance(status, str) else status))
        if tag:
            q_ = q_.where(text("EXISTS (SELECT 1 FROM json_each(run.tags) WHERE json_each.value = :tag)")
                          .bindparams(tag=tag))
        if env:
            q_ = q_.where(func.json_extract(Run.config, "$.env") == env)
        if archived is not None:
            q_ = q_.where(Run.archived == archived)
        if q:
            like = "%" + q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            q_ = q_.where(Run.name.like(like, escape="\\") | Run.notes.like(like, escape="\\") | text(
                "EXISTS (SELECT 1 FROM json_each(run.tags) WHERE json_each.value LIKE :like ESCAPE '\\')")
                .bindparams(like=like))
        with Session(self.engine) as s:
            rows = s.execute(q_).mappings().all()
            open_alerts = dict(s.execute(select(Alert.run_id, func.count()).where(~Alert.acknowledged)
                                         .group_by(Alert.run_id)).all())
            # the page's best evals in one grouped query (a subquery per row cost ~8 ms a page of 100 runs)
            best = dict(s.execute(select(Metric.run_id, func.max(Metric.value)).where(
                Metric.name == "eval_reward", Metric.run_id.in_([r["id"] for r in rows]))
                        .group_by(Metric.run_id)).all())
            attempts: dict[int, list] = {}
            for run_id, started, ended in s.execute(select(Attempt.run_id, Attempt.started_at, Attempt.ended_at).where(
                    Attempt.run_id.in_([r["id"] for r in rows])).order_by(Attempt.number)):
                attempts.setdefault(run_id, []).append((started, ended))
            return [{**self._run_dict(s, dict(r), open_alerts.get(r["id"], 0), attempts.get(r["id"], [])),
                     "best_eval": best.get(r["id"])} for r in rows]

    def run_envs(self) -> list[str]:
        """The envs of the recorded runs, for the runs list's filter."""
        with Session(self.engine) as s:
            return sorted(s.scalars(select(func.json_extract(Run.config, "$.env")).distinct()))

    def update_run(self, run_id: int, name: str | None = None, notes: str | None = None,
                   archived: bool | None = None) -> dict:
        """Rename, annotate, archive or unarchive a run (any status); a None leaves that field as it is."""
        if name is not None and not name.strip():
            raise ValueError("name must not be blank")
        with Session(self.engine) as s:
            run = self._get(s, run_id)
            for field, value in (("name", name and name.strip()), ("notes", notes), ("archived", archived)):
                if value is not None:
                    setattr(run, field, value)
            s.add(run)
            s.commit()
        return self.get_run(run_id)

    def delete_run(self, run_id: int):
        """Delete a run's records and its directory (checkpoints, final and best policies, logs), its evaluations and
        theirs. Only a run that has ended: a queued or active one may have a worker writing (Conflict: stop it)."""
        with Session(self.engine) as s:
            run, evals = self._get(s, run_id), s.scalars(select(Evaluation.id).where(Evaluation.run_id == run_id)).all()
            for model in (Metric, MetricBucket, PolicyVersion, Checkpoint, Alert, Event, Sample, Attempt, Evaluation):
                s.execute(delete(model).where(model.run_id == run_id))  # metric first: its triggers fill buckets
            # the status checked in the same statement: the daemon cannot start it between a check and the delete
            if s.execute(delete(Run).where(Run.id == run_id, Run.status.in_(TERMINAL))).rowcount == 0:
                s.rollback()
                raise Conflict(f"run {run_id} is {run.status}: stop it before deleting it")
            s.commit()
        for directory in (self.run_dir(run_id), *(eval_dir(self.home, e) for e in evals)):  # a live evaluation's
            shutil.rmtree(directory, ignore_errors=True)  # worker ends once the daemon finds its row gone

    def get_run(self, run_id: int) -> dict:
        with Session(self.engine) as s:
            best = s.scalar(select(func.max(Metric.value)).where(Metric.run_id == run_id, Metric.name == "eval_reward"))
            return {**self._run_dict(s, row_dict(self._get(s, run_id))), "best_eval": best}

    def stop_run(self, run_id: int) -> dict:
        """A queued run stops at once; a running one becomes `stopping`: the daemon sends SIGTERM, the worker
        checkpoints and exits, the run ends `stopped`. Idempotent."""
        with Session(self.engine) as s:
            run = self._get(s, run_id)
            if set_run(s, run_id, ("queued",), status="stopped", finished_at=now()):
                add_event(s, run_id, "stopped", "stopped before it started")
            elif set_run(s, run_id, ("running", "restarting", "unreachable"), status="stopping"):
                add_event(s, run_id, "stop_requested", "stop requested")
            else:
                s.refresh(run)
                if run.status not in ("stopping", "stopped"):
                    raise Conflict(f"run {run_id} is {run.status}: nothing to stop")
            s.commit()
        return self.get_run(run_id)

    def resume_run(self, run_id: int) -> dict:
        """A stopped, failed or tripped run is queued again; its next attempt continues from the latest checkpoint
        with a fresh restart budget. Idempotent for a run that is already queued or active."""
        with Session(self.engine) as s:
            run = self._get(s, run_id)
            if run.host is not None:  # its checkpoints and process are on that machine: training it here would fork it
                raise Conflict(f"run {run_id} is an external run on {run.host}: it resumes only from its own machine, "
                               "with `molt train --resume --report-to URL --out DIR` there")
            if set_run(s, run_id, ("stopped", "failed", "tripped"), status="queued", retries=0, finished_at=None,
                       next_start_at=None):
                add_event(s, run_id, "resume_requested", "resume requested: continues from the latest checkpoint")
            else:
                s.refresh(run)
                if run.status in ("completed", "stopping"):
                    raise Conflict(f"run {run_id} is {run.status}: cannot resume"
                                   + (" until it has stopped" if run.status == "stopping" else ""))
            s.commit()
        return self.get_run(run_id)

    def end_external_run(self, run_id: int, status: str) -> dict:
        """Mark an external run that no longer reports (`unreachable`, or `stopping` with no answer) `stopped` or
        `failed`: nobody else can end it, since its process is on a machine the daemon does not watch. Its open
        attempt is closed and its ingest token stops working, as at any end; `molt train --resume` goes on later."""
        if status not in ("stopped", "failed"):
            raise ValueError(f"status must be stopped or failed, not {status!r}")
        with Session(self.engine) as s:
            run = self._get(s, run_id)
            why = f"marked {status} from the dashboard: it no longer reported ({run.status})"
            if run.host is None:
                raise Conflict(f"run {run_id} is not an external run: stop it instead")
            if not set_run(s, run_id, ("unreachable", "stopping"), status=status, pid=None, finished_at=now(),
                           last_error=why if status == "failed" else run.last_error):
                raise Conflict(f"run {run_id} is {run.status}: only an unreachable or stopping external run can be "
                               "marked ended" + (" (it still reports: stop it instead)" if run.status == "running"
                                                 else ""))
            s.execute(update(Attempt).where(Attempt.run_id == run_id, Attempt.ended_at.is_(None)).values(
                ended_at=now(), cause=why, end_step=run.step))
            add_event(s, run_id, status, why)
            s.commit()
        return self.get_run(run_id)

    def wait_run(self, run_id: int, timeout: float | None = None, poll: float = 0.25) -> dict:
        """The run once it is terminal (completed, failed, stopped, tripped), or as it is when `timeout` passes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            run = self.get_run(run_id)
            if run["status"] in TERMINAL or (deadline is not None and time.monotonic() >= deadline):
                return run
            time.sleep(poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic())))

    # ---- what a run recorded --------------------------------------------------------------------------------------

    def metrics(self, run_id: int, names: list[str] | None = None, after_step: int | None = None,
                max_points: int | None = None) -> list[dict]:
        """Rows {name, step, value, time} ordered by step (then name). With max_points, each name is reduced to at
        most that many rows by `extremes` (spikes and NaN stay visible)."""
        q = select(Metric.name, Metric.step, Metric.value, Metric.time).where(Metric.run_id == run_id)
        if names:
            q = q.where(Metric.name.in_(names))
        if after_step is not None:
            q = q.where(Metric.step > after_step)
        with Session(self.engine) as s:
            self._get(s, run_id)
            rows = [{"name": n, "step": st, "value": math.nan if v is None else v, "time": t}
                    for n, st, v, t in s.execute(q.order_by(Metric.step, Metric.name))]
        if max_points:
            by_name: dict[str, list[dict]] = {}
            for r in rows:
                by_name.setdefault(r["name"], []).append(r)
            rows = sorted((series[i] for series in by_name.values()
                           for i in extremes(np.array([r["value"] for r in series]), max_points)),
                          key=lambda r: (r["step"], r["name"]))
        return rows

    def alerts(self, run_id: int, after_id: int | None = None, unacknowledged: bool = False) -> list[dict]:
        q = select(Alert).where(Alert.run_id == run_id)
        if unacknowledged:
            q = q.where(~Alert.acknowledged)
        return self._rows(run_id, q, Alert, after_id)

    def acknowledge_alert(self, run_id: int, alert_id: int) -> dict:
        with Session(self.engine) as s:
            alert = s.get(Alert, alert_id)
            if alert is None or alert.run_id != run_id:
                raise RunNotFound(f"alert {alert_id} of run {run_id}")
            alert.acknowledged = True
            s.commit()
            return row_dict(alert)  # reloaded after the commit

    def events(self, run_id: int, after_id: int | None = None, kind: str | None = None) -> list[dict]:
        query = select(Event).where(Event.run_id == run_id, *([Event.kind == kind] if kind else []))
        return self._rows(run_id, query, Event, after_id)

    def attempts(self, run_id: int) -> list[dict]:
        return self._rows(run_id, select(Attempt).where(Attempt.run_id == run_id), Attempt)

    def checkpoints(self, run_id: int) -> list[dict]:
        """Every checkpoint recorded, with `exists` (the engine keeps the newest `checkpoint.keep`; the best policy is
        in the run's best/ directory)."""
        rows = self._rows(run_id, select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step), None)
        return [{**r, "exists": Path(r["path"]).exists()} for r in rows]

    def policy_versions(self, run_id: int) -> list[dict]:
        return self._rows(run_id, select(PolicyVersion).where(PolicyVersion.run_id == run_id)
                          .order_by(PolicyVersion.version), None)

    def log_path(self, run_id: int, attempt: int | None = None) -> Path | None:
        """The log (stdout + stderr) of an attempt, by number; the latest by default."""
        q = select(Attempt.log_path).where(Attempt.run_id == run_id)
        q = q.where(Attempt.number == attempt) if attempt else q.order_by(Attempt.number.desc()).limit(1)
        with Session(self.engine) as s:
            self._get(s, run_id)
            path = s.scalars(q).first()
        return Path(path) if path else None

    def log_tail(self, run_id: int, attempt: int | None = None, max_bytes: int = 65536) -> str:
        path = self.log_path(run_id, attempt)
        if not path or not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - max_bytes))
            return f.read().decode(errors="replace")

    def run_dir(self, run_id: int) -> Path:
        return run_dir(self.home, run_id)

    # ---- helpers --------------------------------------------------------------------------------------------------

    def _get(self, s: Session, run_id: int) -> Run:
        run = s.get(Run, run_id)
        if run is None:
            raise RunNotFound(f"run {run_id}")
        return run

    def _rows(self, run_id, q, model, after_id=None) -> list[dict]:
        if model is not None:
            q = q.order_by(model.id)
            if after_id is not None:
                q = q.where(model.id > after_id)
        with Session(self.engine) as s:
            self._get(s, run_id)
            return [row_dict(r) for r in s.scalars(q)]

    def _run_dict(self, s: Session, run: dict, open_alerts: int | None = None,
                  attempts: list[tuple] | None = None) -> dict:
        """A run's row (`row_dict`) as the API shows it: its open alerts counted, its pid only while it is active, its
        duration (training_seconds), and never its ingest token's hash (a hash, but of a credential)."""
        if open_alerts is None:
            open_alerts = s.scalar(select(func.count()).where(Alert.run_id == run["id"], ~Alert.acknowledged))
        if attempts is None:
            attempts = s.execute(select(Attempt.started_at, Attempt.ended_at).where(Attempt.run_id == run["id"])
                                 .order_by(Attempt.number)).all()
        shown = {k: v for k, v in run.items() if k != "ingest_token"}
        return {**shown, "alerts_open": open_alerts, "pid": run["pid"] if run["status"] in ACTIVE else None,
                "duration_s": training_seconds(run, attempts, time.time())}


def training_seconds(run: dict, attempts: list[tuple], now: float) -> float | None:
    """A run's duration, the one every page and the API show: its attempts' own time, not the time it was queued or
    stopped between them (an attempt still open counts up to now while the run is active, else up to the run's end).
    A run with no attempt of its own (an external run): its start to its end (or now). None before it started.
    duration_sql is the same rule for sorting; the run page's clock (run.js) counts it live."""
    if attempts:
        live = run["status"] in ACTIVE
        return sum(max(0.0, (end if end is not None else now if live else run["finished_at"] or start) - start)
                   for start, end in attempts)
    return (run["finished_at"] or now) - run["started_at"] if run["started_at"] else None


def duration_sql(now_):
    """training_seconds in SQL, to sort the runs list by it."""
    end = func.coalesce(Attempt.ended_at, case((Run.status.in_(ACTIVE), now_),
                                               else_=func.coalesce(Run.finished_at, Attempt.started_at)))
    attempts = (select(func.sum(func.max(0.0, end - Attempt.started_at))).where(Attempt.run_id == Run.id)
                .scalar_subquery())
    return func.coalesce(attempts, func.coalesce(Run.finished_at, now_) - Run.started_at)


def extremes(values: np.ndarray, max_points: int | None) -> np.ndarray:
    """The indices of `values` (a series in step order) that a chart of at most `max_points` points keeps: the range
    is cut into equal buckets and each keeps its minimum and maximum (a spike never disappears) and its first NaN if
    it has one (a NaN is never averaged or dropped away). ±inf are values like any other: a max keeps +inf. Every
    index when the series is short enough."""
    n = len(values)
    if not max_points or n <= max_points:
        return np.arange(n)
    nan = np.isnan(values)
    per_bucket = 3 if nan.any() else 2
    size = math.ceil(n / max(1, max_points // per_bucket))
    buckets = math.ceil(n / size)
    pad = buckets * size - n
    # NaN is replaced so that argmin/argmax see only real values; the padding can never win (it comes last)
    low = np.concatenate([np.where(nan, np.inf, values), np.full(pad, np.inf)]).reshape(buckets, size)
    high = np.concatenate([np.where(nan, -np.inf, values), np.full(pad, -np.inf)]).reshape(buckets, size)
    offsets = np.arange(buckets) * size
    keep = [offsets + low.argmin(axis=1), offsets + high.argmax(axis=1)]
    if per_bucket == 3:
        nans = np.concatenate([nan, np.zeros(pad, bool)]).reshape(buckets, size)
        keep.append((offsets + nans.argmax(axis=1))[nans.any(axis=1)])
    return np.unique(np.concatenate(keep))
