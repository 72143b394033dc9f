"""The daemon's records for the app: whether it is alive, its timeline, what an operator watches; a part of Records."""
import math

from sqlalchemy import func, select
from sqlmodel import Session

from .db import DAEMON_HANG_S, add_daemon_event, lock_holder, row_dict
from .models import OUTCOMES, STATUSES, Alert, Attempt, DaemonEvent, Metric, Run, now

LIVE_METRICS = ("reward_mean", "samples_per_s", "staleness_mean", "staleness_max")
KEEPER_LOCK = "keeper.lock"   # held by the `molt serve` that keeps the daemon alive (daemon/keeper.py)


class DaemonRecords:
    """Records' view of the daemon (it provides self.engine and self.home)."""

    def daemon_status(self) -> dict:
        """Whether a daemon owns this data directory (it holds MOLT_HOME/daemon.lock) and is alive (it touched the
        lock within DAEMON_HANG_S), its pid, the seconds since that touch, how often it went down, its latest event
        (started, stopped, start_requested, or down with the cause), whether it is `stopped` on request (none runs
        and the last one recorded its stop: nobody restarts it until a start is requested), and whether a
        `molt serve` keeps it (`kept`: it starts the daemon when asked)."""
        path = self.home / "daemon.lock"
        holder = lock_holder(path)
        age = None
        if holder is not None:
            try:
                age = max(0.0, now() - path.stat().st_mtime)
            except FileNotFoundError:  # removed while held: the daemon is going away
                holder = None
        with Session(self.engine) as s:
            last = s.scalars(select(DaemonEvent).order_by(DaemonEvent.id.desc()).limit(1)).first()
            downs = s.scalar(select(func.count()).where(DaemonEvent.kind == "down"))
        return {"running": holder is not None, "alive": age is not None and age <= DAEMON_HANG_S,
                "pid": int(holder) if holder and holder.isdigit() else None, "heartbeat_age": age,
                "restarts": downs, "last_event": row_dict(last) if last else None, "home": str(self.home),
                "stopped": holder is None and last is not None and last.kind == "stopped",
                "kept": lock_holder(self.home / KEEPER_LOCK) is not None}

    def request_daemon_start(self, by: str):
        """Ask for the daemon again after a stop: the `molt serve` that keeps it (see `kept`) starts it."""
        add_daemon_event(self.engine, "start_requested", f"start requested by {by}")

    def daemon_events(self, limit: int = 50) -> list[dict]:
        """The daemon's timeline, newest first."""
        with Session(self.engine) as s:
            return [row_dict(e) for e in s.scalars(select(DaemonEvent).order_by(DaemonEvent.id.desc()).limit(limit))]

    def overview(self) -> dict:
        """What an operator watches (the /metrics endpoint): runs per status, the daemon's restarts and the workers'
        unclean ends by cause, and per running run its step, latest reward, samples/s and staleness and its
        breaker trips."""
        with Session(self.engine) as s:
            by_status = dict(s.execute(select(Run.status, func.count()).group_by(Run.status)).all())
            daemon_downs = s.execute(select(DaemonEvent.cause, func.count()).where(DaemonEvent.kind == "down")
                                     .group_by(DaemonEvent.cause)).all()
            worker_ends = s.execute(select(Attempt.cause, func.count()).where(
                Attempt.ended_at.is_not(None), Attempt.cause.not_in(OUTCOMES)).group_by(Attempt.cause)).all()
            running = s.scalars(select(Run).where(Run.status == "running").order_by(Run.id)).all()
            latest = {r.id: {} for r in running}
            for run in running:  # one index seek per value: (run_id, name, step) is unique
                for name in LIVE_METRICS:
                    row = s.execute(select(Metric.value).where(Metric.run_id == run.id, Metric.name == name)
                                    .order_by(Metric.step.desc()).limit(1)).first()
                    if row:
                        latest[run.id][name] = math.nan if row.value is None else row.value
            trips = dict(s.execute(select(Alert.run_id, func.count()).where(Alert.kind == "breaker")
                                   .group_by(Alert.run_id)).all())
        causes: dict[str, int] = {}
        for cause, n in worker_ends:  # "ValueError: <message>" -> "ValueError": one label value per kind of end
            key = (cause or "unknown").split(":")[0][:60]
            causes[key] = causes.get(key, 0) + n
        return {"runs_by_status": {status: by_status.get(status, 0) for status in STATUSES},
                "daemon_restarts": {cause or "unknown": n for cause, n in daemon_downs},
                "worker_restarts": causes,
                "running": [{"id": r.id, "name": r.name, "step": r.step, "latest": latest[r.id],
                             "breaker_trips": trips.get(r.id, 0)} for r in running]}
