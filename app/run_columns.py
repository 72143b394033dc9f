"""The runs table's chosen columns (the URL's `cols`): any config key (`algo.lr`) or a metric's last, best (highest)
or lowest value (`pass_rate.last`, `eval_reward.best`, `policy_loss.min`); each run's values, read for the listed
runs only, in one query per column (MAX_COLUMNS at most). A config key must be one of the config's (did you mean)."""
import difflib
import functools

from sqlalchemy import bindparam, func, select
from sqlalchemy.engine import Engine

from daemon.models import Metric, MetricBucket, Run
from daemon.trackers import flat_config
from molt_engine.config import RunConfig

SUMMARIES = ("last", "best", "min")
MAX_COLUMNS = 8  # each is a query per page of runs (and the page is polled every 2 s)
RUNS = bindparam("runs", expanding=True)
LAST_STEP = (select(Metric.run_id, func.max(Metric.step).label("step"))
             .where(Metric.run_id.in_(RUNS), Metric.name == bindparam("name")).group_by(Metric.run_id).subquery())
QUERIES = {
    "last": select(Metric.run_id, Metric.value).join(LAST_STEP, (Metric.run_id == LAST_STEP.c.run_id)
                                                     & (Metric.step == LAST_STEP.c.step))
            .where(Metric.name == bindparam("name")),
    # the series' summary rows (per 512 steps: its minimum and maximum) hold the extremes: no scan of every row
    "best": select(MetricBucket.run_id, func.max(MetricBucket.hi_value))
            .where(MetricBucket.run_id.in_(RUNS), MetricBucket.name == bindparam("name"), MetricBucket.level == 1)
            .group_by(MetricBucket.run_id),
    "min": select(MetricBucket.run_id, func.min(MetricBucket.lo_value))
           .where(MetricBucket.run_id.in_(RUNS), MetricBucket.name == bindparam("name"), MetricBucket.level == 1)
           .group_by(MetricBucket.run_id),
}


@functools.cache
def config_keys() -> tuple[str, ...]:
    """Every key of a run's config (each run's config holds every default), as the columns name them."""
    return tuple(sorted(flat_config(RunConfig.model_validate({"env": "max_digit"}).model_dump(mode="json"))))


def parse_columns(text: str | None) -> tuple[list[str], str | None]:
    """The columns asked for (comma-separated), and an error naming a bad one (then none are shown). A column that
    is not a metric summary must be a config key, or lie under one that is free-form (env_args, model.lora)."""
    columns = list(dict.fromkeys(c.strip() for c in (text or "").split(",") if c.strip()))
    if len(columns) > MAX_COLUMNS:
        return [], f"at most {MAX_COLUMNS} extra columns, not {len(columns)}"
    keys = config_keys()
    for c in columns:
        if not all(part.replace("_", "").replace("-", "").isalnum() for part in c.replace("/", ".").split(".")):
            return [], (f"column {c!r}: a config key such as algo.lr, or a metric with .last, .best or .min "
                        f"(e.g. pass_rate.best)")
        name, _, summary = c.rpartition(".")
        if (summary in SUMMARIES and name) or c in keys or any(c.startswith(f"{k}.") for k in keys):
            continue
        # a metric's summary by another name (grad_norm.max is its .best), else the nearest config key
        alias = {"max": "best", "highest": "best", "lowest": "min", "latest": "last", "final": "last"}.get(summary)
        near = [f"{name}.{alias}"] if alias and name else difflib.get_close_matches(c, keys, n=1, cutoff=0.5)
        return [], (f"unknown column {c!r}: not a config key{f', did you mean {near[0]!r}' if near else ''}? "
                    f"(a metric needs .last, .best or .min)")
    return columns, None


def column_values(engine: Engine, columns: list[str], run_ids: list[int]) -> dict[str, dict[int, object]]:
    """column -> run id -> value (absent: the run has none)."""
    out = {}
    with engine.connect() as c:
        for column in columns:
            name, _, summary = column.rpartition(".")
            if summary in SUMMARIES and name:
                rows = c.execute(QUERIES[summary], {"runs": run_ids, "name": name})
            else:
                rows = c.execute(select(Run.id, func.json_extract(Run.config, f"$.{column}")).where(Run.id.in_(RUNS)),
                                 {"runs": run_ids})
            out[column] = {run_id: value for run_id, value in rows if value is not None}
    return out
