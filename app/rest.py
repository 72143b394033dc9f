"""The REST API under /api/v1 (documented at /docs): JSON in and out, the token required everywhere but /health."""
import asyncio
import csv
import inspect
import io
import math
import time
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select

from daemon.models import STATUSES, TERMINAL, Metric
from daemon.records import Conflict, RunNotFound
from molt_engine.serving.agents import Agent
from molt_engine.envs import ENVS, load_user_envs

from .schemas import (AlertOut, AttemptOut, BadRequest, CheckpointOut, EnvInfo, EventOut, Health, Invalid, MetricsOut,
                      Problem, RunBody, RunEnd, RunOut, RunPatch, SampleOut, SamplesOut, SampleStep)
from .series import encode_values

RunId = Annotated[int, Path(ge=1, le=2**62, description="the run's id")]
AlertId = Annotated[int, Path(ge=1, le=2**62, description="the alert's id")]


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


def records_of(request: Request):
    return request.app.state.records


@router.get("/health", response_model=Health, tags=["meta"],
            responses={503: {"model": Health, "description": "degraded: the daemon is down, restarting or hung; "
                                                             "stopped: stopped on request"}})
def health(request: Request, response: Response):
    """Liveness: 200 `ok` when the web server and the daemon that owns the data directory are both alive, else 503
    (so that load balancers and Docker's HEALTHCHECK see it): `stopped` when the daemon was stopped on request
    (`molt daemon stop`; nobody restarts it until `molt daemon start`), else `degraded`. No token needed."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("molt-studio")
    except PackageNotFoundError:
        v = "unknown"
    daemon = records_of(request).daemon_status()
    if not daemon["alive"]:
        response.status_code = 503
    status = "ok" if daemon["alive"] else "stopped" if daemon["stopped"] else "degraded"
    return {"status": status, "version": v, "daemon": daemon, "time": time.time()}


@protected.post("/daemon/start", status_code=202, response_model=dict[str, Any], tags=["meta"],
                responses={409: _problem("no `molt serve` watches the data directory to start its daemon")})
def start_daemon(request: Request):
    """Start the daemon again after `molt daemon stop` (the dashboard's Start button): the `molt serve` that keeps
    it starts it within a poll. 409 without one (`molt web`): then `molt daemon start` where the daemon runs.
    Returns the daemon's status (as in /health)."""
    records = records_of(request)
    status = records.daemon_status()
    if not status["running"]:
        if not status["kept"]:
            raise HTTPException(409, f"no `molt serve` watches {records.home} to start its daemon: run "
                                     f"`molt daemon start --home {records.home}` where the daemon runs")
        records.request_daemon_start("the dashboard")
    return records.daemon_status()


@protected.get("/envs", response_model=list[EnvInfo], tags=["meta"])
def envs():
    """The environments a config may name: the built-in ones, those of installed env packages and of the user's env
    directories (--envs)."""
    load_user_envs()  # a file added or fixed since the server started is listed now
    return [{"name": name, "description": ((cls.__doc__ or "").strip().splitlines() or [""])[0],
             "max_turns": cls.max_turns, "max_tokens": cls.max_tokens, "chat": cls.chat,
             "tools": cls.tool_names(), "agent": issubclass(cls, Agent),
             "source": None if cls.__module__.split(".")[0] in ("molt_engine", "molt_envs")
             else inspect.getsourcefile(cls)}
            for name, cls in sorted(ENVS.items())]


@protected.post("/runs", status_code=201, response_model=RunOut, tags=["runs"])
def create_run(request: Request, body: RunBody):
    """Validate the config and queue a run; the daemon starts it when a slot is free. The body is a request with its
    `config`, or a bare config (`{"env": "max_digit"}`)."""
    return records_of(request).queue_run(body)


@protected.get("/runs", response_model=list[RunOut], tags=["runs"])
def list_runs(request: Request, status: Annotated[list[Literal[STATUSES]] | None, Query()] = None,
              tag: Annotated[str | None, Query(max_length=64)] = None,
              limit: Annotated[int | None, Query(ge=1, le=10000)] = None,
              before: Annotated[int | None, Query(ge=1, le=2**62, description="only runs older than this id: the "
                                                  "next page after a `limit`-long answer")] = None):
    """Newest first; `status` may repeat (?status=running&status=queued)."""
    return records_of(request).list_runs(status=status or None, tag=tag, limit=limit, before=before)


@protected.get("/runs/{run_id}", response_model=RunOut, responses=with_run, tags=["runs"])
def get_run(request: Request, run_id: RunId):
    return found(records_of(request).get_run, run_id)


@protected.patch("/runs/{run_id}", response_model=RunOut, responses=with_run, tags=["runs"])
def update_run(request: Request, run_id: RunId, body: RunPatch):
    """Rename a run, set its notes, archive or unarchive it (any status)."""
    return found(records_of(request).update_run, run_id, **body.model_dump())


@protected.delete("/runs/{run_id}", status_code=204, tags=["runs"],
                  responses={**with_run, 409: _problem("the run is queued or active: stop it first")})
def delete_run(request: Request, run_id: RunId):
    """Delete a run that has ended: its records and its directory (checkpoints, final and best policies, logs)."""
    found(records_of(request).delete_run, run_id)
    request.app.state.series.forget(run_id)
    return Response(status_code=204)


@protected.get("/runs/{run_id}/metrics", response_model=MetricsOut, responses=with_run, tags=["metrics"])
def metrics(request: Request, run_id: RunId,
            names: Annotated[str | None, Query(max_length=4000, description="comma-separated; default all")] = None,
            after_step: Annotated[int | None, Query(ge=-1, le=2**62, description="only steps after this")] = None,
            max_points: Annotated[int | None, Query(ge=10, le=1_000_000, description="per series; min/max buckets "
                                                    "keep spikes and NaN")] = None):
    """Series by name, columnar (step, value, time). NaN and ±inf come as the strings "NaN", "Infinity",
    "-Infinity"."""
    found(records_of(request).get_run, run_id)
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
               responses={**with_run, 200: {"content": {"text/csv": {}},
                                            "description": "long: step,name,value,time; wide: step,<each metric>"}})
def metrics_csv(request: Request, run_id: RunId,
                format: Annotated[Literal["long", "wide"], Query(description="long: one row per (step, name); wide: "
                                                                 "one row per step, one column per metric")] = "long"):
    """Every recorded value at full resolution; NaN as `nan`, infinities as `inf`; in wide format an empty cell is a
    metric not recorded at that step."""
    records = records_of(request)
    found(records.get_run, run_id)
    wide = format == "wide"

    def cell(v):
        return "nan" if v is None else repr(v) if math.isfinite(v) else str(v)

    def rows():
        buffer = io.StringIO()
        out = csv.writer(buffer)
        with records.engine.connect() as c:
            names = c.scalars(select(Metric.name).where(Metric.run_id == run_id).distinct().order_by(Metric.name)).all()
            out.writerow(["step", *names] if wide else ["step", "name", "value", "time"])
            result = c.execute(select(Metric.step, Metric.name, Metric.value, Metric.time)
                               .where(Metric.run_id == run_id).order_by(Metric.step, Metric.name))
            step, row = None, {}  # wide: the step being gathered (its rows may span two chunks)
            while chunk := result.fetchmany(10000):
                if not wide:
                    out.writerows((s, n, cell(v), t) for s, n, v, t in chunk)
                    continue
                for s, n, v, _ in chunk:
                    if s != step and row:
                        out.writerow([step, *(row.get(name, "") for name in names)])
                        row = {}
                    step, row[n] = s, cell(v)
                yield buffer.getvalue()
                buffer.seek(0)
                buffer.truncate()
            if row:
                out.writerow([step, *(row.get(name, "") for name in names)])
        yield buffer.getvalue()

    filename = f"run-{run_id}-metrics{'-wide' if wide else ''}.csv"
    return StreamingResponse(rows(), media_type="text/csv",
                             headers={"Content-Disposition": f'attachment; filename="{filename}"'})


@protected.get("/runs/{run_id}/alerts", response_model=list[AlertOut], responses=with_run, tags=["records"])
def alerts(request: Request, run_id: RunId, unacknowledged: bool = False):
    return found(records_of(request).alerts, run_id, unacknowledged=unacknowledged)


@protected.post("/runs/{run_id}/alerts/{alert_id}/ack", response_model=AlertOut, tags=["records"],
                responses={404: _problem("no such run or alert")})
def acknowledge(request: Request, run_id: RunId, alert_id: AlertId):
    """Mark an alert seen: it no longer counts in the run's open alerts."""
    return acknowledge_alert(request, run_id, alert_id)


def acknowledge_alert(request: Request, run_id: int, alert_id: int) -> dict:
    alert = found(records_of(request).acknowledge_alert, run_id, alert_id)
    # from the thread pool (sync handlers) to the event loop that owns the viewers' queues
    anyio.from_thread.run_sync(request.app.state.hub.publish, run_id, {"type": "ack", "alert": alert})
    return alert


@protected.get("/runs/{run_id}/events", response_model=list[EventOut], responses=with_run, tags=["records"])
def events(request: Request, run_id: RunId, after_id: Annotated[int | None, Query(ge=0, le=2**62)] = None):
    return found(records_of(request).events, run_id, after_id=after_id)


@protected.get("/runs/{run_id}/attempts", response_model=list[AttemptOut], responses=with_run, tags=["records"])
def attempts(request: Request, run_id: RunId):
    """Each worker process of the run, with the cause of its end (exit code, signal, exception, hang)."""
    return found(records_of(request).attempts, run_id)


@protected.get("/runs/{run_id}/checkpoints", response_model=list[CheckpointOut], responses=with_run,
               tags=["records"])
def checkpoints(request: Request, run_id: RunId):
    """Every checkpoint recorded; `exists` is false for those the engine has pruned."""
    return found(records_of(request).checkpoints, run_id)


@protected.get("/runs/{run_id}/log", tags=["records"],
               responses={**with_run, 200: {"content": {"text/plain": {}}, "description": "the log's tail"}})
def log_tail(request: Request, run_id: RunId, attempt: Annotated[int | None, Query(ge=1, le=10**6)] = None,
             max_bytes: Annotated[int, Query(ge=1, le=10**7)] = 65536):
    """The tail of an attempt's stdout + stderr (the latest attempt by default)."""
    return PlainTextResponse(found(records_of(request).log_tail, run_id, attempt, max_bytes))


conflict = {**with_run, 409: _problem("the run's status does not allow it")}


@protected.post("/runs/{run_id}/stop", status_code=202, response_model=RunOut, responses=conflict, tags=["runs"])
def stop(request: Request, run_id: RunId):
    """A queued run stops at once; a running one checkpoints and ends `stopped` (the daemon acts within a poll)."""
    return found(records_of(request).stop_run, run_id)


@protected.post("/runs/{run_id}/resume", status_code=202, response_model=RunOut, responses=conflict, tags=["runs"])
def resume(request: Request, run_id: RunId):
    """Queue a stopped, failed or tripped run again; it continues from its latest checkpoint."""
    return found(records_of(request).resume_run, run_id)


@protected.post("/runs/{run_id}/end", response_model=RunOut, responses=conflict, tags=["runs"])
def end(request: Request, run_id: RunId, body: RunEnd):
    """Mark an external run that no longer reports (`unreachable`, or `stopping` without an answer) stopped or
    failed: the daemon cannot end it, its process being elsewhere. A resume of an external run is refused (409): it
    resumes only from its own machine, with `molt train --resume --report-to`."""
    return found(records_of(request).end_external_run, run_id, body.status)


@protected.get("/runs/{run_id}/wait", response_model=RunOut, responses=with_run, tags=["runs"])
async def wait(request: Request, run_id: RunId,
               timeout: Annotated[float, Query(ge=0, le=3600, description="seconds")] = 30.0):
    """The run once it is terminal (completed, failed, stopped, tripped) or when `timeout` passes, whichever is
    first; look at `status`. Waits without holding a thread."""
    records = records_of(request)
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


# ---- samples ------------------------------------------------------------------------------------------------------

def sample_filters(
        step: Annotated[int | None, Query(ge=0, le=2**62)] = None,
        kind: Literal["train", "eval", "evaluation"] | None = None,
        min_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
        passed: Annotated[bool | None, Query(description="only passed (true) or failed (false) episodes")] = None,
        tool_errors: Annotated[bool | None, Query(description="only episodes with (true) or without (false) "
                                                              "tool errors")] = None,
        q: Annotated[str | None, Query(max_length=500, description="text the episode contains")] = None,
        prompt: Annotated[str | None, Query(max_length=10000, description="exactly this prompt")] = None) -> dict:
    return {"step": step, "kind": kind, "min_reward": min_reward, "passed": passed, "tool_errors": tool_errors,
            "q": q, "prompt": prompt}


@protected.get("/runs/{run_id}/samples", response_model=SamplesOut, responses=with_run, tags=["samples"])
def samples(request: Request, run_id: RunId, filters: Annotated[dict, Depends(sample_filters)],
            limit: Annotated[int, Query(ge=1, le=500)] = 50,
            cursor: Annotated[int | None, Query(ge=0, le=2**62, description="next_cursor of the previous page")] = None,
            order: Literal["oldest", "newest"] = "oldest"):
    """Recorded episodes (each step's sample of its trained episodes, and each eval's), in the order recorded or the
    newest step first, with every token's numbers, and how many pass the filters in all."""
    records = records_of(request)
    rows = found(records.samples, run_id, **filters, limit=limit, cursor=cursor, newest_first=order == "newest")
    return {"run_id": run_id, "samples": rows, "next_cursor": rows[-1]["id"] if len(rows) == limit else None,
            "total": records.count_samples(run_id, **filters)}


@protected.get("/runs/{run_id}/samples.jsonl", tags=["samples"], responses={
    **with_run, 200: {"content": {"application/x-ndjson": {}}, "description": "one SampleOut per line"}})
def samples_jsonl(request: Request, run_id: RunId, filters: Annotated[dict, Depends(sample_filters)]):
    """Every recorded episode that passes the filters, one JSON object per line (as in /samples)."""
    records = records_of(request)
    found(records.get_run, run_id)

    def lines():
        cursor = None
        while rows := records.samples(run_id, **filters, limit=200, cursor=cursor):
            yield "".join(SampleOut.model_validate(r).model_dump_json() + "\n" for r in rows)
            cursor = rows[-1]["id"]

    return StreamingResponse(lines(), media_type="application/x-ndjson",
                             headers={"Content-Disposition": f'attachment; filename="run-{run_id}-samples.jsonl"'})


@protected.get("/runs/{run_id}/samples/steps", response_model=list[SampleStep], responses=with_run, tags=["samples"])
def sample_steps(request: Request, run_id: RunId):
    """The steps that have recorded samples, with how many of each kind."""
    return found(records_of(request).sample_steps, run_id)


router.include_router(protected)
