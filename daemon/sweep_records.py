"""Sweeps in the records: queue one, read it (its runs with their params and scores, best first), stop, resume,
delete; and what the supervisor's sweep tick shares (a point's runs, the runs' scores)."""
from collections import defaultdict

from pydantic import ValidationError
from sqlalchemy import select, update
from sqlmodel import Session

from .db import add_event, row_dict
from .models import TERMINAL, Event, Metric, Run, Sweep, now
from .sweeps import SweepRequest, check, point_score, ranked, run_config, run_names, score, seeds_of


RUNS_PER_TICK = 200   # runs the sweeps create per daemon poll, all together: a few hundred milliseconds at most


class SweepNotFound(KeyError):
    pass


class SweepConflict(ValueError):
    """The sweep's status does not allow the request (e.g. delete a running sweep)."""


class SweepRecords:
    """Mixed into Records (daemon/records.py): uses its engine and its stop_run, resume_run and delete_run."""

    def queue_sweep(self, request: SweepRequest) -> dict:
        """Validate the space (SweepInvalid names the key and value) and record the sweep; the daemon's next poll
        creates its runs as ordinary queued runs."""
        points = check(request)
        sweep = Sweep(name=request.name, request=request.model_dump(mode="json"), points=points)
        with Session(self.engine) as s:
            s.add(sweep)
            s.commit()
            return self.get_sweep(sweep.id)

    def list_sweeps(self) -> list[dict]:
        with Session(self.engine) as s:
            return [_summary(s, row_dict(sweep)) for sweep in s.scalars(select(Sweep).order_by(Sweep.id.desc()))]

    def get_sweep(self, sweep_id: int) -> dict:
        """The sweep with its points (params, score = mean over the seeds' runs, runs) and its runs as rows (params,
        seed, status, score, their point's score), best point first; `best` = the best point's params and score."""
        with Session(self.engine) as s:
            return _summary(s, row_dict(_get(s, sweep_id)), details=True)

    def stop_sweep(self, sweep_id: int) -> dict:
        """The sweep creates no more runs; its queued runs stop at once, its active ones checkpoint and stop."""
        with Session(self.engine) as s:
            _get(s, sweep_id)
            s.execute(update(Sweep).where(Sweep.id == sweep_id, Sweep.status == "running")
                      .values(status="stopped", finished_at=now()))
            s.commit()
            runs = s.scalars(select(Run.id).where(Run.sweep_id == sweep_id, Run.status.not_in(TERMINAL))).all()
        for run_id in runs:
            try:
                self.stop_run(run_id)
            except ValueError:  # it ended meanwhile: nothing to stop
                pass
        return self.get_sweep(sweep_id)

    def resume_sweep(self, sweep_id: int) -> dict:
        """The sweep runs again: its stopped and failed runs continue from their checkpoints (not those the early
        stopping rule stopped), and the points still missing are created."""
        with Session(self.engine) as s:
            _get(s, sweep_id)
            s.execute(update(Sweep).where(Sweep.id == sweep_id, Sweep.status != "running")
                      .values(status="running", finished_at=None))
            s.commit()
            pruned = set(s.scalars(select(Event.run_id).join(Run, Run.id == Event.run_id).where(
                Run.sweep_id == sweep_id, Event.kind == "early_stopped")))
            runs = s.scalars(select(Run.id).where(Run.sweep_id == sweep_id,
                                                  Run.status.in_(("stopped", "failed", "tripped")))).all()
        for run_id in runs:
            if run_id not in pruned:
                self.resume_run(run_id)
        return self.get_sweep(sweep_id)

    def delete_sweep(self, sweep_id: int):
        """Delete a sweep that is not running, with its runs (each must have ended: SweepConflict otherwise)."""
        with Session(self.engine) as s:
            sweep = _get(s, sweep_id)
            if sweep.status == "running":
                raise SweepConflict(f"sweep {sweep_id} is running: stop it before deleting it")
            runs = s.scalars(select(Run.id).where(Run.sweep_id == sweep_id)).all()
            # every run ended, checked before any is deleted: a refusal must leave the sweep whole
            if live := s.scalars(select(Run.id).where(Run.sweep_id == sweep_id, Run.status.not_in(TERMINAL))).all():
                raise SweepConflict(f"sweep {sweep_id}: runs {list(live)} have not ended: stop them before deleting it")
        for run_id in runs:
            try:
                self.delete_run(run_id)
            except ValueError as e:
                raise SweepConflict(f"sweep {sweep_id}: {e}") from None
        with Session(self.engine) as s:
            s.delete(_get(s, sweep_id))
            s.commit()


def _get(s: Session, sweep_id: int) -> Sweep:
    sweep = s.get(Sweep, sweep_id)
    if sweep is None:
        raise SweepNotFound(f"sweep {sweep_id}")
    return sweep


def ensure_runs(s: Session, sweep: Sweep, request: SweepRequest, limit: int = RUNS_PER_TICK) -> int:
    """Create the runs its points lack, one per seed, as ordinary queued runs tagged with the sweep's name: at most
    `limit` a call, so that a large grid's runs take several polls and no poll comes near the daemon's hang limit.
    Each has the idempotency key sweep:ID:POINT:SEED, so a point's run is never created twice (a daemon killed
    between two points creates the rest after its restart). Returns how many it created (the caller commits)."""
    if limit <= 0:
        return 0
    have = set(s.scalars(select(Run.idempotency_key).where(Run.sweep_id == sweep.id)))
    created, names = 0, run_names(sweep.name, sweep.points)
    for index, params in enumerate(sweep.points):
        missing = [seed for seed in dict.fromkeys(seeds_of(request)) if f"sweep:{sweep.id}:{index}:{seed}" not in have]
        if not missing:
            continue
        # still running? (a stop committed meanwhile wins: this write waits for it, SQLite serializes them)
        if not created and not s.execute(update(Sweep).where(Sweep.id == sweep.id, Sweep.status == "running")
                                         .values(status="running")).rowcount:
            return 0
        config = run_config(request.config, params)  # once per point: each seed alone was checked at submit
        for seed in missing:
            if created >= limit:
                return created
            run = Run(name=f"{names[index]} s{seed}", tags=[sweep.name], config={**config, "seed": seed},
                      total_steps=config["loop"]["steps"], max_restarts=request.max_restarts,
                      sweep_id=sweep.id, sweep_point=index, idempotency_key=f"sweep:{sweep.id}:{index}:{seed}")
            s.add(run)
            s.flush()
            add_event(s, run.id, "queued", f"run queued by sweep {sweep.name} (point {index}, seed {seed})",
                      sweep=sweep.id, point=index, params=params)
            created += 1
    return created


def run_values(s: Session, run_ids: list[int], request: SweepRequest, up_to: int | None = None) -> dict[int, list]:
    """Each run's values of the sweep's metric in step order (only steps <= up_to, if given). An eval's value at step
    0 is the policy before any training (a warm start): not a score unless the request says score_untrained."""
    metric = request.metric
    q = select(Metric.run_id, Metric.value).where(Metric.run_id.in_(run_ids), Metric.name == metric)
    if up_to is not None:
        q = q.where(Metric.step <= up_to)
    if metric.split("/")[-1].startswith("eval_") and not request.score_untrained:
        q = q.where(Metric.step > 0)
    values = defaultdict(list)
    for run_id, value in s.execute(q.order_by(Metric.run_id, Metric.step)):
        values[run_id].append(value)
    return values


def _summary(s: Session, sweep: dict, details: bool = False) -> dict:
    try:
        request = SweepRequest.model_validate(sweep["request"])
    except ValidationError:  # stored by an older version that allowed it: still shown (its tick fails it, saying why)
        request = SweepRequest.model_construct(**sweep["request"])
    runs = [dict(r) for r in s.execute(select(Run.id, Run.name, Run.status, Run.step, Run.total_steps,
                                              Run.sweep_point, Run.config).where(Run.sweep_id == sweep["id"])
                                       .order_by(Run.id)).mappings()]
    values = run_values(s, [r["id"] for r in runs], request)
    by_point = defaultdict(list)
    for r in runs:
        r["seed"] = r.pop("config")["seed"]
        r["params"] = sweep["points"][r["sweep_point"]]
        r["score"] = score(values.get(r["id"], []), request.score, request.goal, request.last_n)
        by_point[r["sweep_point"]].append(r)
    points = ranked([{"point": i, "params": p, "score": point_score([r["score"] for r in by_point[i]]),
                      "runs": [r["id"] for r in by_point[i]]} for i, p in enumerate(sweep["points"])], request.goal)
    best = points[0] if points and points[0]["score"] is not None else None
    out = {**{k: v for k, v in sweep.items() if k not in ("judged", "points")}, "method": request.method,
           "metric": request.metric, "goal": request.goal, "runs_total": len(runs),
           "runs_done": sum(r["status"] in TERMINAL for r in runs), "warning": None,
           "best": best and {"point": best["point"], "params": best["params"], "score": best["score"]}}
    if runs and not s.scalar(select(Metric.id).where(Metric.run_id.in_([r["id"] for r in runs]),
                                                     Metric.name == request.metric).limit(1)):
        # the tick's warning (daemon/sweep_tick.py check_metric) holds while none has one
        out["warning"] = s.scalar(select(Event.message).where(Event.run_id.in_([r["id"] for r in runs]),
                                                              Event.kind == "sweep_metric_missing").limit(1))
    if details:
        order = {p["point"]: rank for rank, p in enumerate(points)}
        for r in runs:
            r["point_score"] = points[order[r["sweep_point"]]]["score"]
        out["points"] = points
        out["runs"] = sorted(runs, key=lambda r: (order[r["sweep_point"]], r["seed"]))
    return out
