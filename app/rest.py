"""The REST API under /api/v1 (documented at /docs): JSON in and out, the token required everywhere but /health."""
import asyncio
import csv
import io
import math
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from daemon.api import Conflict, InvalidConfig, RunNotFound
from daemon.models import STATUSES, TERMINAL
from molt_engine import RunConfig

from .series import encode_values

# A metric value: a number, or one of the strings JSON needs for NaN and the infinities (see series.py).
Number = Annotated[float, WithJsonSchema({"anyOf": [{"type": "number"},
                                                    {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]}]})]
RunId = Annotated[int, Path(ge=1, le=2**62, description="the run's id")]


class Out(BaseModel):
    # ser_json_inf_nan: a NaN/inf reaching a response becomes "NaN"/"Infinity" instead of breaking the JSON
    model_config = ConfigDict(ser_json_inf_nan="strings")


class Health(Out):
    status: Literal["ok"]
    version: str
    daemon: dict[str, Any]
    time: float


class EnvInfo(Out):
    name: str
    description: str
    max_turns: int
    max_tokens: int
    source: str | None = Field(description="the file of a user's env (from --envs); null for a built-in one")
    chat: bool = Field(False, description="speaks chat messages through the policy's chat template (needs one)")
    tools: list[str] = Field(default_factory=list, description="the tools a chat env's policy calls natively")


class RunCreate(BaseModel):
    # strict: `false` must not become 0; extra=forbid: a misspelt key is an error, not ignored
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"examples": [
        {"name": "first", "config": {"env": "max_digit", "model": {"preset": "tiny-dense"}, "loop": {"steps": 60},
                                     "seed": 0}, "tags": ["demo"]}]})
    name: str | None = Field(None, min_length=1, max_length=200, pattern=r"\S")
    config: RunConfig = Field(description="the run config (molt_engine/config.py); defaults fill the rest")
    tags: list[Annotated[str, Field(min_length=1, max_length=64, pattern=r"\S")]] = Field(default_factory=list,
                                                                                            max_length=50)
    max_restarts: int = Field(3, ge=0, le=100, description="automatic restarts from the latest checkpoint")


class RunOut(Out):
    id: int
    name: str
    status: Literal[STATUSES]
    config: dict[str, Any]
    tags: list[str]
    step: int
    total_steps: int
    version: int
    reward: Number | None
    restarts: int
    retries: int
    max_restarts: int
    pid: int | None
    last_error: str | None
    summary: dict[str, Any] | None
    alerts_open: int
    created_at: float
    started_at: float | None
    finished_at: float | None
    next_start_at: float | None


class SeriesOut(Out):
    step: list[int]
    value: list[Number]
    time: list[float]


class MetricsOut(Out):
    run_id: int
    names: list[str] = Field(description="every metric name the run has recorded")
    series: dict[str, SeriesOut]
    downsampled: bool = Field(description="true when some series had more than max_points points")


class AlertOut(Out):
    id: int
    run_id: int
    time: float
    step: int | None
    kind: str
    message: str
    data: dict[str, Any]
    acknowledged: bool


class EventOut(Out):
    id: int
    run_id: int
    time: float
    step: int | None
    kind: str
    source: str
    message: str
    data: dict[str, Any]


class AttemptOut(Out):
    id: int
    run_id: int
    number: int
    pid: int | None
    started_at: float
    ended_at: float | None
    heartbeat_at: float | None
    start_step: int | None
    outcome: str | None
    exit_code: int | None
    signal: str | None
    cause: str | None
    error: str | None
    log_path: str | None


class CheckpointOut(Out):
    id: int
    run_id: int
    step: int
    path: str
    size_bytes: int | None
    version: int | None
    time: float
    exists: bool


class Problem(BaseModel):
    detail: str


class FieldError(BaseModel):
    loc: list[str | int] = Field(description='where: ["body", "config", "loop", "steps"], ["query", "status"]')
    msg: str
    type: str


class Invalid(BaseModel):
    detail: list[FieldError]


class BadRequest(BaseModel):
    detail: str | list[FieldError]


def _problem(description: str) -> dict:
    return {"model": Problem, "description": description}


bearer = HTTPBearer(auto_error=False, description="the token printed by `molt serve` (also in MOLT_HOME/token)")


def authenticated(request: Request, _: HTTPAuthorizationCredentials | None = Depends(bearer)):
    """Bearer token, ?token=, or the session cookie (then a state-changing request also needs the CSRF token)."""
    auth = request.app.state.auth
    method = auth.method(request)
    if method is None:
        raise HTTPException(401, "missing or wrong token", headers={"WWW-Authenticate": "Bearer"})
    if method == "cookie" and request.method not in ("GET", "HEAD", "OPTIONS") and not auth.csrf_ok(request):
        raise HTTPException(403, "cross-site request or missing CSRF token")


def known_query(request: Request):
    """An unknown query parameter is an error, not silently ignored: `?max_point=100` must not return the full
    series as if nothing were wrong."""
    route = request.scope.get("route")
    if route is None or not hasattr(route, "dependant"):
        return
    allowed = {"token"} | _query_names(route.dependant)
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        raise RequestValidationError([{"type": "extra_forbidden", "loc": ("query", name),
                                       "msg": f"unknown query parameter; known: {', '.join(sorted(allowed))}"}
                                      for name in unknown])


def _query_names(dependant) -> set[str]:
    return {p.alias for p in dependant.query_params}.union(*(_query_names(d) for d in dependant.dependencies))


router = APIRouter(prefix="/api/v1", dependencies=[Depends(known_query)], responses={
    400: {"model": BadRequest, "description": "the body is not JSON"},
    422: {"model": Invalid, "description": "invalid input; each error names its field"}})
protected = APIRouter(dependencies=[Depends(authenticated)],
                      responses={401: _problem("missing or wrong token"), 403: _problem("cross-site request")})
with_run = {404: _problem("no such run")}


def api(request: Request):
    return request.app.state.api


@router.get("/health", response_model=Health, tags=["meta"])
def health(request: Request):
    """Liveness and whether a daemon owns the data directory (no token needed)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("molt-studio")
    except PackageNotFoundError:
        v = "unknown"
    return {"status": "ok", "version": v, "daemon": api(request).daemon_status(), "time": time.time()}


@protected.get("/envs", response_model=list[EnvInfo], tags=["meta"])
def envs():
    """The environments a config may name: the built-in ones and those of the user's env directories (--envs)."""
    import inspect

    from molt_engine.envs import ENVS, load_user_envs
    load_user_envs()  # a file added or fixed since the server started is listed now
    return [{"name": name, "description": ((cls.__doc__ or "").strip().splitlines() or [""])[0],
             "max_turns": cls.max_turns, "max_tokens": cls.max_tokens, "chat": cls.chat,
             "tools": [tool.__name__ for tool in cls.tools],
             "source": None if cls.__module__.startswith("molt_engine.") else inspect.getsourcefile(cls)}
            for name, cls in sorted(ENVS.items())]


@protected.post("/runs", status_code=201, response_model=RunOut, tags=["runs"])
def create_run(request: Request, body: RunCreate):
    """Validate the config and queue a run; the daemon starts it when a slot is free."""
    return submit(api(request), body.config.model_dump(mode="json"), body.name, body.tags, body.max_restarts)


def submit(records, config: dict, name: str | None, tags: list[str], max_restarts: int) -> dict:
    """Queue a run, or raise RequestValidationError whose errors name the fields (`body.config.loop.steps`)."""
    try:
        RunConfig.model_validate(config)
    except ValidationError as e:
        raise RequestValidationError([
            {"type": err["type"], "loc": ("body", "config", *err["loc"]),
             "msg": err["msg"].removeprefix("Value error, ")} for err in e.errors()]) from None
    try:
        return records.create_run(config, name=name, tags=tags, max_restarts=max_restarts)
    except InvalidConfig as e:  # name, tags, max_restarts: the API's own checks, one "field: message" per line
        raise RequestValidationError([{"type": "value_error", "loc": ("body", line.partition(":")[0]),
                                       "msg": line.partition(":")[2].strip()} for line in e.errors]) from None


@protected.get("/runs", response_model=list[RunOut], tags=["runs"])
def list_runs(request: Request, status: Annotated[list[Literal[STATUSES]] | None, Query()] = None,
              tag: Annotated[str | None, Query(max_length=64)] = None,
              limit: Annotated[int | None, Query(ge=1, le=10000)] = None):
    """Newest first; `status` may repeat (?status=running&status=queued)."""
    return api(request).list_runs(status=status or None, tag=tag, limit=limit)


@protected.get("/runs/{run_id}", response_model=RunOut, responses=with_run, tags=["runs"])
def get_run(request: Request, run_id: RunId):
    return found(api(request).get_run, run_id)


@protected.get("/runs/{run_id}/metrics", response_model=MetricsOut, responses=with_run, tags=["metrics"])
def metrics(request: Request, run_id: RunId,
            names: Annotated[str | None, Query(max_length=4000, description="comma-separated; default all")] = None,
            after_step: Annotated[int | None, Query(ge=-1, le=2**62, description="only steps after this")] = None,
            max_points: Annotated[int | None, Query(ge=10, le=1_000_000, description="per series; min/max buckets "
                                                    "keep spikes and NaN")] = None):
    """Series by name, columnar (step, value, time). NaN and ±inf come as the strings "NaN", "Infinity",
    "-Infinity"."""
    found(api(request).get_run, run_id)
    return metric_series(request.app.state.series, run_id, names, after_step, max_points)


def metric_series(cache, run_id: int, names: str | list[str] | None, after_step=None, max_points=None) -> dict:
    known = cache.names(run_id)
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    series, reduced = {}, False
    for name in [n for n in (names or known) if n in known]:
        part, dropped = cache.downsampled(run_id, name, after_step, max_points)
        reduced |= dropped
        series[name] = {"step": part.steps.tolist(), "value": encode_values(part.values),
                        "time": part.times.tolist()}
    return {"run_id": run_id, "names": known, "series": series, "downsampled": reduced}


@protected.get("/runs/{run_id}/metrics.csv", tags=["metrics"],
               responses={**with_run, 200: {"content": {"text/csv": {}}, "description": "step,name,value,time"}})
def metrics_csv(request: Request, run_id: RunId):
    """Every recorded value at full resolution, one row per (step, name); NaN as `nan`, infinities as `inf`."""
    records = api(request)
    found(records.get_run, run_id)

    def rows():
        buffer = io.StringIO()
        out = csv.writer(buffer)
        out.writerow(["step", "name", "value", "time"])
        with records.engine.connect() as c:
            result = c.exec_driver_sql("SELECT step, name, value, time FROM metric WHERE run_id = ? "
                                       "ORDER BY step, name", (run_id,))
            while chunk := result.fetchmany(10000):
                out.writerows((s, n, "nan" if v is None else repr(v) if math.isfinite(v) else str(v), t)
                              for s, n, v, t in chunk)
                yield buffer.getvalue()
                buffer.seek(0)
                buffer.truncate()
        yield buffer.getvalue()

    return StreamingResponse(rows(), media_type="text/csv",
                             headers={"Content-Disposition": f'attachment; filename="run-{run_id}-metrics.csv"'})


@protected.get("/runs/{run_id}/alerts", response_model=list[AlertOut], responses=with_run, tags=["records"])
def alerts(request: Request, run_id: RunId, unacknowledged: bool = False):
    return found(api(request).alerts, run_id, unacknowledged=unacknowledged)


@protected.post("/runs/{run_id}/alerts/{alert_id}/ack", response_model=AlertOut, tags=["records"],
                responses={404: _problem("no such run or alert")})
def acknowledge(request: Request, run_id: RunId, alert_id: RunId):
    """Mark an alert seen: it no longer counts in the run's open alerts."""
    return acknowledge_alert(request, run_id, alert_id)


def acknowledge_alert(request: Request, run_id: int, alert_id: int) -> dict:
    alert = found(api(request).acknowledge_alert, run_id, alert_id)
    request.app.state.hub.publish(run_id, {"type": "ack", "alert": alert})
    return alert


@protected.get("/runs/{run_id}/events", response_model=list[EventOut], responses=with_run, tags=["records"])
def events(request: Request, run_id: RunId, after_id: Annotated[int | None, Query(ge=0, le=2**62)] = None):
    return found(api(request).events, run_id, after_id=after_id)


@protected.get("/runs/{run_id}/attempts", response_model=list[AttemptOut], responses=with_run, tags=["records"])
def attempts(request: Request, run_id: RunId):
    """Each worker process of the run, with the cause of its end (exit code, signal, exception, hang)."""
    return found(api(request).attempts, run_id)


@protected.get("/runs/{run_id}/checkpoints", response_model=list[CheckpointOut], responses=with_run,
               tags=["records"])
def checkpoints(request: Request, run_id: RunId):
    """Every checkpoint recorded; `exists` is false for those the engine has pruned."""
    return found(api(request).checkpoints, run_id)


@protected.get("/runs/{run_id}/log", tags=["records"],
               responses={**with_run, 200: {"content": {"text/plain": {}}, "description": "the log's tail"}})
def log_tail(request: Request, run_id: RunId, attempt: Annotated[int | None, Query(ge=1, le=10**6)] = None,
             max_bytes: Annotated[int, Query(ge=1, le=10**7)] = 65536):
    """The tail of an attempt's stdout + stderr (the latest attempt by default)."""
    return PlainTextResponse(found(api(request).log_tail, run_id, attempt, max_bytes))


conflict = {**with_run, 409: _problem("the run's status does not allow it")}


@protected.post("/runs/{run_id}/stop", status_code=202, response_model=RunOut, responses=conflict, tags=["runs"])
def stop(request: Request, run_id: RunId):
    """A queued run stops at once; a running one checkpoints and ends `stopped` (the daemon acts within a poll)."""
    return found(api(request).stop_run, run_id)


@protected.post("/runs/{run_id}/resume", status_code=202, response_model=RunOut, responses=conflict, tags=["runs"])
def resume(request: Request, run_id: RunId):
    """Queue a stopped, failed or tripped run again; it continues from its latest checkpoint."""
    return found(api(request).resume_run, run_id)


@protected.get("/runs/{run_id}/wait", response_model=RunOut, responses=with_run, tags=["runs"])
async def wait(request: Request, run_id: RunId,
               timeout: Annotated[float, Query(ge=0, le=3600, description="seconds")] = 30.0):
    """The run once it is terminal (completed, failed, stopped, tripped) or when `timeout` passes, whichever is
    first; look at `status`. Waits without holding a thread."""
    records = api(request)
    deadline = time.monotonic() + timeout
    while True:
        run = await asyncio.to_thread(found, records.get_run, run_id)
        if run["status"] in TERMINAL or time.monotonic() >= deadline or await request.is_disconnected():
            return run
        await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))


def found(call, *args, **kwargs):
    """The daemon API's exceptions as HTTP answers."""
    try:
        return call(*args, **kwargs)
    except RunNotFound as e:
        raise HTTPException(404, f"not found: {e.args[0]}") from None
    except Conflict as e:
        raise HTTPException(409, str(e)) from None


router.include_router(protected)
