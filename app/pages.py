"""The HTML pages (Jinja2 + HTMX): login, runs list, launch form, run page, compare; and their htmx partials."""
import functools
import inspect
import json
from pathlib import Path
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Form, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from markupsafe import escape
from pydantic import ValidationError, create_model

from daemon.records import Conflict, RunNotFound, RunRequest
from daemon.models import ACTIVE, STATUSES, TERMINAL
from molt_engine.serving.agents import Agent
from molt_engine.config import PRESETS, RunConfig
from molt_engine.envs import ENVS, load_user_envs

from . import rest
from .auth import CSRF_FIELD, SESSION_COOKIE, same_origin

TEMPLATES = Jinja2Templates(directory=Path(__file__).resolve().parent.parent / "templates")  # autoescape is on
TEMPLATES.env.filters["tojson_pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True)
router = APIRouter(include_in_schema=False)

# The launch form's fields: (form name, path in the config, type, label). The rest goes in "advanced JSON".
FORM_FIELDS = [
    ("steps", ("loop", "steps"), int, "steps"),
    ("groups_per_step", ("loop", "groups_per_step"), int, "groups per step"),
    ("group_size", ("loop", "group_size"), int, "group size"),
    ("max_staleness", ("loop", "max_staleness"), int, "max staleness"),
    ("lr", ("algo", "lr"), float, "learning rate"),
    ("estimator", ("algo", "estimator"), str, "estimator"),
    ("warm_start", ("warm_start", "steps"), int, "warm-start steps"),
    ("eval_every", ("loop", "eval_every"), int, "eval every"),
    ("checkpoint_every", ("checkpoint", "every"), int, "checkpoint every"),
    ("seed", ("seed",), int, "seed"),
]
RUNS_PER_PAGE = 100
DATASET_FIELDS = ("path", "eval_path", "reward")  # env_args of the dataset env that the launch form asks for
# What the launch form posts, all as the text typed: the handler converts it, so a bad number is an inline error
LaunchForm = create_model("LaunchForm", **{field: (str, "") for field in [
    "env", "preset", "path", "name", "tags", "max_restarts", "advanced", CSRF_FIELD, *(f[0] for f in FORM_FIELDS),
    *(f"dataset_{f}" for f in DATASET_FIELDS)]})


class LoginRequired(Exception):
    pass


def page_auth(request: Request):
    """The pages' gate: the session cookie, or ?token= (which then sets the cookie)."""
    if request.app.state.auth.method(request) is None:
        raise LoginRequired


def render(request: Request, template: str, status_code: int = 200, **context) -> HTMLResponse:
    auth = request.app.state.auth
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

def list_context(request: Request, status: str | None, tag: str | None, before: int | None) -> dict:
    """One page of runs, newest first; `before` (a run id) starts the page after the runs newer than it."""
    status = status if status in STATUSES else None
    runs = request.app.state.records.list_runs(status=status, tag=tag or None, limit=RUNS_PER_PAGE + 1, before=before)
    filters = {k: v for k, v in (("status", status), ("tag", tag)) if v}
    older = {**filters, "before": runs[RUNS_PER_PAGE - 1]["id"]} if len(runs) > RUNS_PER_PAGE else None
    return {"runs": runs[:RUNS_PER_PAGE], "status": status, "tag": tag or "", "statuses": STATUSES,
            "query": urlencode({**filters, **({"before": before} if before else {})}), "first_page": before is None,
            "newest": "/?" + urlencode(filters), "older": "/?" + urlencode(older) if older else None}


@router.get("/")
@guarded
def runs_page(request: Request, status: str | None = None, tag: str | None = None, before: int | None = None):
    return render(request, "runs.html", gpus=machine_gpus(), **list_context(request, status, tag, before))


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
def runs_rows(request: Request, status: str | None = None, tag: str | None = None, before: int | None = None):
    return render(request, "_runs_rows.html", **list_context(request, status, tag, before))


# ---- launch ---------------------------------------------------------------------------------------------------------

def form_values(config: dict) -> tuple[dict, dict]:
    """Split a config into the form's fields and the rest (shown as advanced JSON, non-defaults only)."""
    rest_config = json.loads(json.dumps(config))
    values = {"env": rest_config.pop("env", ""), "preset": "", "path": ""}
    env_args = rest_config.get("env_args", {})
    if values["env"] == "dataset":
        for field in DATASET_FIELDS:
            values[f"dataset_{field}"] = str(env_args.pop(field, "") or "")
        if not env_args:
            rest_config.pop("env_args", None)
    model = rest_config.pop("model", {}) or {}
    values["preset"], values["path"] = model.get("preset") or "", model.get("path") or ""
    for name, path, _, _ in FORM_FIELDS:
        node = rest_config
        for key in path[:-1]:
            node = node.get(key, {})
        if path[-1] in node:
            values[name] = node.pop(path[-1])
    defaults = RunConfig(env="max_digit").model_dump(mode="json")  # the same for every env; some need env_args
    return values, non_default(rest_config, defaults)


def non_default(config: dict, defaults: dict) -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            if sub := non_default(value, defaults[key]):
                out[key] = sub
        elif key not in defaults or defaults[key] != value:
            out[key] = value
    return out


def launch_context(values: dict, advanced: str, errors: dict | None = None, name: str = "", tags: str = "",
                   max_restarts: str = "") -> dict:
    load_user_envs()  # the user's env directories (--envs): a file added or fixed since start is offered now
    defaults = RunConfig(env="max_digit").model_dump(mode="json")
    placeholders = {}
    for field, path, _, _ in FORM_FIELDS:
        node = defaults
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        placeholders[field] = "" if node is None else node
    return {"values": values, "advanced": advanced, "errors": errors or {}, "envs": sorted(ENVS),
            "chat_envs": {name: cls.tool_names() for name, cls in ENVS.items() if cls.chat},
            "agents": {name for name, cls in ENVS.items() if issubclass(cls, Agent)},
            "presets": PRESETS, "fields": FORM_FIELDS, "placeholders": placeholders, "name": name,
            "tags": tags, "max_restarts": max_restarts}


@router.get("/runs/new")
@guarded
def launch_page(request: Request, clone: int | None = None):
    values, advanced, name, tags = {"env": "max_digit", "preset": "tiny-dense", "path": ""}, {}, "", ""
    if clone is not None:
        try:
            run = request.app.state.records.get_run(clone)
        except RunNotFound:
            raise HTTPException(404, f"no run {clone}") from None
        values, advanced = form_values(run["config"])
        name, tags = f"{run['name']} (clone)", ", ".join(run["tags"])
    return render(request, "launch.html", **launch_context(values, json.dumps(advanced, indent=2) if advanced else "",
                                                           name=name, tags=tags))


@router.post("/runs/new")
@guarded
def launch(request: Request, form: Annotated[LaunchForm, Form()]):
    check_csrf(request, getattr(form, CSRF_FIELD))
    values = {k: getattr(form, k).strip() for k in ["env", "preset", "path"] + [f[0] for f in FORM_FIELDS]
              + [f"dataset_{f}" for f in DATASET_FIELDS]}
    advanced, name, tags, max_restarts = form.advanced, form.name.strip(), form.tags, form.max_restarts.strip()
    errors: dict[str, list[str]] = {}
    config: dict = {"env": values["env"]}
    if values["env"] == "dataset":  # the dataset env's own inputs; other envs take env_args in the advanced JSON
        config["env_args"] = {f: values[f"dataset_{f}"] for f in DATASET_FIELDS if values[f"dataset_{f}"]}
    if values["path"]:
        config["model"] = {"preset": None, "path": values["path"]}
    elif values["preset"]:
        config["model"] = {"preset": values["preset"]}
    for field, path, kind, _ in FORM_FIELDS:
        raw = values[field]
        if raw == "":
            continue  # the default
        try:
            value = kind(raw)
        except ValueError:
            errors.setdefault(field, []).append("must be " + ("a whole number" if kind is int else "a number"))
            continue
        node = config
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    if advanced.strip():
        try:
            extra = json.loads(advanced)
            if not isinstance(extra, dict):
                raise ValueError("must be a JSON object")
            config = deep_merge(config, extra)
        except ValueError as e:
            errors.setdefault("advanced", []).append(f"not valid JSON: {e}")
    wanted = {"config": config, "name": name or None, "tags": [t.strip() for t in tags.split(",") if t.strip()]}
    try:
        if max_restarts:
            wanted["max_restarts"] = int(max_restarts)
    except ValueError:
        errors.setdefault("max_restarts", []).append("must be a whole number")
    run = None
    if not errors:
        try:
            run = request.app.state.records.queue_run(RunRequest.model_validate(wanted))
        except ValidationError as e:
            for err in e.errors():
                loc = err["loc"]
                where = ".".join(map(str, loc[1:] if loc[:1] == ("config",) and len(loc) > 1 else loc))
                errors.setdefault(form_field(loc), []).append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
    if run is not None:
        target = f"/runs/{run['id']}"
        if request.headers.get("hx-request"):
            return Response(status_code=201, headers={"HX-Redirect": target})
        return RedirectResponse(target, status_code=303)
    context = launch_context(values, advanced, errors, name, tags, max_restarts)
    if request.headers.get("hx-request"):
        # 200 so that htmx swaps the form with its inline errors in (it ignores 4xx bodies by default)
        return render(request, "_launch_form.html", **context)
    return render(request, "launch.html", status_code=422, **context)


def form_field(loc: tuple) -> str:
    """Which input of the launch form a RunRequest error belongs to ("advanced" for config keys without their own
    input)."""
    if loc[:1] != ("config",):
        return str(loc[0])
    path = tuple(str(p) for p in loc[1:])
    if path[:1] == ("env",) or path[:1] == ("env_args",):
        return "env"
    if path[:1] == ("model",):
        return "path" if path[1:2] == ("path",) else "preset"
    for field, field_path, _, _ in FORM_FIELDS:
        if path[:len(field_path)] == field_path:
            return field
    return "advanced"


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


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
    return render(request, "run.html", run=run, active=ACTIVE, terminal=TERMINAL,
                  page={"run_id": run_id, "max_staleness": run["config"]["loop"]["max_staleness"]})


@router.get("/runs/{run_id}/samples")
@guarded
def samples_page(request: Request, run_id: int):
    """The recorded episodes, token by token; the filters live in the URL and the script reads them (samples.js)."""
    run = get_run_or_404(request, run_id)
    return render(request, "samples.html", run=run, page={"run_id": run_id})


@router.get("/runs/{run_id}/panels/{panel}")
@guarded
def run_panel(request: Request, run_id: int, panel: str):
    records = request.app.state.records
    run = get_run_or_404(request, run_id)
    if panel == "actions":
        return render(request, "_actions.html", run=run, active=ACTIVE)
    if panel == "alerts":
        return render(request, "_alerts.html", run=run, alerts=records.alerts(run_id)[::-1])
    if panel == "records":
        return render(request, "_records.html", run=run, attempts=records.attempts(run_id),
                      checkpoints=records.checkpoints(run_id), events=records.events(run_id)[-30:][::-1])
    if panel == "log":
        return render(request, "_log.html", run=run, log=records.log_tail(run_id, max_bytes=16384), active=ACTIVE)
    raise HTTPException(404, f"no panel {panel}")


@router.post("/runs/{run_id}/{action}")
@guarded
def run_action(request: Request, run_id: int, action: str, csrf_token: Annotated[str | None, Form()] = None):
    check_csrf(request, csrf_token)
    records = request.app.state.records
    calls = {"stop": records.stop_run, "resume": records.resume_run}
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
    return render(request, "_alerts.html", run=run, alerts=request.app.state.records.alerts(run_id)[::-1])


# ---- compare --------------------------------------------------------------------------------------------------------

@router.get("/compare")
@guarded
def compare_page(request: Request, ids: Annotated[list[str], Query()] = [], all: bool = False):  # noqa: B006
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
    leaves = [flatten(r["config"]) for r in runs]
    keys = sorted(set().union(*leaves)) if leaves else []
    rows = [(k, [lv.get(k, "—") for lv in leaves]) for k in keys]
    differing = [(k, vals) for k, vals in rows if len({json.dumps(v) for v in vals}) > 1]
    return render(request, "compare.html", runs=runs, rows=rows if all else differing, all=all,
                  differing=len(differing), total=len(rows), ids=",".join(str(r["id"]) for r in runs),
                  page={"run_ids": [r["id"] for r in runs], "names": {r["id"]: r["name"] for r in runs}},
                  recent=records.list_runs(limit=30))


def flatten(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


async def invalid_page(request: Request, errors: list[dict], status: int) -> Response:
    """A bad query parameter on a page (e.g. /runs/abc): a plain error page, not JSON."""
    message = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
    return HTMLResponse(f"<!doctype html><title>Bad request</title><p>Bad request: {_escape(message)}</p>",
                        status_code=404 if request.url.path.startswith("/runs/") else status)


def _escape(text: str) -> str:
    return str(escape(text))
