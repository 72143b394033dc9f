"""Keeping the daemon alive for `molt serve` (restarts with backoff, each recorded with its cause), stopping a
daemon gracefully (`molt daemon stop`: its workers checkpoint, the next daemon resumes their runs; a stop stays a
stop), and starting it again (`molt daemon start`)."""
import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from sqlalchemy import select
from sqlmodel import Session

from .daemon_records import KEEPER_LOCK
from .records import Records
from .db import DAEMON_HANG_S, add_daemon_event, add_event, hold_lock
from .models import ACTIVE, DaemonEvent, Run
from .supervisor import INTERRUPTED

log = logging.getLogger("molt.keeper")
BACKOFF_S, BACKOFF_MAX_S = 1.0, 30.0
HEALTHY_S = 30.0    # a daemon alive this long resets the backoff


class Keeper:
    """Watches the daemon of a data directory from a thread of `molt serve`, every `poll` seconds. The daemon is
    its own child, or one it found holding the lock (adopted). Dead (the child exited, or the lock is free) or hung
    (no heartbeat for DAEMON_HANG_S, or never took the lock): a `down` event with the cause, on the daemon's
    timeline and on every active run's, then a new daemon after the backoff: 1 s, doubling while daemons keep dying
    within HEALTHY_S, at most 30 s. So a killed daemon is replaced within poll + backoff + its start (~2 s).
    A daemon stopped on request (`molt daemon stop`, SIGTERM: its last event says `stopped`) is not down: it stays
    stopped until a start is requested (`molt daemon start`, the dashboard's Start button), which we then serve."""

    def __init__(self, records: Records, command: list[str], poll: float = 0.5, hang: float = DAEMON_HANG_S):
        self.records, self.command, self.poll, self.hang = records, command, poll, hang
        self.proc: subprocess.Popen | None = None   # our child, until it exits
        self.pid: int | None = None                 # the daemon we watch: our child or an adopted one
        self.spawned = 0.0                          # when we started our child (monotonic)
        self.up_since: float | None = None
        self.failures = 0                           # deaths in a row: the backoff's exponent
        self.next_start = 0.0
        self.checks = 0                             # looks at the daemon so far
        self.lock = None                            # KEEPER_LOCK: says to `molt daemon start` that we start it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="molt-keeper", daemon=True)

    def start(self):
        self.lock = hold_lock(self.records.home / KEEPER_LOCK, str(os.getpid()))
        if self.records.daemon_status()["stopped"]:  # a daemon stopped before `molt serve` started: serving asks
            self.records.request_daemon_start("molt serve")
        self.check()
        self._thread.start()

    def close(self):
        """Stop watching (the daemon itself keeps running)."""
        self._stop.set()
        self._thread.join()
        if self.lock is not None:
            self.lock.close()

    def _loop(self):
        while not self._stop.wait(self.poll):
            try:
                self.check()
            except Exception:  # a busy database: look again next poll, never stop watching
                log.exception("daemon check failed")

    def check(self):
        t = time.monotonic()
        self.checks += 1
        if self.proc is not None and (rc := self.proc.poll()) is not None:
            self.proc = None
            self.ended(signal.Signals(-rc).name if rc < 0 else f"exit code {rc}")
            return
        status = self.records.daemon_status()
        if status["running"]:
            if status["pid"] != self.pid:
                print(f"molt serve: watching the daemon (pid {status['pid']}) that owns {self.records.home}",
                      flush=True)
                self.pid, self.up_since = status["pid"], None
            if status["heartbeat_age"] > self.hang:
                self.kill()
                self.down(f"hang: no heartbeat for {status['heartbeat_age']:.0f}s")
            elif self.up_since is None:
                self.up_since = t
            elif t - self.up_since > HEALTHY_S:
                self.failures = 0
        elif self.proc is not None:  # our child is starting and has not taken the lock yet
            if t - self.spawned > self.hang:
                self.kill()
                self.down(f"hang: did not start within {self.hang:.0f}s")
        elif self.pid is not None:  # an adopted daemon is gone: not our child, so no exit status
            self.ended("exited (not our child: exit status unknown)")
        elif status["stopped"]:
            pass  # stopped on request: until a start is requested, the latest daemon event says `stopped`
        elif t >= self.next_start:
            self.proc = subprocess.Popen(self.command, start_new_session=True)  # Ctrl-C in the terminal is ours
            self.pid, self.spawned = self.proc.pid, t
            print(f"molt serve: daemon started (pid {self.pid})", flush=True)

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)  # the daemon alone: its workers lead their own sessions, live on
        except ProcessLookupError:
            pass
        if self.proc is not None:
            self.proc.wait()
            self.proc = None

    def ended(self, cause: str):
        """The daemon we watched is gone: stopped on request (its own last word was `stopped`, even if a start has
        been requested since we last looked: the next check serves that start), or down."""
        with Session(self.records.engine) as s:
            last = s.scalar(select(DaemonEvent.kind).where(DaemonEvent.pid == self.pid, DaemonEvent.kind.in_(
                ("started", "stopped"))).order_by(DaemonEvent.id.desc()).limit(1))
        if last == "stopped":
            print(f"molt serve: the daemon (pid {self.pid}) was stopped; it stays stopped until `molt daemon start "
                  f"--home {self.records.home}` or the dashboard's Start button", flush=True)
            self.pid, self.up_since = None, None
        else:
            self.down(cause)

    def down(self, cause: str):
        delay = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** self.failures)
        self.failures += 1
        self.next_start = time.monotonic() + delay
        message = f"daemon (pid {self.pid}) down: {cause}; restarting in {delay:.0f}s"
        add_daemon_event(self.records.engine, "down", message, pid=self.pid, cause=cause)
        with Session(self.records.engine) as s:  # the runs it supervised say so on their timelines too
            for run_id in s.scalars(select(Run.id).where(Run.status.in_(ACTIVE))):
                add_event(s, run_id, "daemon_down", message, pid=self.pid, cause=cause)
            s.commit()
        print(f"molt serve: {message}", flush=True)
        self.pid, self.up_since = None, None


def exited(pid: int) -> bool:
    """The process is gone (a zombie its parent has not reaped yet counts as gone: it holds nothing any more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def stop_daemon(records: Records, grace: float, say=print) -> bool:
    """Stop the daemon that owns the data directory, gracefully: its active runs are stopped (each worker
    checkpoints) and remembered in INTERRUPTED, so that the next daemon resumes them; then the daemon gets SIGTERM
    (SIGKILL if it is still there 15 s later). A KeyboardInterrupt (a second Ctrl-C) cuts the wait for the runs
    short: their workers keep running and the next daemon adopts them. False if no daemon owns the directory."""
    pid = records.daemon_status()["pid"]
    if pid is None:
        return False
    try:
        ids = [r["id"] for r in records.list_runs(status=["running", "restarting"]) if not r["host"]]  # ours only
        if ids:
            say(f"stopping run(s) {', '.join(map(str, ids))}: checkpointing (Ctrl-C again to leave them running)")
            # Written first, whole (a rename): the daemon's sweep tick reads it to tell a run stopped by this
            # shutdown (its sweep is not done) from one stopped for its own reasons
            path = records.home / INTERRUPTED
            earlier = json.loads(path.read_text() or "[]") if path.exists() else []
            path.with_suffix(".tmp").write_text(json.dumps(sorted(set(earlier) | set(ids))))
            path.with_suffix(".tmp").replace(path)
            for run_id in ids:
                try:
                    records.stop_run(run_id)
                except ValueError:  # it ended meanwhile
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and records.daemon_status()["pid"] == pid:
                if all(records.get_run(i)["status"] not in ACTIVE for i in ids):
                    break
                time.sleep(0.2)
            for run_id in ids:
                say(f"run {run_id} {records.get_run(run_id)['status']}")
    except KeyboardInterrupt:
        say("not waiting for the runs; the next daemon adopts their workers")
    finally:
        try:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            # Until the process is gone, not only its lock: the daemon lets go of that a moment before it exits
            while not exited(pid):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    break
                time.sleep(0.1)
        except ProcessLookupError:
            pass
    return True


def start_main(argv=None) -> int:
    """`molt daemon start`: start the daemon of a data directory again (e.g. after `molt daemon stop`)."""
    p = argparse.ArgumentParser(prog="molt daemon start", description="Start the daemon of a data directory: the "
                                "`molt serve` that watches it starts its own daemon (with its options); without one, "
                                "a daemon starts in the background with the options given here (those of "
                                "`molt daemon`), its output in DIR/daemon.log.")
    p.add_argument("--home", help="data directory (default $MOLT_HOME, else the user data directory)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to come up (default 60)")
    a, daemon_args = p.parse_known_args(argv)
    records = Records(a.home)
    status = records.daemon_status()
    if status["running"]:
        print(f"molt daemon start: the daemon (pid {status['pid']}) already owns {records.home}", flush=True)
        return 0
    records.request_daemon_start("molt daemon start")
    proc, log = None, records.home / "daemon.log"
    if not status["kept"]:  # no `molt serve` watches the directory to serve the request: start one ourselves
        with open(log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "daemon", "--home", str(records.home), *daemon_args],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + a.timeout
    while not ((status := records.daemon_status())["alive"] and status["pid"]):  # pid: its lock's content written
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            print(f"molt daemon start: no daemon came up for {records.home}" + (f" (see {log})" if proc else ""),
                  file=sys.stderr)
            return 1
        time.sleep(0.2)
    print(f"molt daemon start: the daemon (pid {status['pid']}) owns {records.home}", flush=True)
    return 0


def stop_main(argv=None) -> int:
    """`molt daemon stop`: stop the daemon that owns a data directory, found by its lock."""
    p = argparse.ArgumentParser(prog="molt daemon stop", description="Stop the daemon that owns a data directory: "
                                "its runs stop first, each worker checkpointing, and the next daemon resumes them.")
    p.add_argument("--home", help="data directory (default $MOLT_HOME, else the user data directory)")
    p.add_argument("--grace", type=float, default=60.0,
                   help="seconds the running workers get to checkpoint and stop (default 60)")
    a = p.parse_args(argv)
    records = Records(a.home)
    if not stop_daemon(records, a.grace, say=lambda text: print(f"molt daemon stop: {text}", flush=True)):
        print(f"molt daemon stop: no daemon owns {records.home}", file=sys.stderr)
        return 1
    print(f"molt daemon stop: stopped the daemon of {records.home}", flush=True)
    return 0
