"""The database sink, and the spool that it and the HTTP sink (report.py) share: records are committed in batches."""
import errno
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

from sqlalchemy import delete, func, update
from sqlalchemy.dialects.sqlite import insert
from sqlalchemy.engine import Engine

from .models import Alert, Attempt, Checkpoint, Event, Metric, PolicyVersion, Run, Sample

FLUSH_EVERY_S = 0.3  # "about every 0.5 s", a little under: it is the floor of live-curve latency
HEARTBEAT_EVERY_S = 1.0


class SpoolSink:
    """What the database sink and the HTTP sink share: calls return at once (the engine's event loop must never wait
    on the database or the network): a record is appended to a list and to a spool file, and a delivery thread hands
    the list to `_deliver` every `flush_every` seconds, in order. The spool is why a SIGKILL loses nothing: a write()
    is in the kernel as soon as it returns, and what was never delivered can be replayed from it. A batch that fails
    stays first in line and is retried (every flush_every, backing off up to `backoff` times that), so delivery is
    at least once and in order; the receiving side is idempotent. With `spool_cap` bytes undelivered, new records
    are dropped with a warning.

    Heartbeats go with the batches, at most once a second, with the time the engine called heartbeat(), not the
    time of the delivery: if the event loop hangs, the delivered time stops moving even though this thread lives on.
    Until the engine's first heartbeat (imports, model loading, warm start) the delivery thread beats instead."""
    what = "delivery"            # for messages: "{what} failed"
    backoff = 1                  # a failing batch is retried every flush_every times up to this factor (doubling)
    drain_s = 10.0               # at close, how long the last records may take to be delivered

    def __init__(self, name: str, spool_dir: Path | None, spool_prefix: str, flush_every: float = FLUSH_EVERY_S,
                 keep_samples: int | None = None, spool_cap: int | None = None, replay: bool = False):
        self.flush_every, self.spool_prefix, self.keep_samples = flush_every, spool_prefix, keep_samples
        self.spool_cap = spool_cap if spool_dir else None  # the spool's size is what is measured
        self.spool_dir = Path(spool_dir) if spool_dir else None
        self._lock = threading.Lock()
        self._pending: list[dict] = []
        self._seq = 0
        self._segment, self._fd = 0, None
        self._committed_upto = -1              # spool segments up to this index are delivered
        self._spooled = self._dropped = 0      # undelivered bytes; records dropped past spool_cap
        self._engine_beat: float | None = None  # the time of the engine's latest heartbeat() call
        self._beat_written, self._beat_write_at = 0.0, -1e9
        self._stop, self._wake = threading.Event(), threading.Event()
        self.passes = self.failures = 0    # delivery passes / failed deliveries (for tests and the bench)
        self._failing = 0                  # failures in a row
        self.writer_cpu_s = None
        if self.spool_dir:
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            leftovers = sorted(self.spool_dir.glob(f"{spool_prefix}-*.jsonl"))  # an earlier sink's, never delivered
            if leftovers:  # new segments come after them; with `replay` they are delivered first, else left alone
                self._segment = int(leftovers[-1].stem.rsplit("-", 1)[1]) + 1
                if replay:
                    self._pending = [r for path in leftovers for r in read_spool(path)]
                    self._spooled = sum(path.stat().st_size for path in leftovers)
                else:
                    self._committed_upto = self._segment - 1
            self._fd = self._open_segment()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ---- the engine's Sink protocol (any thread; never blocks on delivery) -----------------------------------------

    def metrics(self, step: int, values: dict[str, float]):
        self._add({"t": "metrics", "time": time.time(), "step": int(step), "values": _floats(values)})

    def alert(self, kind: str, message: str, **data):
        self._add({"t": "alert", "time": time.time(), "kind": kind, "message": message, "data": data}, uid=True)

    def event(self, kind: str, message: str, **data):
        self._add({"t": "event", "time": time.time(), "kind": kind, "message": message, "data": data}, uid=True)

    def checkpoint(self, step: int, path: str, **info):
        self._add({"t": "checkpoint", "time": time.time(), "step": int(step), "path": str(path), "info": info})
        self._wake.set()  # the UI wants to see a checkpoint promptly; the flush costs a few ms off the event loop

    def samples(self, step: int, kind: str, records: list[dict]):
        if records:
            self._add({"t": "samples", "time": time.time(), "step": int(step), "kind": kind, "records": records,
                       "keep": self.keep_samples})

    def heartbeat(self):
        self._engine_beat = time.time()

    def close(self, timeout: float = 30.0):
        """Stop the delivery thread after a last flush. The spool is removed only when everything is delivered."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ---- internals ------------------------------------------------------------------------------------------------

    def _deliver(self, batch: list[dict], beat: float | None):
        """Deliver a batch (and the engine's heartbeat time, if any), or raise."""
        raise NotImplementedError

    def _uid(self) -> str:
        return str(self._seq)

    def _add(self, record: dict, uid: bool = False):
        with self._lock:
            if uid:
                self._seq += 1
                record["uid"] = self._uid()
            if self._fd is not None:
                line = (json.dumps(record, default=jsonable) + "\n").encode()
                # past the cap new records are dropped, never the run's end (the dashboard would wait for it
                # forever) nor the count of those dropped
                if self.spool_cap is not None and self._spooled + len(line) > self.spool_cap and not (
                        record["t"] == "end" or record.get("kind") == "spool_full"):
                    if not self._dropped:
                        print(f"molt: WARNING: the spool holds {self._spooled / 2**20:.1f} MiB not yet delivered "
                              f"(its cap): new records are DROPPED until {self.what} succeeds again",
                              file=sys.stderr, flush=True)
                    self._dropped += 1
                    return
                self._spooled += len(line)
                os.write(self._fd, line)
            if self._pending and self._pending[-1]["t"] == "end":  # the run's end stays last: nothing is taken after it
                self._pending.insert(-1, record)
            else:
                self._pending.append(record)

    def _open_segment(self) -> int:
        path = self.spool_dir / f"{self.spool_prefix}-{self._segment:06d}.jsonl"
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def _loop(self):
        while not self._stop.is_set():
            self._flush()
            self._wake.wait(self.flush_every * min(2 ** min(self._failing, 10), self.backoff))
            self._wake.clear()
        deadline = time.monotonic() + self.drain_s
        # the last records (and what a delivery adds: the count of those dropped); delivery may be slow a moment
        while not (self._flush() and not self._pending) and time.monotonic() < deadline:
            time.sleep(0.5)
        if self._fd is not None and not self._pending:
            os.close(self._fd)
            self._fd = None
            self._remove_segments(self._segment)
        self.writer_cpu_s = time.thread_time()  # this thread's CPU time, all of it (the bench reports it)

    def _flush(self) -> bool:
        self.passes += 1
        beat = self._engine_beat if self._engine_beat is not None else time.time()  # before the engine's first
        if beat == self._beat_written or time.monotonic() - self._beat_write_at < HEARTBEAT_EVERY_S:
            beat = None
        with self._lock:
            batch, self._pending = self._pending, []
            if batch and self._fd is not None:  # the records of this batch end in the segment we close now
                os.close(self._fd)
                closed, self._segment = self._segment, self._segment + 1
                self._fd = self._open_segment()
            else:
                closed = None
        if not batch and beat is None:
            return True
        try:
            self._deliver(batch, beat)
        except Exception as e:  # a busy database or a dashboard down must not kill training: keep them, retry later
            self.failures += 1
            print(f"molt: {self.what} failed ({type(e).__name__}: {e}); will retry", file=sys.stderr, flush=True)
            with self._lock:
                self._pending[:0] = batch
            if not self._failing:  # one event per streak of failures: delivered with the records it held back
                self.event(f"{self.what.replace(' ', '_')}_failed", f"{self.what} failed ({type(e).__name__}: {e}); "
                           "retrying")
            self._failing += 1
            return False
        self._failing = 0
        if beat is not None:
            self._beat_written, self._beat_write_at = beat, time.monotonic()
        if closed is not None:
            self._remove_segments(closed)
        self._tell_dropped(f"{self.what} works again")
        return True

    def _tell_dropped(self, now: str):
        """Say how many records were dropped past the spool's cap, on the terminal and as an event (which the cap
        never drops), once: when a delivery works again, or before the run's end."""
        with self._lock:
            dropped, self._dropped = self._dropped, 0
        if dropped:
            print(f"molt: {now}; {dropped} records were dropped", file=sys.stderr, flush=True)
            self.event("spool_full", f"{dropped} records dropped: {self.what} failed while the spool held "
                       f"{self.spool_cap / 2**20:g} MiB (its cap)", dropped=dropped)

    def _remove_segments(self, upto: int):
        for i in range(self._committed_upto + 1, upto + 1):
            path = self.spool_dir / f"{self.spool_prefix}-{i:06d}.jsonl"
            with self._lock:
                self._spooled -= path.stat().st_size if path.exists() else 0
            path.unlink(missing_ok=True)
        self._committed_upto = upto


class DbSink(SpoolSink):
    """The engine's sink for a daemon run: its delivery commits each batch to SQLite in one transaction. Whoever
    finds the worker dead replays its spool (replay_spools) before the next attempt. Every write is idempotent:
    metrics upsert on (run, name, step), samples on (run, step, kind, position), alerts and events carry a unique
    uid ("attempt:seq"). With `keep_samples`, samples older than the newest that many steps are deleted. The
    heartbeat goes to the attempt row."""
    what = "database write"

    def __init__(self, engine: Engine, run_id: int, attempt_id: int, spool_dir: Path | None = None,
                 flush_every: float = FLUSH_EVERY_S, keep_samples: int | None = None, full_disk_at=()):
        self.engine, self.run_id, self.attempt_id = engine, run_id, attempt_id
        self.full_disk_at = set(full_disk_at)  # the run's drills.db_full_disk_at: steps not yet failed
        super().__init__(f"molt-db-writer-{run_id}", spool_dir, f"spool-{attempt_id:08d}", flush_every, keep_samples)

    def _uid(self) -> str:
        return f"{self.attempt_id}:{self._seq}"

    def _deliver(self, batch: list[dict], beat: float | None):
        drilled = {r["step"] for r in batch if r["t"] == "metrics"} & self.full_disk_at
        if drilled:
            self.full_disk_at -= drilled
            raise OSError(errno.ENOSPC, "No space left on device (drill: drills.db_full_disk_at)")
        with self.engine.begin() as conn:
            write_records(conn, self.run_id, self.attempt_id, batch, heartbeat=beat)


def write_records(conn, run_id: int, attempt_id: int, records: list[dict], heartbeat: float | None = None):
    """Commit sink records (from memory or a spool) in the caller's transaction. Idempotent."""
    metrics, versions, checkpoints, alerts, events, samples, run_values = [], [], [], [], [], [], {}
    first_step, keep_from = None, None
    for r in records:
        kind = r["t"]
        if kind == "metrics":
            step, values = r["step"], r["values"]
            first_step = step if first_step is None else min(first_step, step)
            metrics += [dict(run_id=run_id, name=k, step=step, value=_real(v), time=r["time"])
                        for k, v in values.items()]
            if "version" in values and "reward_mean" in values:  # a trainer step (eval results come separately)
                version = int(values["version"])
                run_values.update(step=step + 1, version=version, reward=_real(values["reward_mean"]))
                versions.append(dict(run_id=run_id, version=version, step=step, time=r["time"],
                                     reward_mean=_real(values.get("reward_mean")),
                                     staleness_mean=_real(values.get("staleness_mean")),
                                     staleness_max=_real(values.get("staleness_max"))))
        elif kind == "checkpoint":
            info = r["info"]
            size = info.get("size_bytes")
            if size is None and Path(r["path"]).is_dir():
                size = sum(f.stat().st_size for f in Path(r["path"]).rglob("*") if f.is_file())
            version = info.get("version")
            checkpoints.append(dict(run_id=run_id, step=r["step"], path=r["path"], size_bytes=size,
                                    version=int(version) if version is not None else None, time=r["time"]))
        elif kind in ("alert", "event"):
            step = r["data"].get("step")
            row = dict(run_id=run_id, time=r["time"], step=step if isinstance(step, int) else None, kind=r["kind"],
                       message=r["message"], data=r["data"], uid=r.get("uid"))
            (alerts if kind == "alert" else events).append(row)
        elif kind == "samples":
            samples += [dict(run_id=run_id, step=r["step"], kind=r["kind"], position=i, group_id=s["group"],
                             seed=s["seed"], version=s["version"], reward=_real(s["reward"]),
                             advantage=_real(s["advantage"]), success=s["success"], turns=s["turns"],
                             tool_calls=s["tool_calls"], tool_errors=s["tool_errors"], prompt=s["prompt"],
                             text=s["text"], tokens=s["tokens"], images=s["images"], time=r["time"])
                        for i, s in enumerate(r["records"])]
            if r["keep"]:
                keep_from = max(keep_from or 0, r["step"] - r["keep"] + 1)
    if metrics:
        stmt = insert(Metric)
        conn.execute(stmt.on_conflict_do_update(index_elements=["run_id", "name", "step"],
                                                set_={"value": stmt.excluded.value, "time": stmt.excluded.time}),
                     metrics)
    if versions:
        # A version's row is the step that produced it: a step the breaker refused reports the same version again
        # (a later step: ignored); a resumed attempt replays the same step (updated); a rollback makes a new one.
        stmt = insert(PolicyVersion)
        conn.execute(stmt.on_conflict_do_update(
            index_elements=["run_id", "version"],
            set_={c: getattr(stmt.excluded, c) for c in ("step", "time", "reward_mean", "staleness_mean",
                                                        "staleness_max")},
            where=stmt.excluded.step <= PolicyVersion.__table__.c.step), versions)
    if checkpoints:
        stmt = insert(Checkpoint)
        conn.execute(stmt.on_conflict_do_update(
            index_elements=["run_id", "step"],
            set_={c: getattr(stmt.excluded, c) for c in ("path", "size_bytes", "version", "time")}), checkpoints)
    if samples:
        stmt = insert(Sample)
        conn.execute(stmt.on_conflict_do_update(
            index_elements=["run_id", "step", "kind", "position"],
            set_={c.name: getattr(stmt.excluded, c.name) for c in Sample.__table__.columns
                  if c.name not in ("id", "run_id", "step", "kind", "position")}), samples)
    if keep_from is not None:
        conn.execute(delete(Sample).where(Sample.run_id == run_id, Sample.step < keep_from, Sample.eval_id.is_(None)))
    for model, rows in ((Alert, alerts), (Event, events)):
        if rows:
            conn.execute(insert(model).on_conflict_do_nothing(index_elements=["uid"]), rows)
    if run_values:
        conn.execute(update(Run).where(Run.id == run_id).values(**run_values))
    attempt_values = {}
    if first_step is not None:  # the attempt's first step: 0 for a fresh start, else the checkpoint it resumed
        attempt_values["start_step"] = func.coalesce(Attempt.start_step, first_step)
    if heartbeat is not None:
        attempt_values["heartbeat_at"] = heartbeat
    if attempt_values:
        conn.execute(update(Attempt).where(Attempt.id == attempt_id).values(**attempt_values))


def replay_spools(engine: Engine, run_id: int, directory: Path) -> int:
    """Commit what dead workers of this run spooled but never committed, then delete their spools. Returns the
    number of records replayed. Call only when no worker of the run is alive."""
    count = 0
    for path in sorted(Path(directory).glob("spool-*.jsonl")):
        attempt_id = int(path.name.split("-")[1])
        records = read_spool(path)
        with engine.begin() as conn:
            write_records(conn, run_id, attempt_id, records)
        path.unlink()
        count += len(records)
    return count


def read_spool(path: Path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line torn by a crash of the machine (a killed process never tears one)
            continue
    return records


def _floats(values: dict) -> dict[str, float]:
    out = {}
    for k, v in values.items():
        try:
            out[k] = float(v)  # also numpy and 0-d torch scalars
        except (TypeError, ValueError):
            pass
    return out


def _real(v):
    """SQLite stores NaN as NULL: so NULL in a REAL column means NaN (±inf are stored as they are)."""
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def jsonable(o):
    return o.item() if hasattr(o, "item") else str(o)
