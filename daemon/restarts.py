"""The restart policy: once a worker is gone, its run's next status (final, restarting after a backoff, failed)."""
import logging

from sqlalchemy import func, select
from sqlmodel import Session

from .db import add_event, finish_run, set_run
from .models import ACTIVE, Alert, Attempt, Run, now

log = logging.getLogger("molt.daemon")


def decide(s: Session, run_id: int, attempt: Attempt, cause: str, terminal: str | None, counted: bool,
           backoff: float, backoff_max: float):
    """The restart budget counts failed attempts in a row that made no new progress: an attempt that trained
    past the furthest step of all earlier attempts starts the count again. So a long run survives any number
    of isolated kills, while one that dies at the same place every time fails after max_restarts restarts."""
    error = cause + (f"\n{attempt.error}" if attempt.error and attempt.error not in cause else "")
    before = s.scalar(select(func.max(Attempt.end_step)).where(Attempt.run_id == run_id,
                                                               Attempt.number < attempt.number)) or 0
    progressed = (attempt.end_step or 0) > before
    for _ in range(5):  # each update is conditional on the status we read: if the API changed it, re-decide
        run = s.get(Run, run_id, populate_existing=True)
        t, n = now(), attempt.number
        retries = 1 if progressed else run.retries + 1
        if run.status not in ACTIVE:
            return  # the worker recorded its own end (finish_run), or the API changed the run meanwhile
        if terminal or run.status == "stopping":
            status = terminal or "stopped"
            if finish_run(s, run_id, status, cause, n, (run.status,)):
                log.info("run %d: %s", run_id, status)
                return
        elif not counted:
            if set_run(s, run_id, (run.status,), status="restarting", pid=None, next_start_at=t,
                       restarts=run.restarts + 1):
                add_event(s, run_id, "restarting", f"attempt {n} ended: {cause}; restarting now", attempt=n)
                return
        elif retries <= run.max_restarts:
            delay = min(backoff_max, backoff * 2 ** (retries - 1))
            if set_run(s, run_id, (run.status,), status="restarting", pid=None, next_start_at=t + delay,
                       retries=retries, restarts=run.restarts + 1, last_error=error):
                message = (f"attempt {n} died at step {attempt.end_step}: {cause}; restart {retries} of "
                           f"{run.max_restarts} in {delay:.1f}s from the latest checkpoint")
                s.add(Alert(run_id=run_id, kind="worker", message=message, data={"attempt": n, "cause": cause}))
                add_event(s, run_id, "restarting", message, attempt=n, delay=delay)
                log.warning("run %d: %s", run_id, message)
                return
        else:
            if set_run(s, run_id, (run.status,), status="failed", pid=None, finished_at=t, next_start_at=None,
                       retries=retries, last_error=error):
                message = (f"attempt {n} died at step {attempt.end_step}: {cause}; {run.max_restarts} restarts "
                           f"without progress used up: run failed")
                s.add(Alert(run_id=run_id, kind="worker", message=message, data={"attempt": n, "cause": cause}))
                add_event(s, run_id, "failed", message, attempt=n)
                log.error("run %d: %s", run_id, message)
                return
