"""The daemon: starts queued runs as worker processes, watches heartbeats and exits, restarts, reconciles."""
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from sqlalchemy import func, select, update
from sqlmodel import Session

from .eval_jobs import EvalWorkers
from .db import FIRST_BEAT_S, add_daemon_event, add_event, connect, data_home, hold_lock, lock_holder, run_dir, set_run
from .models import ACTIVE, OUTCOMES, Attempt, Run, now
from .restarts import decide
from .sink import replay_spools
from .slots import TINKER, free_gpus, runs_held, turn
from .sweep_tick import tick_sweeps
from .worker import DUPLICATE

log = logging.getLogger("molt.daemon")
ROOT = Path(__file__).resolve().parent.parent   # on the workers' PYTHONPATH: they run this same code
INTERRUPTED = "interrupted.json"   # runs stopped together with their daemon: the next daemon resumes them


class DaemonRunning(RuntimeError):
    pass


@dataclass
class Worker:
    run_id: int
    attempt_id: int
    number: int
    pid: int
    started: float
    proc: subprocess.Popen | None   # None: adopted from an earlier daemon, so not our child (no exit code)
    log: IO | None = None
    term_at: float | None = None    # when we sent SIGTERM for a stop
    killed: bool = False
    hang: bool = False
    gpus: tuple[str, ...] = ()      # the GPU ids it was given (its CUDA_VISIBLE_DEVICES)


class Supervisor:
    """One per data directory (MOLT_HOME/daemon.lock). Every poll: watch the workers (exit, heartbeat, stop
    requests), reconcile runs marked active that have no worker here (adopt a live one, else restart), start due
    restarts and queued runs up to `concurrency` and while the GPUs they ask for are free. All state is in the
    database; this object only caches the workers it watches, so a daemon killed at any moment is replaced by a new
    one without losing anything."""

    def __init__(self, home: str | Path | None = None, *, concurrency: int = 1, heartbeat_timeout: float = 60.0,
                 poll: float = 0.5, backoff: float = 2.0, backoff_max: float = 60.0, stop_grace: float = 120.0,
                 gpus: list[str] | None = None, ray: str | None = None):
        self.home, self.ray = data_home(home), ray  # ray: a cluster's address, where the workers place their runs
        self.gpus = list(visible_gpus() if gpus is None else gpus)  # ids as CUDA_VISIBLE_DEVICES names them
        self.concurrency, self.heartbeat_timeout, self.poll = concurrency, heartbeat_timeout, poll
        self.backoff, self.backoff_max, self.stop_grace = backoff, backoff_max, stop_grace
        self.workers: dict[int, Worker] = {}
        self.evals = EvalWorkers(self)  # evaluation jobs share the slots and GPUs
        self.engine = None

    def run(self, stop: threading.Event | None = None):
        """Supervise until `stop` is set. Workers keep running when the daemon exits; the next daemon adopts them."""
        stop = stop or threading.Event()
        self.home.mkdir(parents=True, exist_ok=True)
        # Retry for a moment: whoever asks whether a daemon runs (the web, every half second) holds the lock briefly.
        deadline = time.monotonic() + 1.0
        while (lock := hold_lock(self.home / "daemon.lock", str(os.getpid()))) is None:
            if time.monotonic() > deadline:
                raise DaemonRunning(f"a daemon (pid {lock_holder(self.home / 'daemon.lock')}) already owns "
                                    f"{self.home}")
            time.sleep(0.05)
        try:
            self.engine = connect(self.home)
            add_daemon_event(self.engine, "started", f"daemon started (pid {os.getpid()})", pid=os.getpid())
            log.info("daemon pid %d on %s: concurrency %d, heartbeat timeout %.0fs, GPUs: %s", os.getpid(),
                     self.home, self.concurrency, self.heartbeat_timeout, ",".join(self.gpus) or "none")
            self.resume_interrupted()
            while not stop.is_set():
                try:
                    self.tick()
                except Exception:  # e.g. a database error: log it and try again next poll, never die of it
                    log.exception("supervisor tick failed")
                os.utime(lock.fileno())  # the daemon's heartbeat: see DAEMON_HANG_S
                stop.wait(self.poll)
            if self.workers:
                log.info("leaving %d worker(s) running; the next daemon adopts them", len(self.workers))
            add_daemon_event(self.engine, "stopped", f"daemon stopped (pid {os.getpid()})", pid=os.getpid())
        finally:
            for w in self.workers.values():
                if w.log:
                    w.log.close()
            lock.close()

    def resume_interrupted(self):
        """Runs stopped together with the last daemon (`molt daemon stop`, Ctrl-C of `molt serve`) continue now."""
        path = self.home / INTERRUPTED
        if not path.exists():
            return
        with Session(self.engine) as s:
            for run_id in json.loads(path.read_text() or "[]"):
                if set_run(s, run_id, ("stopped",), status="queued", retries=0, finished_at=None,
                           next_start_at=None):
                    add_event(s, run_id, "resume_requested", "resumed: it was stopped with the last daemon")
                    log.info("resuming run %d, stopped with the last daemon", run_id)
            s.commit()
        path.unlink()

    def tick(self):
        self.watch()
        self.reconcile()
        self.start_due()
        self.evals.tick()
        self.watch_external()
        path = self.home / INTERRUPTED  # runs stopped by a `molt daemon stop` under way: their sweeps are not done
        shutdown = set(json.loads(path.read_text() or "[]")) if path.exists() else set()
        tick_sweeps(self.engine, self.free_slots, shutdown)  # last: a sweep's new runs start next poll

    def watch_external(self):
        """External runs (`molt train --report-to`) are never started, restarted or failed here: one whose heartbeats
        stop for heartbeat_timeout is `unreachable`; the ingest endpoint makes it running again when they resume."""
        beat = func.max(func.coalesce(Attempt.heartbeat_at, Attempt.started_at))
        with Session(self.engine) as s:
            stale = s.scalars(select(Run.id).join(Attempt, Attempt.run_id == Run.id).where(
                Run.host.is_not(None), Run.status == "running").group_by(Run.id)
                .having(beat < now() - self.heartbeat_timeout)).all()
            for run_id in stale:
                if set_run(s, run_id, ("running",), status="unreachable"):
                    add_event(s, run_id, "unreachable", f"no heartbeat for {self.heartbeat_timeout:.0f}s: "
                              "unreachable (running again when it reports again)")
                    log.warning("external run %d: unreachable", run_id)
            s.commit()

    # ---- watching -------------------------------------------------------------------------------------------------

    def watch(self):
        for w in list(self.workers.values()):
            rc = w.proc.poll() if w.proc is not None else None  # None: not our child (adopted), or still running
            if rc is not None or (w.proc is None and not self.worker_alive(w.run_id, w.pid)):
                self.end_attempt(w.run_id, w.attempt_id, rc, hang=w.hang)
                continue
            with Session(self.engine) as s:
                status = s.scalar(select(Run.status).where(Run.id == w.run_id))
                beat = s.scalar(select(Attempt.heartbeat_at).where(Attempt.id == w.attempt_id))
            t = now()
            limit = self.heartbeat_timeout if beat else max(self.heartbeat_timeout, FIRST_BEAT_S)
            if status == "stopping":
                if w.term_at is None:
                    log.info("run %d: stop requested, SIGTERM to worker %d", w.run_id, w.pid)
                    self.signal(w, signal.SIGTERM)
                    w.term_at = t
                elif t - w.term_at > self.stop_grace and not w.killed:
                    log.warning("run %d: worker %d did not stop within %.0fs: SIGKILL", w.run_id, w.pid,
                                self.stop_grace)
                    self.signal(w, signal.SIGKILL)
            elif not w.hang and t - max(beat or 0.0, w.started) > limit:
                log.warning("run %d: no heartbeat from worker %d for %.0fs: hung, SIGKILL", w.run_id, w.pid,
                            t - max(beat or 0.0, w.started))
                w.hang = True
                self.signal(w, signal.SIGKILL)

    def signal(self, w: Worker, sig: int):
        # The worker leads its own process group (start_new_session): the group takes any helpers it started too.
        try:
            os.killpg(w.pid, sig)
        except ProcessLookupError:
            pass
        w.killed |= sig == signal.SIGKILL

    def worker_alive(self, run_id: int, pid: int | None = None) -> bool:
        holder = lock_holder(run_dir(self.home, run_id) / "worker.lock")
        return holder is not None and (pid is None or holder.split(" ")[0] in ("", str(pid)))

    def end_attempt(self, run_id: int, attempt_id: int, rc: int | None, hang: bool = False, lost: bool = False):
        """A worker is gone (rc: its exit status; None if it was not our child). Record why, then decide the run's
        next status: its final one, `restarting` after a backoff, or `failed` past max_restarts."""
        w = self.workers.pop(run_id, None)
        if w and w.log:
            w.log.close()
        replay_spools(self.engine, run_id, run_dir(self.home, run_id))  # what it reported but never committed
        # A worker placed on Ray removes its attempt file (the ingest token inside) as it ends: not if SIGKILLed
        (run_dir(self.home, run_id) / f"attempt-{attempt_id}.json").unlink(missing_ok=True)
        sig = signal.Signals(-rc).name if rc is not None and rc < 0 else None
        with Session(self.engine) as s:
            attempt = s.get(Attempt, attempt_id)
            outcome, terminal, counted = attempt.outcome, None, True
            if rc == DUPLICATE:
                # It found another live worker of this run and never started; reconcile() adopts that one.
                cause, counted = "duplicate: another worker of this run was alive", False
            elif hang:
                cause = "hang"
            elif outcome in OUTCOMES:  # recorded last, after everything else: a kill during teardown changes nothing
                terminal = cause = outcome
            elif outcome == "error":
                cause = attempt.cause or f"exit code {rc}"
            elif sig:
                cause = sig
            elif rc is None:
                cause = ("lost: no live worker found when the daemon started" if lost
                         else "exited while adopted (exit status unknown)")
                counted = not lost  # the daemon's crash, not the run's fault
            else:
                cause = f"exit code {rc}"
            end_step = s.scalar(select(Run.step).where(Run.id == run_id))
            ended_at = func.coalesce(Attempt.ended_at, now())  # the worker's own record of its end, if it made one
            s.execute(update(Attempt).where(Attempt.id == attempt_id).values(
                ended_at=ended_at, exit_code=rc, signal=sig, cause=cause, end_step=end_step))
            s.execute(update(Run).where(Run.id == run_id).values(ingest_token=None))  # its rank 0's on Ray, if any
            s.commit()
            attempt.end_step = end_step
            if rc != DUPLICATE:
                decide(s, run_id, attempt, cause, terminal, counted, self.backoff, self.backoff_max)
            s.commit()

    # ---- reconciling ----------------------------------------------------------------------------------------------

    def reconcile(self):
        """Runs marked active without a worker here: after a daemon restart (or anything unexpected). A live worker
        is adopted, never duplicated; a dead one's open attempt is closed and the run continues or ends."""
        with Session(self.engine) as s:
            runs = s.scalars(select(Run).where(Run.status.in_(ACTIVE), Run.id.not_in(list(self.workers)),
                                               Run.host.is_(None))).all()  # external runs have no worker here
            for run in runs:
                holder = lock_holder(run_dir(self.home, run.id) / "worker.lock")
                open_attempts = s.scalars(select(Attempt).where(Attempt.run_id == run.id, Attempt.ended_at.is_(None))
                                          .order_by(Attempt.number)).all()
                if holder is not None:
                    self.adopt(s, run, holder, open_attempts)
                    continue
                for attempt in open_attempts:
                    log.info("run %d: attempt %d has no live worker", run.id, attempt.number)
                    self.end_attempt(run.id, attempt.id, None, lost=True)
                s.expire_all()
                run = s.get(Run, run.id)
                if run.status == "stopping":
                    set_run(s, run.id, ("stopping",), status="stopped", pid=None, finished_at=now())
                elif run.status == "running":  # no open attempt at all (e.g. killed right after marking it)
                    set_run(s, run.id, ("running",), status="restarting", pid=None, next_start_at=now())
                s.commit()

    def adopt(self, s: Session, run: Run, holder: str, open_attempts: list[Attempt]):
        pid_text, _, attempt_text = holder.partition(" ")
        if not pid_text.isdigit() or not attempt_text.isdigit():
            return  # it is writing the lock file right now; look again next poll
        attempt = s.get(Attempt, int(attempt_text))
        for other in open_attempts:
            if other.id != attempt.id:
                self.end_attempt(run.id, other.id, None, lost=True)
        pid = int(pid_text)
        self.workers[run.id] = Worker(run.id, attempt.id, attempt.number, pid, attempt.started_at, proc=None,
                                      gpus=tuple(filter(None, (run.gpus or "").split(","))))
        set_run(s, run.id, ("restarting",), status="running")
        s.execute(update(Run).where(Run.id == run.id).values(pid=pid))
        add_event(s, run.id, "adopted", f"daemon adopted the live worker of attempt {attempt.number} (pid {pid})",
               attempt=attempt.number, pid=pid)
        s.commit()
        log.info("run %d: adopted live worker pid %d (attempt %d)", run.id, pid, attempt.number)

    # ---- starting -------------------------------------------------------------------------------------------------

    def start_due(self):
        """Due restarts, then queued runs in order, each once the GPUs it asks for are free: a queued run that must
        wait holds back the ones after it, so a large run is never starved by small ones."""
        with Session(self.engine) as s:
            due = s.scalars(select(Run).where(Run.status == "restarting", Run.next_start_at <= now(),
                                              Run.host.is_(None), Run.id.not_in(list(self.workers)))
                            .order_by(Run.id)).all()
            for run in due:
                if not self.refused(s, run, "restarting") and self.gpus_needed(run) <= len(self.free_gpus(s, run)):
                    self.start(s, run)
            # The first free waiting runs, in id order: a Tinker client among them is the web process's to start
            # (app/tinker), its slot kept for it; an external run is never started here (it resumes on its machine).
            for run_id, host in turn(s, self.concurrency - runs_held(s) - len(self.evals.workers)):
                run = s.get(Run, run_id)
                if host is not None or self.refused(s, run, "queued"):
                    continue
                if self.gpus_needed(run) > len(self.free_gpus(s, run)):
                    break
                self.start(s, run)

    def free_slots(self, s: Session) -> int:
        """The slot rule, for runs and evaluations alike: `concurrency` workers at once, a slot per active run of this
        daemon, per Tinker training client (active, or waiting whose turn has come: the web process starts it) and
        per evaluation worker. Other external runs hold none: they train elsewhere (one whose process died must not
        block this daemon's work)."""
        free = self.concurrency - runs_held(s) - len(self.evals.workers)
        return free - sum(host is not None for _, host in turn(s, free))

    def refused(self, s: Session, run: Run, status: str) -> bool:
        """A run that could never start on this daemon (e.g. a restart after the daemon came back without its Ray
        cluster or with fewer GPUs) fails at once, saying why, instead of waiting forever or starting wrongly."""
        needed, nnodes = self.gpus_needed(run), (run.config.get("dist") or {}).get("nnodes", 1)
        if nnodes > 1 and not self.ray:
            message = f"dist.nnodes is {nnodes} but this daemon has no Ray cluster (see molt daemon --ray)"
        elif needed > len(self.gpus):
            message = (f"resources.gpus is {needed} but this daemon has {len(self.gpus)} GPU(s) "
                       f"({','.join(self.gpus) or 'none'}; see molt daemon --gpus)")
        else:
            return False
        if set_run(s, run.id, (status,), status="failed", finished_at=now(), last_error=message):
            add_event(s, run.id, "failed", message)
        s.commit()
        return True

    def gpus_needed(self, run: Run) -> int:
        """The run's `resources.gpus`; by default one per rank (`dist.nproc`) where this daemon has GPUs, else 0.
        None of this machine's with Ray: the cluster gives its own."""
        if self.ray:
            return 0
        asked = (run.config.get("resources") or {}).get("gpus")
        return ((run.config.get("dist") or {}).get("nproc", 1) if self.gpus else 0) if asked is None else asked

    def free_gpus(self, s: Session, run: Run | None = None) -> list[str]:
        """The GPUs free for `run` (None: an evaluation) by the records and this daemon's workers (slots.free_gpus),
        less the first of them, one each, for the Tinker clients ahead of it in the line whose turn has come: the web
        process gives them those (app/tinker/service.py), so the two processes never take the same GPU."""
        held = {g for w in self.workers.values() for g in w.gpus} | self.evals.gpus()
        free = free_gpus(s, self.gpus, held, but=run.id if run else None)
        if not free or run is not None and run.status == "restarting":  # restarts go before the line
            return free
        ahead = [i for i, host in turn(s, self.concurrency - runs_held(s) - len(self.evals.workers))
                 if host == TINKER and (run is None or i < run.id)]
        return free[len(ahead):]

    def start(self, s: Session, run: Run):
        """Mark the run running, record the attempt, then start the worker (in this order: a daemon killed in
        between leaves an open attempt that reconcile() closes; never a worker nobody knows about)."""
        t = now()
        gpus = self.free_gpus(s, run)[:self.gpus_needed(run)]
        if not set_run(s, run.id, (run.status,), status="running", next_start_at=None, finished_at=None,
                       started_at=func.coalesce(Run.started_at, t), gpus=",".join(gpus) or None):
            return  # the API changed it meanwhile (stopped)
        number = (s.scalar(select(func.max(Attempt.number)).where(Attempt.run_id == run.id)) or 0) + 1
        directory = run_dir(self.home, run.id)
        directory.mkdir(parents=True, exist_ok=True)
        log_path = directory / f"attempt-{number}.log"
        attempt = Attempt(run_id=run.id, number=number, started_at=t, log_path=str(log_path))
        s.add(attempt)
        s.commit()
        cmd = [sys.executable, "-m", "daemon.worker", str(run.id), "--attempt", str(attempt.id),
               "--home", str(self.home)]
        env = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # progress bars would flood the log
               **os.environ, "MOLT_HOME": str(self.home), "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "CUDA_VISIBLE_DEVICES": ",".join(gpus),  # its own GPUs only; "" = none: it runs on the CPU
               "MOLT_RAY_ADDRESS": self.ray or ""}  # set: the worker places the attempt on that cluster
        logfile = open(log_path, "ab")
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logfile, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        except OSError as e:
            logfile.close()
            s.execute(update(Attempt).where(Attempt.id == attempt.id).values(outcome="error",
                                                                            cause=f"could not start: {e}"))
            s.commit()
            self.end_attempt(run.id, attempt.id, 1)
            return
        s.execute(update(Attempt).where(Attempt.id == attempt.id).values(pid=proc.pid))
        s.execute(update(Run).where(Run.id == run.id).values(pid=proc.pid))
        on = f" on GPU {','.join(gpus)}" if gpus else ""
        add_event(s, run.id, "attempt", f"attempt {number} started (pid {proc.pid}){on}", attempt=number, pid=proc.pid,
                  gpus=gpus)
        s.commit()
        self.workers[run.id] = Worker(run.id, attempt.id, number, proc.pid, t, proc, logfile, gpus=tuple(gpus))
        log.info("run %d: attempt %d started, pid %d, log %s", run.id, number, proc.pid, log_path)


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else every GPU torch counts (torch is imported
    only on a machine with the NVIDIA driver, so a CPU-only daemon starts without it)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if not Path("/proc/driver/nvidia").exists():
        return []
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]
