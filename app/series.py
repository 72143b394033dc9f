"""Metric series for charts and the REST API: cached per (run, name) as numpy arrays, downsampled by min/max buckets.

Why a cache: SQLite needs ~0.5 s to scan a 1,000,000-point series (an index lookup per row), far above what a chart
request may cost. A series is read once, then only its new steps (an index range scan), so a repeated request for a
long series costs milliseconds. Rows of steps already cached only change when a run resumes or rolls back (the
engine replays the steps after its checkpoint); such an event drops the run's cached series.

A long downsampled series does not need that read: the series' summary (daemon.models.MetricBucket: per 64 or 512
steps, the rows holding the min, the max and the first NaN) has the same spikes and NaN in 64 or 512 times fewer
rows, so even the first request for it, with nothing cached, costs milliseconds."""
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from sqlalchemy import bindparam, func, null, select
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection, Engine

from daemon.records import extremes
from daemon.models import BUCKET_SHIFTS, Event, Metric, MetricBucket

REPLAY_EVENTS = ("resumed", "rollback")   # after these the engine rewrites steps that were already recorded
NONFINITE_NAMES = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


class PlainQuery:
    """A query built from the records' models, compiled once; its rows come as plain tuples from the DBAPI cursor,
    which numpy converts ~20x faster than SQLAlchemy's Row objects."""

    def __init__(self, query):
        compiled = query.compile(dialect=sqlite.dialect())
        self.sql, self.params = str(compiled), compiled.positiontup

    def rows(self, conn: Connection, **params) -> list[tuple]:
        cursor = conn.connection.cursor()
        try:
            return cursor.execute(self.sql, [params[name] for name in self.params]).fetchall()
        finally:
            cursor.close()


# The queries, built once (each call then costs microseconds, not the milliseconds of building a statement)
THE_SERIES = (Metric.run_id == bindparam("run_id"), Metric.name == bindparam("name"))
SERIES_AFTER = PlainQuery(select(Metric.step, Metric.value, Metric.time)
                          .where(*THE_SERIES, Metric.step > bindparam("after")).order_by(Metric.step))
SERIES_RANGE = PlainQuery(select(Metric.step, Metric.value, Metric.time)
                          .where(*THE_SERIES, Metric.step >= bindparam("start"), Metric.step < bindparam("end")))
REPLAY_MARK = select(func.coalesce(func.max(Event.id), 0)).where(Event.run_id == bindparam("run_id"),
                                                                 Event.kind.in_(REPLAY_EVENTS))
THE_BUCKETS = (MetricBucket.run_id == bindparam("run_id"), MetricBucket.name == bindparam("name"),
               MetricBucket.level == bindparam("level"), MetricBucket.bucket >= bindparam("first"))
BUCKET_COUNT = select(func.count(), func.coalesce(func.sum(MetricBucket.n), 0)).where(*THE_BUCKETS)
BUCKET_ROWS = PlainQuery(select(MetricBucket.lo_step, MetricBucket.lo_value, MetricBucket.lo_time,
                                MetricBucket.hi_step, MetricBucket.hi_value, MetricBucket.hi_time,
                                MetricBucket.nan_step, null(), MetricBucket.nan_time).where(*THE_BUCKETS))
# A skip-scan (one index seek per name) instead of DISTINCT, which would read every row of the run
_names = (select(func.min(Metric.name).label("name")).where(Metric.run_id == bindparam("run_id"))
          .cte("n", recursive=True))
_names = _names.union_all(select(select(func.min(Metric.name))
                                 .where(Metric.run_id == bindparam("run_id"), Metric.name > _names.c.name)
                                 .scalar_subquery()).where(_names.c.name.is_not(None)))
METRIC_NAMES = select(_names.c.name).where(_names.c.name.is_not(None))


@dataclass
class Series:
    steps: np.ndarray    # int64, ascending
    values: np.ndarray   # float64; NaN where the engine reported NaN (SQLite stores it as NULL)
    times: np.ndarray    # float64 unix seconds
    replay_mark: int     # the id of the run's latest replay event when this was read

    def __len__(self):
        return len(self.steps)


class SeriesCache:
    """Thread-safe; least recently used series are dropped beyond `max_points` points in all."""

    def __init__(self, engine: Engine, max_points: int = 10_000_000):
        self.engine, self.max_points = engine, max_points
        self._series: OrderedDict[tuple[int, str], Series] = OrderedDict()
        self._lock = threading.Lock()

    def names(self, run_id: int) -> list[str]:
        with self.engine.connect() as c:
            return metric_names(c, run_id)

    def get(self, run_id: int, name: str) -> Series:
        with self._lock, self.engine.connect() as c:
            mark = c.scalar(REPLAY_MARK, {"run_id": run_id})
            cached = self._series.pop((run_id, name), None)
            if cached is None or cached.replay_mark != mark:
                cached = Series(np.zeros(0, np.int64), np.zeros(0), np.zeros(0), mark)
            after = int(cached.steps[-1]) if len(cached) else -(2 ** 62)
            rows = SERIES_AFTER.rows(c, run_id=run_id, name=name, after=after)
            if rows:
                table = np.array(rows, dtype=np.float64)  # NULL (None) becomes NaN, which is what it means
                cached = Series(np.concatenate([cached.steps, table[:, 0].astype(np.int64)]),
                                np.concatenate([cached.values, table[:, 1]]),
                                np.concatenate([cached.times, table[:, 2]]), mark)
            self._series[(run_id, name)] = cached
            self._evict()
            return cached

    def downsampled(self, run_id: int, name: str, after_step: int | None = None,
                    max_points: int | None = None) -> tuple[Series, bool]:
        """downsample() of the series, and whether it dropped points. From the coarsest summary level whose extremes
        still outnumber `max_points` (they are the series' own min, max and NaN rows, so the same spikes and NaN
        survive), else (at most ~32 x max_points rows) from the full series."""
        if max_points:
            with self.engine.connect() as c:
                for level in reversed(range(len(BUCKET_SHIFTS))):
                    extremes = bucket_extremes(c, run_id, name, level, after_step, enough=max_points)
                    if extremes is not None:
                        return downsample(extremes, None, max_points), True
        full = self.get(run_id, name)
        part = downsample(full, after_step, max_points)
        return part, len(part) < len(downsample(full, after_step))

    def forget(self, run_id: int):
        """Drop a deleted run's series: SQLite may give its id to the next run."""
        with self._lock:
            for key in [k for k in self._series if k[0] == run_id]:
                del self._series[key]

    def _evict(self):
        total = sum(len(s) for s in self._series.values())
        while total > self.max_points and len(self._series) > 1:
            _, old = self._series.popitem(last=False)
            total -= len(old)


def metric_names(conn: Connection, run_id: int) -> list[str]:
    return list(conn.scalars(METRIC_NAMES, {"run_id": run_id}))


def bucket_extremes(conn, run_id: int, name: str, level: int, after_step: int | None = None,
                    enough: int = 0) -> Series | None:
    """The steps after `after_step` that hold a minimum, a maximum or a first NaN of their bucket at summary `level`
    (and every step of the bucket that `after_step` cuts). None if these, or the rows of the series after the cut
    bucket, would be at most `enough`."""
    shift = BUCKET_SHIFTS[level]
    start = -(2 ** 62) if after_step is None else after_step + 1
    first = start >> shift
    cut = start > first << shift
    buckets = {"run_id": run_id, "name": name, "level": level, "first": first + cut}
    # a bucket gives 1 to 3 points, mostly 2 (its min and max): counting first keeps a too-coarse level unread, and
    # a series of at most `enough` rows is better read whole
    count, rows = conn.execute(BUCKET_COUNT, buckets).one()
    if 2 * count <= enough or rows <= enough:
        return None
    head = []
    if cut:
        head = SERIES_RANGE.rows(conn, run_id=run_id, name=name, start=start, end=(first + 1) << shift)
    rows = BUCKET_ROWS.rows(conn, **buckets)
    # each row as 3 (step, value, time) triples; NULL (None) becomes NaN: a bucket without a min/max/NaN row (the
    # step), or the value of the NaN row, which is what it means
    table = np.concatenate([np.array(head, dtype=np.float64).reshape(-1, 3),
                            np.array(rows, dtype=np.float64).reshape(-1, 3)])
    table = table[~np.isnan(table[:, 0])]
    steps, index = np.unique(table[:, 0], return_index=True)  # sorted; a bucket's single row is its min and max
    return Series(steps.astype(np.int64), table[index, 1], table[index, 2], 0)


def downsample(series: Series, after_step: int | None = None, max_points: int | None = None) -> Series:
    """The steps after `after_step`, reduced to at most `max_points` points by the records' one rule
    (daemon.records.extremes: each bucket's min, max and first NaN)."""
    lo = int(np.searchsorted(series.steps, after_step, side="right")) if after_step is not None else 0
    idx = lo + extremes(series.values[lo:], max_points)
    return Series(series.steps[idx], series.values[idx], series.times[idx], series.replay_mark)


def encode_values(values: np.ndarray) -> list:
    """JSON has no NaN or infinity: those become the strings "NaN", "Infinity", "-Infinity" (JavaScript's Number()
    and Python's float() both read them back)."""
    out = values.tolist()
    if not np.isfinite(values).all():
        out = [v if math.isfinite(v) else NONFINITE_NAMES[str(v)] for v in out]
    return out
