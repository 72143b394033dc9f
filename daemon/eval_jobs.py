"""The supervisor's share of evaluation jobs: start queued ones in free slots and GPUs, watch their workers
(progress, stop requests), restart or record those that end, adopt those an earlier daemon left."""
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from sqlalchemy import func, select, update
from sqlmodel import Session

from .db import FIRST_BEAT_S, eval_dir, lock_holder
from .eval_records import ENDED, LIVE
from .models import Evaluation, now
from .slots import EVAL_ORDER, EVAL_WAITS

UNRECORDED = 2  # the evaluation worker's exit status when its error could not be written either (daemon/evals.py)


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
        engine = self.sup.engine
        with Session(engine) as s:
            for eval_id, w in list(self.workers.items()):
                status = s.scalar(select(Evaluation.status).where(Evaluation.id == eval_id))
                if status is None:  # deleted with its run: nothing of it is left to record
                    _kill(w.pid, signal.SIGKILL)
                alive = w.proc.poll() is None if w.proc else lock_holder(eval_dir(self.sup.home, eval_id)
                                                                         / "worker.lock") is not None
                if not alive:
                    self.ended(s, eval_id, w.proc.returncode if w.proc else None)
                    continue
                beat = heartbeat_at(self.sup.home, eval_id)
                age = now() - max(beat or 0.0, w.started)
                limit = self.sup.heartbeat_timeout if beat else max(self.sup.heartbeat_timeout, FIRST_BEAT_S)
                if w.hang is None and age > limit:  # stopping or not: a hung worker would never end on SIGTERM
                    w.hang = f"hang: no progress for {age:.0f}s" if beat else f"hang: no first heartbeat in {age:.0f}s"
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
            free = self.sup.free_slots(s)
            waiting = s.scalars(select(Evaluation).where(EVAL_WAITS).order_by(*EVAL_ORDER).limit(max(free, 0))).all()
            for e in waiting:
                needed = 1 if self.sup.gpus else 0
                gpus = self.sup.free_gpus(s)[:needed]
                if len(gpus) < needed:
                    break
                self.start(s, e, gpus)

    def ended(self, s: Session, eval_id: int, rc: int | None):
        """Record a worker's end. It stays watched until that is committed: a write that fails (a full disk) is
        tried again next poll, never taken for a worker that died with the last daemon (restarted uncounted)."""
        w = self.workers[eval_id]
        e = s.get(Evaluation, eval_id, populate_existing=True)
        if e is None:  # deleted with its run: its files too, with what the worker wrote since
            shutil.rmtree(eval_dir(self.sup.home, eval_id), ignore_errors=True)
        elif e.status not in ENDED:
            cause = w.hang or ("gone (adopted: exit status unknown)" if rc is None else
                               f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}")
            error = (e.last_error if rc == 1 else  # 1: it recorded its error
                     f"worker {cause}: it could not record its error (a full disk?)" if rc == UNRECORDED
                     else f"worker {cause}")
            if e.status == "stopping":
                values = {"status": "stopped", "finished_at": now()}
            elif e.restarts < e.max_restarts:
                values = {"status": "restarting", "restarts": e.restarts + 1, "last_error": error}
            else:
                values = {"status": "failed", "finished_at": now(), "last_error": error}
            s.execute(update(Evaluation).where(Evaluation.id == eval_id, Evaluation.status == e.status)
                      .values(pid=None, **values))
            s.commit()
        del self.workers[eval_id]
        if w.log:
            w.log.close()

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


def heartbeat_at(home: Path, eval_id: int) -> float | None:
    """When the evaluation's worker last beat (its heartbeat file's mtime), which it does only when its progress
    grows; None before its first beat."""
    try:
        return (eval_dir(home, eval_id) / "heartbeat").stat().st_mtime
    except FileNotFoundError:
        return None
