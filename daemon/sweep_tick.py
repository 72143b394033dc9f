"""The supervisor's sweep tick: create each running sweep's missing runs, ask TPE for the next point as slots free
up, stop runs clearly behind the median at their milestones, and mark a sweep completed once all its runs ended.
All state is in the database, so a daemon killed at any moment continues the sweep with no point lost or doubled."""
import logging

from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

from .db import add_event, set_run
from .models import TERMINAL, Event, Metric, Run, Sweep, now
from .sweep_records import RUNS_PER_TICK, ensure_runs, run_values
from .sweeps import SweepRequest, behind_median, point_score, score, seeds_of, suggest

log = logging.getLogger("molt.daemon")


def tick_sweeps(engine, free_slots, shutdown: set[int] = frozenset()):
    """One pass over the running sweeps; `free_slots(session)` is the supervisor's slot rule, `shutdown` the runs a
    `molt daemon stop` under way stops (ended by the daemon's shutdown, not for their own reasons: the next daemon
    resumes them, so their sweeps are not done). Each sweep's error is its own: it fails, the others go on."""
    with Session(engine) as s:
        sweep_ids = s.scalars(select(Sweep.id).where(Sweep.status == "running").order_by(Sweep.id)).all()
    budget = RUNS_PER_TICK  # runs created this poll, all sweeps together
    for sweep_id in sweep_ids:
        with Session(engine) as s:
            try:
                sweep = s.get(Sweep, sweep_id)
                request = SweepRequest.model_validate(sweep.request)  # it may no longer validate after an upgrade
                if request.method == "tpe":
                    next_point(s, sweep, request, free_slots(s), shutdown)
                if created := ensure_runs(s, sweep, request, budget):
                    s.commit()
                    budget -= created
                if request.early_stop:
                    early_stop(s, sweep, request)
                check_metric(s, sweep, request)
                finish(s, sweep, request, shutdown)
            except OperationalError:  # the database busy or locked: the next poll tries again
                raise
            except Exception as e:  # e.g. its env's file removed, Optuna refusing the space, a key already taken
                s.rollback()
                error = f"{type(e).__name__}: {e}"
                s.execute(update(Sweep).where(Sweep.id == sweep_id).values(status="failed", last_error=error,
                                                                           finished_at=now()))
                s.commit()
                log.warning("sweep %d failed: %s", sweep_id, error)


def next_point(s: Session, sweep: Sweep, request: SweepRequest, free: int, shutdown: set[int]):
    """TPE: one more point once none of the sweep's runs waits in the queue and a slot is free, so each point is
    chosen knowing the scores of those that ended before it. Appended and its runs created in one transaction."""
    if len(sweep.points) >= request.runs or free <= 0:
        return
    if s.scalar(select(Run.id).where(Run.sweep_id == sweep.id, Run.status == "queued").limit(1)) is not None:
        return
    runs = s.execute(select(Run.id, Run.sweep_point, Run.status).where(Run.sweep_id == sweep.id)).all()
    values = run_values(s, [r.id for r in runs], request)
    done = []
    for index, params in enumerate(sweep.points):
        mine = [r for r in runs if r.sweep_point == index]
        ended = mine and all(_ended(r, shutdown) for r in mine)
        scores = [score(values.get(r.id, []), request.score, request.goal, request.last_n) for r in mine]
        done.append((params, point_score(scores) if ended else None))
    point = suggest(request, done)
    # only if still running: a stop committed meanwhile wins (SQLite serializes the two writes)
    if s.execute(update(Sweep).where(Sweep.id == sweep.id, Sweep.status == "running")
                 .values(points=sweep.points + [point])).rowcount:
        s.refresh(sweep)


def _ended(run, shutdown: set[int]) -> bool:
    """Ended for its own reasons: completed, failed, stopped by the user or the median rule; not by a shutdown."""
    return run.status in TERMINAL and not (run.status == "stopped" and run.id in shutdown)


def early_stop(s: Session, sweep: Sweep, request: SweepRequest):
    """The median rule at each milestone: a run that reached it is compared with its peers (the sweep's other runs
    that reached it too), its score up to that step against the median of theirs. Each (run, milestone) is judged
    once, when enough peers have reached it; a run stopped says why in its events."""
    rule = request.early_stop
    runs = s.execute(select(Run.id, Run.step, Run.status).where(Run.sweep_id == sweep.id)).all()
    judged = list(sweep.judged)
    for step in sorted(rule.at_steps):
        reached = [r for r in runs if r.step > step]  # its record of that step is in (step = last step + 1)
        values = run_values(s, [r.id for r in reached], request, up_to=step)
        scores = {r.id: score(values.get(r.id, []), request.score, request.goal, request.last_n) for r in reached}
        for r in reached:
            key = f"{r.id}:{step}"
            peers = [v for other, v in scores.items() if other != r.id and v is not None]
            if key in judged or r.status not in ("running", "restarting") or len(peers) < rule.min_peers:
                continue
            judged.append(key)
            if scores[r.id] is None or (median := behind_median(scores[r.id], peers, request.goal,
                                                                rule.margin)) is None:
                continue
            if set_run(s, r.id, ("running", "restarting"), status="stopping"):
                add_event(s, r.id, "early_stopped", f"stopped early by sweep {sweep.name} (median rule) at step "
                          f"{step}: its {request.metric} {scores[r.id]:.4g} is behind the median {median:.4g} of "
                          f"{len(peers)} peer runs", sweep=sweep.id, step=step, score=scores[r.id], median=median)
                log.info("sweep %d: run %d stopped early at step %d", sweep.id, r.id, step)
    if len(judged) != len(sweep.judged):
        s.execute(update(Sweep).where(Sweep.id == sweep.id).values(judged=judged))
        s.commit()


def check_metric(s: Session, sweep: Sweep, request: SweepRequest):
    """A `metric` no run records (a typo, or evals off) gives no scores: TPE degenerates, early stopping never
    fires. Once a run completed or passed the first milestone with none recorded, say so, once, in that run's events
    (the sweep page shows it while it holds)."""
    runs = s.execute(select(Run.id, Run.step, Run.status).where(Run.sweep_id == sweep.id)).all()
    first = min(request.early_stop.at_steps) if request.early_stop else None
    witness = next((r.id for r in runs if r.status == "completed" or (first is not None and r.step > first)), None)
    ids = [r.id for r in runs]
    if witness is None or s.scalar(select(Metric.id).where(Metric.run_id.in_(ids), Metric.name == request.metric)
                                   .limit(1)) is not None:
        return
    if s.scalar(select(Event.id).where(Event.run_id.in_(ids), Event.kind == "sweep_metric_missing").limit(1)):
        return
    recorded = s.scalars(select(Metric.name).where(Metric.run_id.in_(ids)).distinct().limit(12)).all()
    add_event(s, witness, "sweep_metric_missing", f"sweep {sweep.name}: no run has recorded its metric "
              f"{request.metric!r}, so none has a score; recorded: {', '.join(sorted(recorded)) or 'nothing'}",
              sweep=sweep.id, metric=request.metric)
    s.commit()
    log.warning("sweep %d: no run has recorded its metric %r", sweep.id, request.metric)


def finish(s: Session, sweep: Sweep, request: SweepRequest, shutdown: set[int]):
    """Completed once every point it will have exists and all their runs have ended for their own reasons."""
    target = request.runs if request.method == "tpe" else len(sweep.points)
    runs = s.execute(select(Run.id, Run.status).where(Run.sweep_id == sweep.id)).all()
    expected = len(sweep.points) * len(set(seeds_of(request)))  # a large grid's runs are created over several polls
    if len(sweep.points) >= target and len(runs) >= expected and all(_ended(r, shutdown) for r in runs):
        s.execute(update(Sweep).where(Sweep.id == sweep.id, Sweep.status == "running")
                  .values(status="completed", finished_at=now()))
        s.commit()
