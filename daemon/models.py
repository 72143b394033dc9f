"""The records: SQLModel tables of runs, attempts, metrics, versions, checkpoints, alerts, events, samples, evals."""
import time

from sqlalchemy import JSON, Boolean, Column, ForeignKey, Index, Integer, Text, UniqueConstraint
from sqlmodel import Field, SQLModel

# Named constraints, so that Alembic's batch mode on SQLite can find and drop them in later migrations.
SQLModel.metadata.naming_convention = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Times are unix seconds (float, UTC): unambiguous, sortable, and what the heartbeat arithmetic needs.
# a slot is taken: a worker lives or is about to; an external run is "unreachable" while its heartbeats are missing
ACTIVE = ("running", "restarting", "stopping", "unreachable")
TERMINAL = ("completed", "failed", "stopped", "tripped")
STATUSES = ("queued",) + ACTIVE + TERMINAL
OUTCOMES = ("completed", "stopped", "tripped")      # a worker's clean ends; each is also the run's final status


def now() -> float:
    return time.time()


# AUTOINCREMENT (sqlite_autoincrement): an id is never given again after a delete, so a link, a compare URL, a
# webhook's text or an evaluation row naming a deleted run, evaluation or alert never opens another one.
NEVER_REUSED = {"sqlite_autoincrement": True}


class Run(SQLModel, table=True):
    __table_args__ = NEVER_REUSED
    id: int | None = Field(default=None, primary_key=True)
    name: str
    status: str = Field(default="queued", index=True)  # see STATUSES; only the supervisor and api.py change it
    config: dict = Field(sa_column=Column(JSON, nullable=False))  # the validated config with every default filled in
    tags: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    step: int = 0                          # trainer steps done (the engine's latest metrics step + 1)
    total_steps: int
    version: int = 0                       # latest policy version
    reward: float | None = None            # latest reward_mean, for the runs list
    restarts: int = 0                      # automatic restarts, all time
    retries: int = 0                       # failed attempts in a row without new progress (the budget)
    max_restarts: int = 3
    pid: int | None = None                 # the live worker, else None
    gpus: str | None = None                # the GPU ids its live (else last) worker was given, e.g. "0,1"; None = none
    last_error: str | None = Field(default=None, sa_column=Column(Text))
    summary: dict | None = Field(default=None, sa_column=Column(JSON))  # what train() returned, last attempt
    created_at: float = Field(default_factory=now)
    started_at: float | None = None
    finished_at: float | None = None
    next_start_at: float | None = None     # status restarting: when the backoff ends
    notes: str = Field(default="", sa_column=Column(Text, nullable=False, server_default=""))
    archived: bool = Field(default=False, sa_column=Column(Boolean, nullable=False, server_default="0"))
    # An external run (`molt train --report-to`): trained elsewhere, it reports over HTTP and is never supervised here
    host: str | None = None                # the machine it trains on; None for the daemon's own runs
    ranks: int | None = None               # its processes (world size)
    ingest_token: str | None = Field(default=None, index=True)  # sha256 of its run-scoped ingest token
    idempotency_key: str | None = Field(default=None, unique=True)  # its registration's: a retry finds it
    # A sweep's run: its sweep and point (its idempotency_key "sweep:ID:POINT:SEED" makes creating it idempotent)
    sweep_id: int | None = Field(default=None, index=True)
    sweep_point: int | None = None


SWEEP_STATUSES = ("running", "stopped", "completed", "failed")


class Sweep(SQLModel, table=True):
    """A search over config keys (daemon/sweeps.py): its request, the points so far (param dicts; a grid's or a
    random sweep's all at once, TPE's one by one), and the (run, step) pairs the early-stopping rule has judged."""
    __table_args__ = NEVER_REUSED
    id: int | None = Field(default=None, primary_key=True)
    name: str
    status: str = Field(default="running", index=True)  # see SWEEP_STATUSES
    request: dict = Field(sa_column=Column(JSON, nullable=False))  # the validated SweepRequest
    points: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    judged: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))  # ["run_id:step", ...]
    last_error: str | None = Field(default=None, sa_column=Column(Text))
    created_at: float = Field(default_factory=now)
    finished_at: float | None = None


class Attempt(SQLModel, table=True):
    """One worker process of a run. cause: "SIGKILL", "exit code 1", "hang", "ValueError: ..." (with the traceback
    tail in `error`), or the outcome ("completed", "stopped", "tripped") of a clean exit."""
    __table_args__ = (UniqueConstraint("run_id", "number"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id", index=True)
    number: int                            # 1, 2, ... within the run
    pid: int | None = None
    started_at: float = Field(default_factory=now)
    ended_at: float | None = None
    heartbeat_at: float | None = None
    start_step: int | None = None          # the step it resumed from (0 = fresh start)
    end_step: int | None = None            # the run's step when it ended (how far this attempt got)
    outcome: str | None = None             # written by the worker: completed | stopped | tripped | error
    exit_code: int | None = None
    signal: str | None = None
    cause: str | None = Field(default=None, sa_column=Column(Text))
    error: str | None = Field(default=None, sa_column=Column(Text))
    log_path: str | None = None
    idempotency_key: str | None = None     # an external run's resume request: a retry finds it


class Metric(SQLModel, table=True):
    """One value per (run, name, step): a replayed step overwrites, never duplicates. value NULL means NaN
    (SQLite stores NaN as NULL; ±inf are stored as they are), so a NaN loss stays visible."""
    __table_args__ = (UniqueConstraint("run_id", "name", "step"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id")
    name: str
    step: int
    value: float | None = None
    time: float = Field(default_factory=now)


BUCKET_SHIFTS = (6, 9)  # metric_bucket.bucket = step >> BUCKET_SHIFTS[level]; migration 0002's triggers use them


class MetricBucket(SQLModel, table=True):
    """A summary of the metric rows of each (run, name), per bucket of 64 steps (level 0) and of 512 (level 1): the
    row holding the minimum, the one holding the maximum, the first NaN. A chart of a 1,000,000-point series reads
    ~2,000 of these rows instead of the million (SQLite alone needs > 100 ms to scan those). Written only by SQLite
    triggers on `metric` (migration 0002), so every writer keeps it exact, replays and deletions included.
    NULL lo/hi: only NaN in the bucket."""
    __tablename__ = "metric_bucket"
    __table_args__ = {"sqlite_with_rowid": False}   # the key is the only index: rows stay small and clustered
    run_id: int = Field(foreign_key="run.id", primary_key=True)
    name: str = Field(primary_key=True)
    level: int = Field(primary_key=True)
    bucket: int = Field(primary_key=True)
    n: int                                 # rows in the bucket
    lo_step: int | None = None
    lo_value: float | None = None
    lo_time: float | None = None
    hi_step: int | None = None
    hi_value: float | None = None
    hi_time: float | None = None
    nan_step: int | None = None            # the bucket's first NaN (value NULL), if any
    nan_time: float | None = None


class PolicyVersion(SQLModel, table=True):
    __tablename__ = "policy_version"
    __table_args__ = (UniqueConstraint("run_id", "version"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id")
    version: int
    step: int
    time: float = Field(default_factory=now)
    reward_mean: float | None = None
    staleness_mean: float | None = None
    staleness_max: float | None = None


class Checkpoint(SQLModel, table=True):
    __table_args__ = (UniqueConstraint("run_id", "step"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id")
    step: int
    path: str
    size_bytes: int | None = None
    version: int | None = None
    time: float = Field(default_factory=now)


class Alert(SQLModel, table=True):
    __table_args__ = NEVER_REUSED
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id", index=True)
    time: float = Field(default_factory=now)
    step: int | None = None
    kind: str                              # breaker, staleness, mismatch (engine); worker (supervisor)
    message: str = Field(sa_column=Column(Text, nullable=False))
    data: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    acknowledged: bool = False
    uid: str | None = Field(default=None, unique=True)  # "attempt:seq" from a worker: replaying its spool is a no-op


class Event(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id", index=True)
    time: float = Field(default_factory=now)
    step: int | None = None
    kind: str                              # warm_start, resumed, saved, rollback, stopped (engine); attempt, ...
    source: str = "engine"                 # engine | daemon
    message: str = Field(sa_column=Column(Text, nullable=False))
    data: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    uid: str | None = Field(default=None, unique=True)


class DaemonEvent(SQLModel, table=True):
    """The daemon's own timeline: `started` and `stopped` (written by the daemon), `down` (written by whoever keeps
    it alive, `molt serve`, with the cause: SIGKILL, exit code N, hang)."""
    __tablename__ = "daemon_event"
    id: int | None = Field(default=None, primary_key=True)
    time: float = Field(default_factory=now)
    kind: str
    pid: int | None = None
    cause: str | None = None
    message: str = Field(sa_column=Column(Text, nullable=False))


class Sample(SQLModel, table=True):
    """A recorded episode (the engine's `record` config): a sample of a step's trained episodes (kind "train") or
    of an eval's (kind "eval"), or an evaluation job's episode (kind "evaluation"). `tokens` holds its tokens
    column-wise: id, text (the piece), action, logprob (behaviour), trainer_logprob, version, entropy. Unique per
    (run, kind, step, position): a replay overwrites."""
    __table_args__ = (UniqueConstraint("run_id", "step", "kind", "position"), Index(None, "run_id", "prompt"))
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id")
    step: int
    kind: str                              # train | eval | evaluation
    position: int                          # its place among the step's samples of that kind
    group_id: int                          # the prompt's cursor (its training group); -1 for eval
    # An evaluation job's episode (kind "evaluation", step = the job's id too): its own, never pruned with the run's.
    # No foreign key: SQLite rebuilds a table to add one, and a model section's are in a database of their own.
    eval_id: int | None = Field(default=None, index=True)
    seed: int
    version: int                           # the trainer's policy version (staleness = version - a token's version)
    reward: float | None = None
    advantage: float | None = None         # None for eval episodes
    success: bool
    turns: int
    tool_calls: int
    tool_errors: int
    prompt: str = Field(sa_column=Column(Text, nullable=False))   # the text before the first action
    text: str = Field(sa_column=Column(Text, nullable=False))     # the whole episode, for search
    tokens: dict = Field(sa_column=Column(JSON, nullable=False))
    images: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))  # PNG data: URLs
    time: float = Field(default_factory=now)


EVAL_STATUSES = ("queued", "running", "restarting", "stopping", "completed", "failed", "stopped")


class Evaluation(SQLModel, table=True):
    """An evaluation job: a policy (a run's checkpoint, or a model section) on an env, `episodes` episodes in groups
    of `k` per prompt. Its finished episodes are its EvalResult rows: a restarted worker runs only the missing ones.
    A run's evaluation also records its episodes as samples (kind "evaluation", step = this id)."""
    __table_args__ = NEVER_REUSED
    id: int | None = Field(default=None, primary_key=True)
    run_id: int | None = Field(default=None, foreign_key="run.id", index=True)  # the source run, if any
    checkpoint: str | None = None          # as asked: best, final, latest or a step number
    step: int | None = None                # the source run's step the policy is from, where known
    policy_path: str | None = None         # the policy directory loaded; None = model.preset built from the seed
    config: dict = Field(sa_column=Column(JSON, nullable=False))  # model, env, env_args, episodes, k, temperature, seed
    status: str = Field(default="queued", index=True)  # see EVAL_STATUSES
    metrics: dict | None = Field(default=None, sa_column=Column(JSON))
    restarts: int = 0
    max_restarts: int = 3
    pid: int | None = None
    gpus: str | None = None
    last_error: str | None = Field(default=None, sa_column=Column(Text))
    created_at: float = Field(default_factory=now)
    started_at: float | None = None
    finished_at: float | None = None


class EvalResult(SQLModel, table=True):
    """One finished episode of an evaluation, by its position: a row each, appended as it ends, so that N episodes
    cost N small writes (the whole results rewritten per episode was quadratic up to 100,000 episodes)."""
    __tablename__ = "eval_result"
    eval_id: int = Field(sa_column=Column(Integer, ForeignKey("evaluation.id", ondelete="CASCADE"), primary_key=True))
    position: int = Field(primary_key=True)
    reward: float | None = None
    success: bool
    metrics: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))  # the env's own
    error: str | None = Field(default=None, sa_column=Column(Text))  # an env that failed: a failed episode
