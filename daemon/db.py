"""The SQLite database in the data directory: engine with WAL + busy timeout, migrate-on-start, small helpers."""
import fcntl
import hashlib
import logging
import os
from contextlib import contextmanager
from pathlib import Path

import platformdirs
from sqlalchemy import event, select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, create_engine

from .models import Alert, DaemonEvent, Event, Run, now

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"
BUSY_TIMEOUT_S = 30
# The daemon touches its lock file after every poll. No touch for this long and it counts as hung: the web reports
# it degraded and `molt serve` kills and restarts it. Above BUSY_TIMEOUT_S: a poll that waited out one busy database
# statement is slow, not hung.
DAEMON_HANG_S = 60.0
# A worker's first heartbeat may take this long, whatever the heartbeat timeout: a multi-rank worker beats only
# once its rank 0 runs (torchrun imported and started, then the ranks), which a busy machine stretches past 20 s.
FIRST_BEAT_S = 120.0


# Written by the dashboard (`molt serve`, `molt web`) while it listens: {"url": ...}. Ranks placed on Ray report
# to it over HTTP, as an external run does, so that no node but the daemon's opens the database.
DASHBOARD = "dashboard.json"


def data_home(home: str | Path | None = None) -> Path:
    """The data directory: `home`, else $MOLT_HOME, else the user's data directory (e.g. ~/.local/share/molt),
    absolute, so workers agree with the daemon wherever each was started."""
    return Path(home or os.environ.get("MOLT_HOME") or platformdirs.user_data_dir("molt")).expanduser().resolve()


def run_dir(home: Path, run_id: int) -> Path:
    """A run's directory: the engine's out_dir (checkpoints/, final/) plus the attempt logs and spools."""
    return home / "runs" / str(run_id)


def eval_dir(home: Path, eval_id: int) -> Path:
    return home / "evals" / str(eval_id)


def db_url(home: Path) -> str:
    return f"sqlite:///{home / 'molt.db'}"


def connect(home: str | Path | None = None, migrate: bool = True) -> Engine:
    """An engine on MOLT_HOME/molt.db; with `migrate`, bring the schema to the newest revision first."""
    home = data_home(home)
    home.mkdir(parents=True, exist_ok=True)
    engine = sqlite_engine(db_url(home))
    if migrate:
        upgrade(engine, home)
    return engine


def sqlite_engine(url: str) -> Engine:
    # check_same_thread off: the sink's writer thread takes pooled connections too (never two threads at once).
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_S})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record):
        # WAL: readers (the app, the supervisor) never block the writers (workers) and vice versa. busy_timeout:
        # writers queue for the write lock instead of failing with "database is locked". synchronous=NORMAL is
        # safe in WAL (a power loss may drop the last commits, never corrupt).
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_S * 1000}")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()
    return engine


def alembic_config(connection=None):
    from alembic.config import Config
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(engine: Engine, home: Path, revision: str = "head"):
    """alembic upgrade, under a file lock: the daemon, the app and tests may all start at once."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    with file_lock(home / "migrate.lock"), engine.connect() as conn:
        cfg = alembic_config(conn)
        if revision == "head":
            heads = set(ScriptDirectory.from_config(cfg).get_heads())
            current = set(MigrationContext.configure(conn).get_current_heads())
            if current == heads:
                return  # the common case, without loading env.py
            logging.getLogger("molt.daemon").info("migrating %s from %s to %s", home / "molt.db",
                                                  ",".join(sorted(current)) or "empty", ",".join(sorted(heads)))
        conn.commit()
        # A migration that rebuilds a table others refer to (batch mode: copy, drop, rename) needs the foreign keys
        # off, set outside any transaction (SQLite's own recipe for schema changes); they are checked at the end.
        conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
        conn.commit()
        try:
            command.upgrade(cfg, revision)
            if broken := conn.exec_driver_sql("PRAGMA foreign_key_check").all():
                raise RuntimeError(f"the migration broke foreign keys: {broken[:5]}")
            conn.commit()
        finally:
            conn.rollback()  # what failed, if anything: the pragma below takes effect only outside a transaction
            conn.exec_driver_sql("PRAGMA foreign_keys=ON")
            conn.commit()


@contextmanager
def file_lock(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def hold_lock(path: Path, content: str):
    """Take an exclusive lock on `path`, held for as long as the returned file stays open (the kernel drops it when
    the process dies, however it dies), and write `content` (who holds it) into the file. None if already held."""
    f = open(path, "a+")  # Python opens files non-inheritable: a child process never keeps our lock alive
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    f.seek(0)
    f.truncate()
    f.write(content)
    f.flush()
    return f


def lock_holder(path: Path) -> str | None:
    """What the live holder of the lock on `path` wrote in it ("" if not yet written), or None if nobody holds it."""
    try:
        f = open(path)
    except FileNotFoundError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip()
        fcntl.flock(f, fcntl.LOCK_UN)
        return None


def digest(token: str) -> str:
    """What the database keeps of a run-scoped ingest token (Run.ingest_token)."""
    return hashlib.sha256(token.encode()).hexdigest()


def set_run(conn, run_id: int, only_if: tuple[str, ...] | None = None, **values) -> bool:
    """UPDATE one run, if its status is one of `only_if`: one atomic statement, so the API (stop/resume) and the
    supervisor (exits, restarts) never overwrite each other's status decisions. True if the row changed."""
    stmt = update(Run).where(Run.id == run_id).values(**values)
    if only_if is not None:
        stmt = stmt.where(Run.status.in_(only_if))
    return conn.execute(stmt).rowcount == 1


def add_event(session, run_id: int, kind: str, message: str, **data):
    """A daemon-side event on the run's timeline (the session's commit writes it)."""
    session.add(Event(run_id=run_id, kind=kind, source="daemon", message=message, data=data))


def finish_run(session, run_id: int, status: str, cause: str, attempt: int, only_if: tuple[str, ...]) -> bool:
    """Give a run its final status (completed, stopped, tripped) if its status is still one of `only_if`, with the
    event that says why; a tripped run's last_error is the breaker's last alert. The worker calls it as it ends,
    the supervisor when it sees the worker gone: whichever comes first decides, the other changes nothing."""
    extra = {}
    if status == "tripped":
        extra["last_error"] = session.scalar(select(Alert.message).where(
            Alert.run_id == run_id, Alert.kind == "breaker").order_by(Alert.id.desc()).limit(1)) or cause
    if not set_run(session, run_id, only_if, status=status, pid=None, finished_at=now(), next_start_at=None,
                   **extra):
        return False
    add_event(session, run_id, status, f"attempt {attempt} ended: {cause}; run {status}", attempt=attempt)
    return True


def add_daemon_event(engine: Engine, kind: str, message: str, pid: int | None = None, cause: str | None = None):
    with Session(engine) as s:
        s.add(DaemonEvent(kind=kind, message=message, pid=pid, cause=cause))
        s.commit()


def row_dict(row) -> dict:
    """A table row as a plain dict (what the API shows)."""
    # getattr, not model_dump(): it loads attributes that a commit expired (model_dump would silently drop them)
    return {c.name: getattr(row, c.name) for c in row.__table__.columns}

