"""Sweeps: the REST API under /api/v1/sweeps (queue, list, read, stop, resume, delete) and the sweep page (its runs
as rows, a parallel-coordinates chart of the params against the score, the score against each param, links into
compare)."""
import json
import math
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Form, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse
from pydantic import ValidationError

from daemon.sweep_records import SweepConflict, SweepNotFound
from daemon.sweeps import SweepInvalid, SweepRequest

from .pages import check_csrf, guarded, render
from .rest import _problem, authenticated, known_query, records_of
from .schemas import BadRequest, Invalid, Out

SweepId = Annotated[int, Path(ge=1, le=2**62, description="the sweep's id")]


class SweepOut(Out):
    id: int
    name: str
    status: str
    method: str
    metric: str
    goal: str
    request: dict[str, Any]
    runs_total: int
    runs_done: int
    best: dict[str, Any] | None = None  # the best point so far: params, score
    warning: str | None = None  # e.g. no run has recorded its metric (a typo?): no scores
    last_error: str | None
    created_at: float
    finished_at: float | None
    points: list[dict[str, Any]] | None = None   # GET /sweeps/{id}: params, score (mean over seeds), runs; best first
    runs: list[dict[str, Any]] | None = None     # GET /sweeps/{id}: each run's params, seed, status, score


router = APIRouter(prefix="/api/v1", tags=["sweeps"], dependencies=[Depends(known_query), Depends(authenticated)],
                   responses={400: {"model": BadRequest, "description": "the body is not JSON"},
                              422: {"model": Invalid, "description": "invalid input; each error names its field"},
                              401: _problem("missing or wrong token"), 403: _problem("cross-site request")})
with_sweep = {404: _problem("no such sweep")}


def found(call, *args):
    try:
        return call(*args)
    except SweepNotFound as e:
        raise HTTPException(404, f"not found: {e.args[0]}") from None
    except SweepConflict as e:
        raise HTTPException(409, str(e)) from None


@router.post("/sweeps", status_code=201, response_model=SweepOut)
def create_sweep(request: Request, body: SweepRequest):
    """Validate the search space (every point a valid run config: 422 names the key and the value) and queue the
    sweep; the daemon creates its runs as ordinary queued runs, tagged with its name."""
    try:
        return records_of(request).queue_sweep(body)
    except SweepInvalid as e:
        raise RequestValidationError([{"type": "value_error", "loc": ("body", *e.loc), "msg": str(e)}]) from None


@router.get("/sweeps", response_model=list[SweepOut])
def list_sweeps(request: Request):
    """Newest first, each with its best point so far."""
    return records_of(request).list_sweeps()


@router.get("/sweeps/{sweep_id}", response_model=SweepOut, responses=with_sweep)
def get_sweep(request: Request, sweep_id: SweepId):
    """The sweep with its points and runs, best first (a point's score is the mean of its seeds' runs' scores)."""
    return found(records_of(request).get_sweep, sweep_id)


@router.post("/sweeps/{sweep_id}/stop", status_code=202, response_model=SweepOut, responses=with_sweep)
def stop_sweep(request: Request, sweep_id: SweepId):
    """No more runs; its queued runs stop at once, its active ones checkpoint and stop."""
    return found(records_of(request).stop_sweep, sweep_id)


@router.post("/sweeps/{sweep_id}/resume", status_code=202, response_model=SweepOut, responses=with_sweep)
def resume_sweep(request: Request, sweep_id: SweepId):
    """Its stopped runs continue (not those stopped early by its rule) and its missing points are created."""
    return found(records_of(request).resume_sweep, sweep_id)


@router.delete("/sweeps/{sweep_id}", status_code=204, responses={**with_sweep, 409: _problem("running: stop it")})
def delete_sweep(request: Request, sweep_id: SweepId):
    """Delete a sweep that is not running, and its runs (their records and directories)."""
    found(records_of(request).delete_sweep, sweep_id)
    return Response(status_code=204)


# ---- the page -------------------------------------------------------------------------------------------------------

pages = APIRouter(include_in_schema=False)
SORTS = ("point_score", "score", "status", "seed", "id")   # and any of the sweep's params


@pages.get("/sweeps")
@guarded
def sweeps_page(request: Request):
    return render(request, "sweeps.html", sweeps=request.app.state.records.list_sweeps())


@pages.get("/sweeps/new")
@guarded
def new_sweep_page(request: Request, run_id: Annotated[int | None, Query(ge=1)] = None):
    """The form that starts a sweep from a run's config: the keys and their ranges (JSON), the method."""
    config = {"env": "max_digit"}
    if run_id is not None:
        try:
            config = request.app.state.records.get_run(run_id)["config"]
        except KeyError:
            raise HTTPException(404, f"no run {run_id}") from None
    lr = config.get("algo", {}).get("lr", 3e-4)
    form = {"name": f"sweep-{run_id}" if run_id else "", "method": "grid", "metric": "eval_reward", "goal": "max",
            "runs": "", "seeds": "1", "config": json.dumps(config, indent=2),
            # 3 significant digits: lr / 3 of 3e-4 is 1e-4, not 9.999999999999999e-05
            "params": json.dumps({"algo.lr": {"values": [float(f"{v:.3g}") for v in (lr / 3, lr, lr * 3)]}}, indent=2)}
    return render(request, "sweep_new.html", form=form, error=None)


@pages.post("/sweeps/new")
@guarded
def start_from_form(request: Request, name: Annotated[str, Form()] = "", method: Annotated[str, Form()] = "grid",
                    metric: Annotated[str, Form()] = "eval_reward", goal: Annotated[str, Form()] = "max",
                    runs: Annotated[str, Form()] = "", seeds: Annotated[str, Form()] = "1",
                    params: Annotated[str, Form()] = "{}", config: Annotated[str, Form()] = "{}",
                    csrf_token: Annotated[str | None, Form()] = None):
    """Queue the sweep; a bad field comes back on the form, named (the 422 of the API, as a message)."""
    check_csrf(request, csrf_token)
    form = {"name": name, "method": method, "metric": metric, "goal": goal, "runs": runs, "seeds": seeds,
            "params": params, "config": config}
    try:
        body = {"name": name.strip(), "method": method, "metric": metric, "goal": goal, "seeds": int(seeds),
                "runs": int(runs) if runs.strip() else None}
        for field in ("params", "config"):
            try:
                body[field] = json.loads(form[field])
            except json.JSONDecodeError as e:
                raise SweepInvalid((field,), f"not JSON: {e}") from None
        sweep = request.app.state.records.queue_sweep(SweepRequest.model_validate(body))
    except SweepInvalid as e:
        return render(request, "sweep_new.html", status_code=422, form=form,
                      error=f"{'.'.join(map(str, e.loc))}: {e}")
    except ValidationError as e:
        return render(request, "sweep_new.html", status_code=422, form=form, error="; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()))
    except ValueError as e:  # seeds or runs not a number
        return render(request, "sweep_new.html", status_code=422, form=form, error=f"seeds/runs: {e}")
    return RedirectResponse(f"/sweeps/{sweep['id']}", status_code=303)


@pages.get("/sweeps/{sweep_id}")
@guarded
def sweep_page(request: Request, sweep_id: int, sort: Annotated[str, Query()] = "point_score",
               desc: bool | None = None):
    """The sweep's runs sorted by a column (`desc` descending; by default best first for the scores, else ascending),
    unscored runs last either way. While the sweep runs, the page polls itself (htmx) and swaps its live part."""
    try:
        sweep = request.app.state.records.get_sweep(sweep_id)
    except SweepNotFound:
        raise HTTPException(404, f"no sweep {sweep_id}") from None
    keys = list(sweep["request"]["params"])
    if sort not in SORTS + tuple(keys):
        raise HTTPException(400, f"sort must be one of {', '.join(SORTS + tuple(keys))}, not {sort!r}")
    if desc is None:
        desc = sort in ("score", "point_score") and sweep["goal"] == "max"
    value = (lambda r: r["params"][sort]) if sort in keys else (lambda r: r[sort])
    known = [r for r in sweep["runs"] if value(r) is not None]  # stable: a point's runs stay in seed order
    runs = sorted(known, key=lambda r: (not _numeric(value(r)), value(r) if _numeric(value(r)) else str(value(r))),
                  reverse=desc) + [
        r for r in sweep["runs"] if value(r) is None]
    return render(request, "sweep.html", sweep=sweep, keys=keys, runs=runs, sort=sort, desc=desc,
                  untrained_skipped=sweep["metric"].split("/")[-1].startswith("eval_")
                  and not sweep["request"].get("score_untrained"),
                  chart=parallel_coordinates(sweep, keys), scatters=scatters(sweep, keys))


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parallel_coordinates(sweep: dict, keys: list[str], width: int = 720, height: int = 260) -> dict:
    """An SVG's geometry: one vertical axis per param and one for the score, one polyline per run with a score
    (each axis placed by `_scale`), the best point's runs marked. Server-side: a static chart needs no script."""
    axes = keys + ["score"]
    params = sweep["request"]["params"]
    x = {a: 40 + i * (width - 80) / max(1, len(axes) - 1) for i, a in enumerate(axes)}
    scored = [r for r in sweep["runs"] if r["score"] is not None]
    place, ticks = {}, {}
    for a in axes:
        values = [r["score"] if a == "score" else r["params"][a] for r in scored]
        place[a], ticks[a] = _scale(values, a != "score" and _log_axis(params[a], values))
    top, span = 30, height - 60
    y = {a: lambda r, a=a: top + span * (1 - place[a](r["score"] if a == "score" else r["params"][a])) for a in axes}
    lines = [{"run": r["id"], "title": _title(r), "best": _is_best(sweep, r["sweep_point"]),
              "points": " ".join(f"{x[a]:.1f},{y[a](r):.1f}" for a in axes)} for r in scored]
    return {"width": width, "height": height, "axes": [{"name": a, "x": x[a], "ticks": [
        (top + span * (1 - t), label) for t, label in ticks[a]]} for a in axes], "lines": lines,
            "top": top, "bottom": top + span}


def scatters(sweep: dict, keys: list[str], width: int = 260, height: int = 190) -> list[dict]:
    """One SVG's geometry per param: the score against the param's value, a faint dot per scored run and a solid one
    per point (the mean over its seeds), the best point marked; both axes placed by `_scale`, as in the parallel
    coordinates."""
    params = sweep["request"]["params"]
    scored = [r for r in sweep["runs"] if r["score"] is not None]
    points = [p for p in sweep["points"] if p["score"] is not None]
    left, right, top, bottom = 44, width - 20, 8, height - 34   # the axes; the dots stay 10px inside them
    on_y, y_ticks = _scale([r["score"] for r in scored], False)

    def at(t_x, t_y):  # places along the axes (0..1) to pixels
        return round(left + 10 + (right - left - 20) * t_x, 1), round(bottom - 10 - (bottom - top - 20) * t_y, 1)
    charts = []
    for k in keys:
        values = [r["params"][k] for r in scored]
        log = _log_axis(params[k], values)
        on_x, x_ticks = _scale(values, log)
        charts.append({"name": k, "log": log, "width": width, "height": height, "left": left, "right": right,
                       "top": top, "bottom": bottom,
                       "runs": [{"run": r["id"], "title": _title(r), "best": _is_best(sweep, r["sweep_point"]),
                                 "xy": at(on_x(r["params"][k]), on_y(r["score"]))} for r in scored],
                       "points": [{"point": p["point"], "best": _is_best(sweep, p["point"]),
                                   "xy": at(on_x(p["params"][k]), on_y(p["score"]))} for p in points],
                       "x_ticks": [(at(t, 0)[0], label) for t, label in x_ticks],
                       "y_ticks": [(at(0, t)[1], label) for t, label in y_ticks]})
    return charts


def _title(run: dict) -> str:
    """What a run's line or dot says on hover: its name, its point's values, its score."""
    values = ", ".join(f"{k}={v:.3g}" if _numeric(v) else f"{k}={v}" for k, v in run["params"].items())
    return f"#{run['id']} {run['name']}: {values}, score {run['score']:.4g}"


def _is_best(sweep: dict, point: int) -> bool:
    return sweep["best"] is not None and point == sweep["best"]["point"]


def _log_axis(space: dict, values: list) -> bool:
    """A param's axis is logarithmic where its space draws log-uniformly or its values span more than two decades."""
    if not values or not all(_numeric(v) and v > 0 for v in values):
        return False
    return bool(space.get("log")) or max(values) > 100 * min(values)


def _scale(values: list, log: bool) -> tuple:
    """Where a value sits along an axis (0 the low end, 1 the high end) and the axis's ticks as (place, label):
    numbers linearly (or by their log), other values evenly in their sorted order."""
    if values and all(_numeric(v) for v in values):
        f = math.log if log else float
        lo, hi = min(map(f, values)), max(map(f, values))
        return (lambda v: 0.5 if hi == lo else (f(v) - lo) / (hi - lo),
                [(0.0, f"{min(values):.3g}"), (1.0, f"{max(values):.3g}")])
    order = sorted({repr(v) for v in values})

    def place(v):
        return 0.5 if len(order) < 2 else order.index(repr(v)) / (len(order) - 1)
    return place, [(place(v), str(v)) for v in dict.fromkeys(values)]
