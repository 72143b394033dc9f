"""Sweeps, the pure part: a search space over dotted config keys, its points (grid, seeded random, TPE), scores, the
median early-stopping rule. No database here (sweep_records.py and sweep_tick.py use these)."""
import itertools
import math
import random
import statistics
from collections import Counter
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from molt_engine.config import RunConfig, config_errors, untrained_lora

MAX_POINTS = 1000   # a grid larger than this is almost surely a mistake (and every point is validated up front)


class Param(BaseModel):
    """One key's range: `values` (a list to choose from; the only form a grid takes), or `min` and `max` (uniform;
    `log` for a log-uniform draw, `int` for whole numbers: the ends rounded, by every method and the check alike)."""
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: `false` is not 0
    values: list[Any] | None = None
    min: float | None = None
    max: float | None = None
    log: bool = False
    int: bool = False

    @model_validator(mode="after")
    def _one_form(self):
        if (self.values is None) == (self.min is None or self.max is None):
            raise ValueError("give either values, or min and max")
        if self.values is not None and not self.values:
            raise ValueError("empty range: values is empty")
        if self.values is None and not self.min < self.max:
            raise ValueError(f"empty range: min ({self.min}) must be below max ({self.max})")
        if self.log and self.values is None and self.min <= 0:
            raise ValueError("a log range needs min > 0")
        if self.log and self.int and self.values is None and _number(self, self.min) < 1:
            raise ValueError(f"a log int range needs min >= 1 (min {self.min} rounds to {_number(self, self.min)})")
        return self


class EarlyStop(BaseModel):
    """The median rule: at each of `at_steps`, a run whose score so far is worse than the median of its peers' (the
    sweep's other runs that reached that step; at least `min_peers`) by more than `margin` is stopped."""
    model_config = ConfigDict(extra="forbid", strict=True)
    rule: Literal["median"] = "median"
    at_steps: list[Annotated[int, Field(ge=1)]] = Field(min_length=1)
    min_peers: int = Field(2, ge=1)
    margin: float = Field(0.0, ge=0)


class SweepRequest(BaseModel):
    """The body of POST /api/v1/sweeps, and the YAML file of `molt sweep`."""
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [{
        "name": "lr-x-group", "config": {"env": "max_digit", "loop": {"steps": 40}},
        "params": {"algo.lr": {"values": [3e-4, 1e-3]}, "loop.group_size": {"values": [4, 8]}},
        "method": "grid", "seeds": 2}]})
    name: str = Field(min_length=1, max_length=64, pattern=r"^\S+$", description="also the tag of its runs")
    config: dict = Field(description="the base run config; each point sets its params on a copy")
    params: dict[str, Param] = Field(min_length=1, description="dotted config keys (algo.lr) and their ranges")
    method: Literal["grid", "random", "tpe"] = "grid"
    metric: str = Field("eval_reward", min_length=1, description="any recorded metric")
    goal: Literal["max", "min"] = "max"
    score: Literal["best", "last", "mean"] = "best"
    last_n: int = Field(5, ge=1, description="score mean: over the last N values")
    score_untrained: bool = Field(False, description="an eval_ metric: score its value at step 0 too (the policy "
                                                     "before any training)")
    runs: int | None = Field(None, ge=1, le=MAX_POINTS, description="points to sample (random, tpe)")
    seeds: int | list[Annotated[int, Field(ge=0)]] = Field(1, description="seeds per point: a count (the base "
                                                                          "seed, +1, ...) or a list")
    seed: int = Field(0, ge=0, description="the sampler's seed (random, tpe)")
    startup_points: int = Field(10, ge=1, description="tpe: its first N points are drawn at random, as a start "
                                                      "(Optuna's n_startup_trials)")
    early_stop: EarlyStop | None = None
    max_restarts: int = Field(3, ge=0, le=100)

    @model_validator(mode="after")
    def _method_fits(self):
        if self.method == "grid" and (ranges := [k for k, p in self.params.items() if p.values is None]):
            raise ValueError(f"a grid needs values for each key, not min/max: {', '.join(ranges)}")
        if self.method != "grid" and self.runs is None:
            raise ValueError(f"method {self.method} needs runs (how many points)")
        if isinstance(self.seeds, int) and not 1 <= self.seeds <= 100:
            raise ValueError("seeds must be between 1 and 100")
        if "seed" in self.params:  # each run's seed comes from `seeds`: it would overwrite this key's values
            raise ValueError("params: seed is set by seeds (a count, or a list such as [0, 7]), not by params")
        return self


class SweepInvalid(ValueError):
    """A search space that cannot run; `loc` is its place in the request (("params", "algo.lr"))."""

    def __init__(self, loc: tuple, message: str):
        super().__init__(message)
        self.loc = loc


def with_params(config: dict, params: dict[str, Any]) -> dict:
    """A copy of the config with each dotted key set (missing sections created)."""
    out = _copy(config)
    for key, value in params.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SweepInvalid(("params", key), f"{key}: {part} is not a section")
        node[last] = value
    return out


def _copy(value):
    return {k: _copy(v) for k, v in value.items()} if isinstance(value, dict) else value


def run_config(config: dict, params: dict[str, Any], loc: tuple = ("params",)) -> dict:
    """The validated run config of one point, every default filled in; SweepInvalid names the key and value."""
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items())
    try:
        checked = RunConfig.model_validate(with_params(config, params))
    except ValidationError as e:
        lines = config_errors(e)  # the key named in a message, else the only key of the point
        key = next((k for k in params if any(k in line for line in lines)), None if len(params) != 1 else [*params][0])
        raise SweepInvalid(loc + ((key,) if key else ()),
                           f"{shown or 'the base config'}: {'; '.join(lines)}") from None
    if problem := untrained_lora(checked):
        key = next((k for k in params if k.startswith("model.")), None)
        raise SweepInvalid(loc + ((key,) if key else ()), f"{shown or 'the base config'}: {problem}")
    return checked.model_dump(mode="json")


def check(request: SweepRequest) -> list[dict]:
    """Validate the space before anything runs, and return its points known up front (all of a grid's or a random
    sweep's; none of TPE's, which come one by one): the base config, each key's every value and both ends of its
    range alone, then every sampled point. Raises SweepInvalid naming the key and value."""
    run_config(request.config, {}, ("config",))
    for seed in seeds_of(request):
        run_config(request.config, {"seed": seed}, ("seeds",))
    for key, p in request.params.items():
        for value in p.values if p.values is not None else (_number(p, p.min), _number(p, p.max)):
            run_config(request.config, {key: value})
    points = grid(request) if request.method == "grid" else sample(request) if request.method == "random" else []
    for point in points + ([suggest(request, [])] if request.method == "tpe" else []):  # tpe: Optuna is there
        run_config(request.config, point)
    return points


def grid(request: SweepRequest) -> list[dict]:
    keys = list(request.params)
    size = math.prod(len(p.values) for p in request.params.values())
    if size > MAX_POINTS:
        raise SweepInvalid(("params",), f"the grid has {size} points; at most {MAX_POINTS}")
    return [dict(zip(keys, combo)) for combo in itertools.product(*(request.params[k].values for k in keys))]


def sample(request: SweepRequest) -> list[dict]:
    """`runs` points drawn with the sweep's seed: the same request always samples the same points."""
    rng = random.Random(request.seed)
    return [{key: _draw(rng, p) for key, p in request.params.items()} for _ in range(request.runs)]


def _draw(rng: random.Random, p: Param):
    if p.values is not None:
        return rng.choice(p.values)
    value = math.exp(rng.uniform(math.log(p.min), math.log(p.max))) if p.log else rng.uniform(p.min, p.max)
    return _number(p, value)


def _number(p: Param, value: float):
    return int(round(value)) if p.int else value


def suggest(request: SweepRequest, done: list[tuple[dict, float | None]]) -> dict:
    """TPE's next point (Optuna, the `sweeps` extra, imported only here), given the points so far and their scores
    (None: not scored yet, or no value). Rebuilt from the records each time: nothing lives in the daemon's memory."""
    try:
        import optuna
    except ImportError:
        raise SweepInvalid(("method",), "method tpe needs Optuna: pip install 'molt-studio[sweeps]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:  # Optuna's own rules refuse what ours let through: a sweep's error, never the daemon's or a 500
        dists = {key: (optuna.distributions.CategoricalDistribution(p.values) if p.values is not None
                       else optuna.distributions.IntDistribution(_number(p, p.min), _number(p, p.max), log=p.log)
                       if p.int else optuna.distributions.FloatDistribution(p.min, p.max, log=p.log))
                 for key, p in request.params.items()}
        study = optuna.create_study(direction="maximize" if request.goal == "max" else "minimize",
                                    sampler=optuna.samplers.TPESampler(seed=request.seed + len(done),
                                                                       n_startup_trials=request.startup_points))
        for params, value in done:
            finished = value is not None and math.isfinite(value)
            study.add_trial(optuna.trial.create_trial(
                params=params, distributions=dists, value=value if finished else None,
                state=optuna.trial.TrialState.COMPLETE if finished else optuna.trial.TrialState.RUNNING))
        return study.ask(dists).params
    except ValueError as e:
        raise SweepInvalid(("params",), f"Optuna refuses the space: {e}") from None


RUN_NAME_MAX = 80   # a run's name in a table cell: its sweep (at most 64), its values (cut beyond this), its seed


def run_names(sweep: str, points: list[dict]) -> list[str]:
    """Each point's run name, to which its run adds ` s{seed}`: the sweep and the point's values, `lr-ux lr=3e-4`. A key
    is its last dotted part where no other key of the sweep shares it; floats keep 3 significant digits; a long name
    is cut (with …). Points whose values read alike get their index (`p3`): no two names of a sweep are the same."""
    keys = list(dict.fromkeys(k for point in points for k in point))
    lasts = Counter(k.rsplit(".", 1)[-1] for k in keys)
    short = {k: k.rsplit(".", 1)[-1] if lasts[k.rsplit(".", 1)[-1]] == 1 else k for k in keys}
    labels = [" ".join(f"{short[k]}={_value(v)}" for k, v in point.items()) for point in points]
    seen = Counter(labels)
    room = max(RUN_NAME_MAX - len(f"{sweep}  s0000"), 8)  # the sweep, a space, the values, the seed
    names = []
    for index, label in enumerate(labels):
        label += f" p{index}" if seen[label] > 1 else ""
        names.append(f"{sweep} {label if len(label) <= room else label[:room - 1] + '…'}")
    return names


def _value(v) -> str:
    """A value short: 3e-4 rather than 0.0003 or 0.00030000000000000003; 0.01 rather than 1e-2."""
    if isinstance(v, bool) or not isinstance(v, float):
        return str(v).lower() if isinstance(v, bool) else str(v).replace(" ", "")
    if not math.isfinite(v):
        return str(v)
    fixed = f"{v:.3g}"
    mantissa, exponent = f"{v:.2e}".split("e")
    sci = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return sci if "e" in fixed or len(sci) < len(fixed) else fixed


def seeds_of(request: SweepRequest) -> list[int]:
    base = request.config.get("seed", RunConfig.model_fields["seed"].default)
    return [base + i for i in range(request.seeds)] if isinstance(request.seeds, int) else list(request.seeds)


def score(values: list[float | None], rule: str, goal: str, last_n: int = 5) -> float | None:
    """A run's score from its metric's values in step order (NaN/None skipped): best, last, or mean of the last N."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return None
    if rule == "best":
        return max(values) if goal == "max" else min(values)
    return values[-1] if rule == "last" else statistics.fmean(values[-last_n:])


def point_score(run_scores: list[float | None]) -> float | None:
    """A point's score: the mean over its seeds' runs that have one."""
    scored = [v for v in run_scores if v is not None]
    return statistics.fmean(scored) if scored else None


def ranked(points: list[dict], goal: str) -> list[dict]:
    """Points (each with a `score`), best first; unscored last."""
    sign = -1 if goal == "max" else 1
    return sorted(points, key=lambda p: (p["score"] is None, sign * (p["score"] or 0.0)))


def behind_median(value: float, peers: list[float], goal: str, margin: float = 0.0) -> float | None:
    """The median rule: the peers' median if `value` is worse than it by more than `margin`, else None. The best
    of the group is never behind: the median of the others cannot be better than the best."""
    median = statistics.median(peers)
    worse = value < median - margin if goal == "max" else value > median + margin
    return median if worse else None
