"""The HTML pages (Jinja2 + HTMX): login, runs list, run page, compare; and their htmx partials (the launch form:
launch.py)."""
import functools
import inspect
import json
import socket
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Form, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from sqlalchemy import bindparam, select
from markupsafe import escape

from daemon.eval_records import list_evals
from daemon.records import Conflict, RunNotFound
from daemon.models import ACTIVE, STATUSES, TERMINAL, Metric
from daemon.trackers import flat_config, shown

from . import rest
from .auth import CSRF_FIELD, SESSION_COOKIE, same_origin
from .live import daemon_message
from .queue import queue_notes
from .run_columns import SUMMARIES, column_values, config_keys, parse_columns
from .series import metric_names

TEMPLATES = Jinja2Templates(directory=Path(__file__).resolve().parent.parent / "templates")  # autoescape is on
# a config on a page shows no credentials in its URLs (report.mlflow.tracking_uri's); the API keeps them, for clone
TEMPLATES.env.filters["tojson_pretty"] = lambda v: shown(json.dumps(v, indent=2, sort_keys=True))
TEMPLATES.env.globals["queue_notes"] = queue_notes  # the evaluations page shows each waiting one's place in line
router = APIRouter(include_in_schema=False)
RUNS_PER_PAGE = 100

class LoginRequired(Exception):
    pass


def page_auth(request: Request):
    """The pages' gate: the session cookie, or ?token= (which then sets the cookie)."""
    if request.app.state.auth.method(request) is None:
        raise LoginRequired


def render(request: Request, template: str, status_code: int = 200, **context) -> HTMLResponse:
    auth = request.app.state.auth
    if not template.startswith("_"):  # a whole page: its daemon banner as it is now, so that it never pops in above
        context.setdefault("daemon", daemon_message(request.app.state.records.daemon_status()))
    return TEMPLATES.TemplateResponse(request, template, {"csrf": auth.csrf, "csrf_field": CSRF_FIELD, **context},
                                      status_code=status_code)


def check_csrf(request: Request, form_value: str | None):
    if not request.app.state.auth.csrf_ok(request, form_value):
        raise HTTPException(403, "cross-site request or missing CSRF token: reload the page")


def guarded(handler):
    """Page handlers redirect to the login page instead of answering 401. They are plain functions: FastAPI runs
    them in its thread pool, so their SQLite reads never hold up the event loop that the websockets share."""
    if inspect.iscoroutinefunction(handler):  # this plain wrapper would hand FastAPI its coroutine, unawaited
        raise TypeError(f"page handler {handler.__name__} must be a plain def: it runs in the thread pool")
    @functools.wraps(handler)
    def wrapper(request: Request, *args, **kwargs):
        try:
            page_auth(request)
        except LoginRequired:
            if request.headers.get("hx-request"):  # htmx follows HX-Redirect with a full page load
                return Response(status_code=401, headers={"HX-Redirect": "/login"})
            return RedirectResponse("/login?" + urlencode({"next": request.url.path}), status_code=303)
        if request.app.state.auth.method(request) == "query" and request.method == "GET":
            # the ready-to-click URL: swap the token in the URL for the session cookie, and drop it from the URL
            query = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            response = RedirectResponse(request.url.path + ("?" + urlencode(query) if query else ""), status_code=303)
            set_session(request, response)
            return response
        return handler(request, *args, **kwargs)
    return wrapper


def set_session(request: Request, response: Response):
    response.set_cookie(SESSION_COOKIE, request.app.state.auth.session, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", max_age=30 * 24 * 3600)


# ---- login ----------------------------------------------------------------------------------------------------------

@router.get("/login")
async def login_page(request: Request, next: str = "/"):
    return render(request, "login.html", next=safe_next(next), error=None)


@router.post("/login")
async def login(request: Request, token: Annotated[str, Form()] = "", next: Annotated[str, Form()] = "/"):
    # Before login there is no CSRF token to check; a login form posted from another site is refused by origin
    if not same_origin(request):
        raise HTTPException(403, "cross-site login refused")
    if not request.app.state.auth.check_token(token.strip()):
        return render(request, "login.html", status_code=401, next=safe_next(next), error="wrong token")
    response = RedirectResponse(safe_next(next), status_code=303)
    set_session(request, response)
    return response


@router.post("/logout")
async def logout(request: Request, csrf_token: Annotated[str | None, Form()] = None):
    check_csrf(request, csrf_token)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE)
    return response


def safe_next(path: str) -> str:
    """Only a path of this site (not //evil.example, which a browser reads as another host)."""
    return path if path.startswith("/") and not path.startswith("//") and "\\" not in path else "/"


# ---- runs list ------------------------------------------------------------------------------------------------------

RUN_COLUMNS = {"created": "created", "status": "status", "env": "env", "model": "model", "steps": "progress",
               "reward": "reward", "duration": "duration", "best_eval": "best eval"}  # the sortable ones: key -> header


def run_filters(status: str | None = None, env: str | None = None, tag: str | None = None, q: str | None = None,
                sort: str = "created", order: str = "desc", archived: bool = False, offset: int = 0,
                before: int | None = None, cols: str | None = None) -> dict:
    """The runs list's state, all in the URL query so that a reload or a shared link shows the same list. `cols`:
    the chosen columns (run_columns.py), which sort too."""
    chosen, cols_error = parse_columns(cols)
    return {"status": status if status in STATUSES else None, "env": env, "tag": tag, "q": q,
            "sort": sort if sort in RUN_COLUMNS or sort in chosen else "created",
            "order": "asc" if order == "asc" else "desc", "archived": archived, "offset": max(0, offset),
            "before": before, "cols": ",".join(chosen) or None, "cols_error": cols_error}


def list_context(request: Request, f: dict) -> dict:
    """One page of runs (newest first unless sorted); `before` (a run id) starts after the runs newer than it. Each
    row gets an etag of what it shows, so that the page swaps only the rows that changed (runs.js). Sorted by a
    chosen column, every matching run is read (without its config) and sorted here, then paged."""
    records = request.app.state.records
    chosen = f["cols"].split(",") if f["cols"] else []
    by_column = f["sort"] in chosen
    runs = records.list_runs(
        status=f["status"], tag=f["tag"] or None, env=f["env"] or None, q=f["q"] or None,
        archived=None if f["archived"] else False, sort="created" if by_column else f["sort"],
        descending=f["order"] == "desc", limit=None if by_column else RUNS_PER_PAGE + 1,
        offset=None if by_column else f["offset"] or None, before=f["before"], config=False)
    values = column_values(records.engine, chosen, [r["id"] for r in runs]) if chosen else {}
    if by_column:  # runs without a value last, whichever the order
        column = values[f["sort"]]
        order = lambda v: (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))  # noqa: E731 numbers, then text
        have = sorted((r for r in runs if r["id"] in column), key=lambda r: order(column[r["id"]]),
                      reverse=f["order"] == "desc")
        runs = (have + [r for r in runs if r["id"] not in column])[f["offset"]:f["offset"] + RUNS_PER_PAGE + 1]
    queued = any(r["status"] == "queued" for r in runs)
    notes = queue_notes(records.engine, request.app.state.concurrency) if queued else {}
    for r in runs:
        r["queue"] = notes.get(("run", r["id"]))  # what a queued run waits for
        r["cols"] = [values[c].get(r["id"]) for c in chosen]
        r["etag"] = f"{zlib.crc32(json.dumps(r, sort_keys=True, default=str).encode()):08x}"
    # attributes, not dict keys: Jinja tries `r.name` as an attribute first, and a failed try per cell was a third
    # of the page's render time
    runs = [SimpleNamespace(**r) for r in runs]
    defaults = {"offset": f["offset"], "sort": "created", "order": "desc"}  # left out of the URLs
    state = {k: v for k, v in f.items() if v and k != "cols_error" and defaults.get(k) != v}
    older = {**state, "offset": f["offset"] + RUNS_PER_PAGE} if len(runs) > RUNS_PER_PAGE else None
    newest = {k: v for k, v in state.items() if k != "before"}
    flip = lambda key: "asc" if f["sort"] == key and f["order"] == "desc" else "desc"  # noqa: E731
    return {"runs": runs[:RUNS_PER_PAGE], "f": f, "statuses": STATUSES, "columns": {**RUN_COLUMNS, **{c: c for c in chosen}},
            "chosen": chosen, "active": ACTIVE, "terminal": TERMINAL,  # delete: only an ended run (as the API)
            "sort_links": {key: "/?" + urlencode({**state, "sort": key, "order": flip(key)})
                           for key in [*RUN_COLUMNS, *chosen]},
            "query": urlencode({**state, **({"offset": f["offset"]} if f["offset"] else {})}),
            "first_page": not f["offset"] and f["before"] is None, "newest": "/?" + urlencode(newest),
            "older": "/?" + urlencode(older) if older else None}


@router.get("/")
@guarded
def runs_page(request: Request, filters: Annotated[dict, Depends(run_filters)]):
    context = list_context(request, filters)
    # the columns box completes config keys and the metric summaries of the first 20 listed runs (bounded: each is a
    # seek per name, and the page is the dashboard's most requested)
    names = set()
    with request.app.state.records.engine.connect() as c:
        for r in context["runs"][:20]:
            names.update(metric_names(c, r.id))
    keys = [*config_keys(), *(f"{n}.{s}" for n in sorted(names) for s in SUMMARIES)]
    return render(request, "runs.html", gpus=machine_gpus(), envs=request.app.state.records.run_envs(),
                  column_keys=keys, **context)


def machine_gpus() -> list[dict]:
    """This machine's GPUs (utilisation, memory) from nvidia-ml-py, the optional `gpu` extra; none without it or
    without an NVIDIA driver, and the runs page then shows no machine panel."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no NVIDIA driver on this machine
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append({"index": i, "name": pynvml.nvmlDeviceGetName(handle),
                         "util": pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                         "used_gb": memory.used / 1e9, "total_gb": memory.total / 1e9})
        return gpus
    finally:
        pynvml.nvmlShutdown()


@router.get("/partials/runs")
@guarded
def runs_rows(request: Request, filters: Annotated[dict, Depends(run_filters)]):
    return render(request, "_runs_rows.html", **list_context(request, filters))


# ---- run page -------------------------------------------------------------------------------------------------------

def get_run_or_404(request: Request, run_id: int) -> dict:
    try:
        return request.app.state.records.get_run(run_id)
    except RunNotFound:
        raise HTTPException(404, f"no run {run_id}") from None


@router.get("/runs/{run_id}")
@guarded
def run_page(request: Request, run_id: int):
    run = get_run_or_404(request, run_id)
    config = run["config"]
    out = request.app.state.records.run_dir(run_id)

    def newest(kind: str) -> dict:  # the newest event of that kind's data: each attempt sends one
        return ([{}] + [e["data"] for e in request.app.state.records.events(run_id, kind=kind)])[-1]
    device = newest("device")  # the policy's parameter counts, from the engine
    trainable, total = device.get("trainable"), device.get("parameters")
    ray = newest("ray").get("dashboard")  # the placed attempt's Ray dashboard
    trackers = {e["data"]["tracker"]: e["data"]["url"]  # the run in each tracker that mirrors it with a URL
                for e in request.app.state.records.events(run_id, kind="tracker") if e["data"].get("url")}
    overview = {"model": config["model"].get("preset") or config["model"].get("path"),
                "lora": config["model"].get("lora"), "host": socket.gethostname(),
                "trainable": f"{trainable:,} of {total:,} ({100 * trainable / total:.1f} %)" if total else None,
                "ranks": config.get("dist", {}).get("nproc", 1) * config.get("dist", {}).get("nnodes", 1), "ray": ray,
                "trackers": trackers,
                "paths": [(kind, out / kind) for kind in ("final", "best") if (out / kind).exists()]}
    return render(request, "run.html", run=run, active=ACTIVE, terminal=TERMINAL, overview=overview,
                  note=queue_note(request, run),
                  alerts=request.app.state.records.alerts(run_id)[::-1],
                  events=request.app.state.records.events(run_id)[-5:][::-1],
                  page={"run_id": run_id, "max_staleness": config["loop"]["max_staleness"],
                        "started_at": run["started_at"], "finished_at": run["finished_at"], "status": run["status"],
                        "attempts": [[a["started_at"], a["ended_at"]] for a in request.app.state.records.attempts(run_id)],
                        "total_steps": run["total_steps"],
                        "best": config.get("eval", {}).get("best", "eval_reward")})  # the metric OUT/best follows


def queue_note(request: Request, run: dict) -> str | None:
    if run["status"] != "queued" or run["host"]:
        return None
    note = queue_notes(request.app.state.records.engine, request.app.state.concurrency).get(("run", run["id"]))
    gpus = (run["config"].get("resources") or {}).get("gpus")
    return f"{note}; asks for {gpus} GPU{'s' if gpus != 1 else ''}" if note and gpus else note


@router.get("/runs/{run_id}/samples")
@guarded
def samples_page(request: Request, run_id: int):
    """The recorded episodes, token by token; the filters live in the URL and the script reads them (samples.js)."""
    run = get_run_or_404(request, run_id)
    # an evaluation's episodes are recorded at step = its id: the page names the evaluation, its checkpoint and
    # step, and the policy version of that checkpoint (the trainer's version on them is 0): the checkpoint's own,
    # else the version the run recorded at the step before (step N's policy is the one after N steps), 0 at step 0
    records = request.app.state.records
    versions = {c["step"]: c["version"] for c in records.checkpoints(run_id)}
    evaluations = {}
    with records.engine.connect() as c:
        for e in list_evals(records.engine, run_id):
            version = versions.get(e["step"])
            if version is None and e["step"] is not None:
                version = 0 if e["step"] == 0 else c.scalar(VERSION_BEFORE, {"run_id": run_id, "step": e["step"]})
            evaluations[e["id"]] = {"checkpoint": e["checkpoint"], "step": e["step"],
                                    "version": None if version is None else int(version)}
    return render(request, "samples.html", run=run, page={"run_id": run_id, "status": run["status"],
                                                          "evaluations": evaluations})


@router.get("/runs/{run_id}/panels/{panel}")
@guarded
def run_panel(request: Request, run_id: int, panel: str):
    records = request.app.state.records
    run = get_run_or_404(request, run_id)
    if panel == "actions":
        return render(request, "_actions.html", run=run, active=ACTIVE)
    if panel == "alerts":
        return render(request, "_alerts.html", run=run, alerts=records.alerts(run_id)[::-1],
                      events=records.events(run_id)[-5:][::-1])
    if panel == "records":
        return render(request, "_records.html", run=run, attempts=records.attempts(run_id),
                      checkpoints=records.checkpoints(run_id), events=records.events(run_id)[-30:][::-1])
    if panel == "queue":
        return render(request, "_queue.html", run=run, note=queue_note(request, run), polled=True)
    if panel == "log":
        return render(request, "_log.html", run=run, log=records.log_tail(run_id, max_bytes=16384), active=ACTIVE)
    raise HTTPException(404, f"no panel {panel}")


@router.post("/runs/{run_id}/{action}")
@guarded
def run_action(request: Request, run_id: int, action: str, csrf_token: Annotated[str | None, Form()] = None):
    check_csrf(request, csrf_token)
    records = request.app.state.records
    calls = {"stop": records.stop_run, "resume": records.resume_run,
             "mark-stopped": lambda run_id: records.end_external_run(run_id, "stopped"),
             "mark-failed": lambda run_id: records.end_external_run(run_id, "failed")}
    if action not in calls:
        raise HTTPException(404, f"no action {action}")
    error = None
    try:
        run = calls[action](run_id)
    except RunNotFound:
        raise HTTPException(404, f"no run {run_id}") from None
    except Conflict as e:
        run, error = records.get_run(run_id), str(e)
    if not request.headers.get("hx-request"):
        return RedirectResponse(f"/runs/{run_id}", status_code=303)
    return render(request, "_actions.html", run=run, active=ACTIVE, error=error)


@router.post("/runs/{run_id}/alerts/{alert_id}/ack")
@guarded
def ack_alert(request: Request, run_id: int, alert_id: int, csrf_token: Annotated[str | None, Form()] = None):
    check_csrf(request, csrf_token)
    rest.acknowledge_alert(request, run_id, alert_id)
    run = get_run_or_404(request, run_id)
    if not request.headers.get("hx-request"):
        return RedirectResponse(f"/runs/{run_id}", status_code=303)
    return render(request, "_alerts.html", run=run, alerts=request.app.state.records.alerts(run_id)[::-1],
                  events=request.app.state.records.events(run_id)[-5:][::-1])


# ---- compare --------------------------------------------------------------------------------------------------------

@router.get("/compare")
@guarded
def compare_page(request: Request, ids: Annotated[list[str], Query()] = [], all: bool = False,  # noqa: B006
                 group: str = ""):
    """Several runs' metrics overlaid (the metrics and x axis chosen in compare.js, kept in the URL), a summary row
    per run, the config differences; `group` (a config key, or "tag") draws each group's mean with a min/max band."""
    wanted = []
    for part in ids:
        wanted += [int(x) for x in part.split(",") if x.strip().isdigit()]
    records = request.app.state.records
    runs = []
    for run_id in dict.fromkeys(wanted):
        try:
            runs.append(records.get_run(run_id))
        except RunNotFound:
            pass
    leaves = [flat_config(r["config"]) for r in runs]
    keys = sorted(set().union(*leaves)) if leaves else []
    rows = [(k, [lv.get(k, "—") for lv in leaves]) for k in keys]
    differing = [(k, vals) for k, vals in rows if len({json.dumps(v) for v in vals}) > 1]
    # a run's groups: each of its tags (a run tagged "spike, ux" is in both), else its value of the config key
    groups = {r["id"]: (sorted(r["tags"]) or ["untagged"] if group == "tag" else
                        [f"{group}={json.dumps(lv.get(group, '—'))}"]) for r, lv in zip(runs, leaves)} if group else {}
    summary, attempts, names = [], {}, set()
    with records.engine.connect() as c:
        for r in runs:
            names.update(metric_names(c, r["id"]))
            best_name = r["config"].get("eval", {}).get("best", "eval_reward")
            best = c.execute(BEST_EVAL, {"run_id": r["id"], "name": best_name}).first()
            attempts[r["id"]] = [[a["started_at"], a["ended_at"]] for a in records.attempts(r["id"])]
            summary.append({"run": r, "best": best, "best_name": best_name, "seconds": r["duration_s"]})
    return render(request, "compare.html", runs=runs, rows=rows if all else differing, all=all,
                  differing=len(differing), total=len(rows), ids=",".join(str(r["id"]) for r in runs),
                  summary=summary, group=group, group_keys=["tag"] + keys,
                  page={"run_ids": [r["id"] for r in runs], "names": {r["id"]: r["name"] for r in runs},
                        "metrics": sorted(names), "attempts": attempts, "groups": groups},
                  recent=records.list_runs(limit=30, config=False))


# the policy version a run recorded at its last step before `step` (a trainer step records the version after it)
VERSION_BEFORE = (select(Metric.value).where(Metric.run_id == bindparam("run_id"), Metric.name == "version",
                                             Metric.step < bindparam("step")).order_by(Metric.step.desc()).limit(1))
# the best value of a run's eval.best metric, and its step (NaN is stored as NULL: skipped)
BEST_EVAL = (select(Metric.value, Metric.step).where(Metric.run_id == bindparam("run_id"),
                                                     Metric.name == bindparam("name"), Metric.value.is_not(None))
             .order_by(Metric.value.desc(), Metric.step).limit(1))




async def invalid_page(request: Request, errors: list[dict], status: int) -> Response:
    """A bad query parameter on a page (e.g. /runs/abc): a plain error page, not JSON."""
    message = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
    return HTMLResponse(f"<!doctype html><title>Bad request</title><p>Bad request: {_escape(message)}</p>",
                        status_code=404 if request.url.path.startswith("/runs/") else status)


def _escape(text: str) -> str:
    return str(escape(text))
