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
from sqlalchemy.engine import Engine

from daemon.models import BUCKET_SHIFTS

REPLAY_EVENTS = ("resumed", "rollback")   # after these the engine rewrites steps that were already recorded
NONFINITE_NAMES = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


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
            mark = c.exec_driver_sql("SELECT coalesce(max(id), 0) FROM event WHERE run_id = ? AND kind IN (?, ?)",
                                     (run_id, *REPLAY_EVENTS)).scalar()
            cached = self._series.pop((run_id, name), None)
            if cached is None or cached.replay_mark != mark:
                cached = Series(np.zeros(0, np.int64), np.zeros(0), np.zeros(0), mark)
            after = int(cached.steps[-1]) if len(cached) else -(2 ** 62)
            # the DBAPI cursor: plain tuples, which numpy converts ~50x faster than SQLAlchemy's Row objects
            cursor = c.connection.cursor()
            rows = cursor.execute("SELECT step, value, time FROM metric WHERE run_id = ? AND name = ? AND step > ? "
                                  "ORDER BY step", (run_id, name, after)).fetchall()
            cursor.close()
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

    def drop_run(self, run_id: int):
        with self._lock:
            for key in [k for k in self._series if k[0] == run_id]:
                del self._series[key]

    def _evict(self):
        total = sum(len(s) for s in self._series.values())
        while total > self.max_points and len(self._series) > 1:
            _, old = self._series.popitem(last=False)
            total -= len(old)


def metric_names(conn, run_id: int) -> list[str]:
    """The run's metric names. A skip-scan (one index seek per name) instead of DISTINCT, which would read every
    row of the run."""
    sql = ("WITH RECURSIVE n(name) AS (SELECT min(name) FROM metric WHERE run_id = ?1 "
           "UNION ALL SELECT (SELECT min(name) FROM metric WHERE run_id = ?1 AND name > n.name) FROM n "
           "WHERE n.name IS NOT NULL) SELECT name FROM n WHERE name IS NOT NULL")
    return [r[0] for r in conn.exec_driver_sql(sql, (run_id,))]


def bucket_extremes(conn, run_id: int, name: str, level: int, after_step: int | None = None,
                    enough: int = 0) -> Series | None:
    """The steps after `after_step` that hold a minimum, a maximum or a first NaN of their bucket at summary `level`
    (and every step of the bucket that `after_step` cuts). None if these, or the rows of the series after the cut
    bucket, would be at most `enough`."""
    shift = BUCKET_SHIFTS[level]
    start = -(2 ** 62) if after_step is None else after_step + 1
    first = start >> shift
    cut = start > first << shift
    cursor = conn.connection.cursor()
    where = "FROM metric_bucket WHERE run_id = ? AND name = ? AND level = ? AND bucket >= ?"
    args = (run_id, name, level, first + cut)
    # a bucket gives 1 to 3 points, mostly 2 (its min and max): counting first keeps a too-coarse level unread, and
    # a series of at most `enough` rows is better read whole
    buckets, rows = cursor.execute(f"SELECT count(*), coalesce(sum(n), 0) {where}", args).fetchone()
    if 2 * buckets <= enough or rows <= enough:
        cursor.close()
        return None
    head = []
    if cut:
        head = cursor.execute("SELECT step, value, time FROM metric WHERE run_id = ? AND name = ? AND step >= ? "
                              "AND step < ?", (run_id, name, start, (first + 1) << shift)).fetchall()
    rows = cursor.execute(f"SELECT lo_step, lo_value, lo_time, hi_step, hi_value, hi_time, nan_step, NULL, nan_time "
                          f"{where}", args).fetchall()
    cursor.close()
    # each row as 3 (step, value, time) triples; NULL (None) becomes NaN: a bucket without a min/max/NaN row (the
    # step), or the value of the NaN row, which is what it means
    table = np.concatenate([np.array(head, dtype=np.float64).reshape(-1, 3),
                            np.array(rows, dtype=np.float64).reshape(-1, 3)])
    table = table[~np.isnan(table[:, 0])]
    steps, index = np.unique(table[:, 0], return_index=True)  # sorted; a bucket's single row is its min and max
    return Series(steps.astype(np.int64), table[index, 1], table[index, 2], 0)


def downsample(series: Series, after_step: int | None = None, max_points: int | None = None) -> Series:
    """The steps after `after_step`, reduced to at most `max_points` points: the range is cut into equal buckets and
    each keeps its minimum and maximum (a spike never disappears) and its first NaN if it has one (a NaN is never
    averaged or dropped away). ±inf are values like any other: a max keeps +inf."""
    lo = int(np.searchsorted(series.steps, after_step, side="right")) if after_step is not None else 0
    steps, values, times = series.steps[lo:], series.values[lo:], series.times[lo:]
    n = len(steps)
    if not max_points or n <= max_points:
        return Series(steps, values, times, series.replay_mark)
    nan = np.isnan(values)
    per_bucket = 3 if nan.any() else 2
    size = math.ceil(n / max(1, max_points // per_bucket))
    buckets = math.ceil(n / size)
    pad = buckets * size - n
    # NaN is replaced so that argmin/argmax see only real values; the padding can never win (it comes last)
    low = np.concatenate([np.where(nan, np.inf, values), np.full(pad, np.inf)]).reshape(buckets, size)
    high = np.concatenate([np.where(nan, -np.inf, values), np.full(pad, -np.inf)]).reshape(buckets, size)
    offsets = np.arange(buckets) * size
    keep = [offsets + low.argmin(axis=1), offsets + high.argmax(axis=1)]
    if per_bucket == 3:
        nans = np.concatenate([nan, np.zeros(pad, bool)]).reshape(buckets, size)
        has = nans.any(axis=1)
        keep.append((offsets + nans.argmax(axis=1))[has])
    idx = np.unique(np.concatenate(keep))
    return Series(steps[idx], values[idx], times[idx], series.replay_mark)


def encode_values(values: np.ndarray) -> list:
    """JSON has no NaN or infinity: those become the strings "NaN", "Infinity", "-Infinity" (JavaScript's Number()
    and Python's float() both read them back)."""
    out = values.tolist()
    if not np.isfinite(values).all():
        out = [v if math.isfinite(v) else NONFINITE_NAMES[str(v)] for v in out]
    return out
