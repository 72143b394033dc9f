"""The FastAPI application: `create_app(home, token)` wires the REST API, /metrics, the pages, the websockets and the
poller."""
import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from daemon.records import Records, RunNotFound

from . import eval_pages, evals, ingest, launch, pages, prometheus, rest, sweeps, tinker
from .auth import Auth, load_or_create_token, same_origin
from .live import OVERFLOW, Hub, daemon_message, dumps
from .series import SeriesCache

STATIC = Path(__file__).resolve().parent / "static"
BACKFILL_POINTS = 2000   # per series, when a viewer connects: the chart's width in pixels is about that
log = logging.getLogger("molt.app")


def create_app(home: str | Path | None = None, token: str | None = None, *, webhook_url: str | None = None,
               public_url: str | None = None, poll: float | None = None, metrics_public: bool = False,
               concurrency: int | None = None, gpus: list[str] | None = None) -> FastAPI:
    """The app over the data directory `home` (migrated on start). `token`: default $MOLT_TOKEN, else the one
    saved in the data directory (created on first start). `metrics_public`: /metrics without the token.
    `concurrency`: the daemon's, as `molt serve` started it (the pages show it beside a queued run); `gpus`: its GPU
    pool (`molt serve --gpus`; None = every visible GPU, as the daemon's default), which Tinker clients take from."""
    records = Records(home)
    token = token or load_or_create_token(records.home)
    hub = Hub(records.engine, records.home, records.daemon_status, webhook_url=webhook_url, public_url=public_url,
              **({"poll": poll} if poll else {}))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # One request through the app before it listens: the first request pays ~100 ms of one-time work (anyio's
        # thread pool imports, FastAPI building its routes' validators, SQLAlchemy compiling the ORM queries), and
        # that first request should be the user's metrics chart no more than any other. It reads no data (run 0),
        # and whatever it meets (a busy database) must not stop the start.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://warm-up") as client:
            await client.get("/api/v1/runs/0/metrics", headers={"Authorization": f"Bearer {token}"})
        task = asyncio.create_task(hub.run())
        try:
            yield
        finally:
            task.cancel()

    # docs_url=None: FastAPI's /docs loads Swagger UI from a CDN; ours serves the vendored copy (below)
    app = FastAPI(title="Molt Studio", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="REST API of Molt Studio. Authenticate with `Authorization: Bearer <token>`; the "
                              "token is printed by `molt serve` and kept in the data directory's `token` file.")
    app.state.records, app.state.auth, app.state.hub = records, Auth(token), hub
    app.state.series = SeriesCache(records.engine)
    app.state.webhook_url = webhook_url
    app.state.metrics_public = metrics_public
    app.state.concurrency = concurrency
    app.state.prometheus = CollectorRegistry(auto_describe=False)
    app.state.prometheus.register(prometheus.RecordsCollector(records))

    @app.exception_handler(RunNotFound)
    async def not_found(request: Request, exc: RunNotFound):
        return JSONResponse({"detail": f"not found: {exc.args[0]}"}, status_code=404)

    @app.exception_handler(StarletteHTTPException)
    async def not_found_page(request: Request, exc: StarletteHTTPException):
        """A page that does not exist gets a page saying so; the API (and static files) keep their JSON 404."""
        if exc.status_code != 404 or request.url.path.startswith(("/api/", "/static/", "/ws/")):
            return await http_exception_handler(request, exc)
        signed_in = app.state.auth.method(request) is not None
        detail = exc.detail if exc.detail != "Not Found" else f"There is no page at {request.url.path}."
        return pages.render(request, "404.html", 404, detail=detail, hide_logout=not signed_in,
                            **({} if signed_in else {"csrf": ""}))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        # FastAPI's shape ({"detail": [{"loc", "msg", "type"}]}), minus the echoed input (it may be huge), and
        # 400 rather than 422 for a body that is not JSON at all
        errors = [{"loc": list(e["loc"]), "msg": e["msg"].removeprefix("Value error, "), "type": e["type"]}
                  for e in exc.errors()]
        status = 400 if any(e["type"] == "json_invalid" for e in errors) else 422
        if not request.url.path.startswith("/api/"):
            return await pages.invalid_page(request, errors, status)
        return JSONResponse({"detail": errors}, status_code=status)

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Molt Studio API",
                                   swagger_js_url="/static/vendor/swagger-ui-bundle.js",
                                   swagger_css_url="/static/vendor/swagger-ui.css",
                                   swagger_favicon_url="/static/vendor/favicon.png")

    app.include_router(ingest.router)
    app.include_router(rest.router)
    app.include_router(evals.router)
    app.include_router(sweeps.router)
    app.include_router(sweeps.pages)
    app.include_router(eval_pages.router)
    app.include_router(prometheus.router)
    app.include_router(launch.router)  # before pages: /runs/new is not /runs/{run_id}
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    # its own key, its own errors (docs/tinker.md); its training clients share the daemon's slots
    app.mount("/tinker", tinker.mounted(records, app.state.auth, concurrency, gpus))

    @app.websocket("/ws/daemon")
    async def daemon_updates(ws: WebSocket):
        """The daemon's state now, then each time it changes: {"type": "daemon", "alive", "pid", "restarts",
        "stopped", "message", "last_event"}; `message` says what is wrong while it is not alive (every page shows it;
        `stopped`: stopped on request, the page offers to start it)."""
        method = app.state.auth.method(ws)
        if method is None or (method == "cookie" and not same_origin(ws)):
            await ws.close(code=1008)
            return
        await ws.accept()
        try:
            with hub.subscribe_daemon() as queue:
                now = daemon_message(await asyncio.to_thread(records.daemon_status))
                await ws.send_text(dumps(now))
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(_pump(ws, queue))
                    tasks.create_task(_drain(ws))
        except* (WebSocketDisconnect, _Overflow):
            pass

    @app.websocket("/ws/runs/{run_id}")
    async def run_updates(ws: WebSocket, run_id: int, after_step: int = -1, max_points: int = BACKFILL_POINTS):
        """On connect: the run's status, its metrics after `after_step` (min/max-bucketed to `max_points` per
        series), its alerts and recent events; then every new record as it is committed. JSON messages
        {"type": "status"|"metrics"|"alert"|"ack"|"event"|"backfilled", ...}."""
        method = app.state.auth.method(ws)
        # A cookie comes with any page's request: only our own pages may use it (cross-site websocket hijacking)
        if method is None or (method == "cookie" and not same_origin(ws)):
            await ws.close(code=1008)  # before accept: the handshake is answered 403
            return
        await ws.accept()
        try:
            with hub.subscribe(run_id) as queue:
                await hub.watching()
                try:
                    backfill = await asyncio.to_thread(read_backfill, app, run_id, after_step,
                                                       max(10, min(max_points, 100_000)))
                except RunNotFound:
                    await ws.send_text(dumps({"type": "error", "detail": f"no run {run_id}"}))
                    await ws.close(code=4404)
                    return
                for message in backfill:
                    await ws.send_text(dumps(message))
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(_pump(ws, queue))
                    tasks.create_task(_drain(ws))
        except* (WebSocketDisconnect, _Overflow):  # a tab closed, or a viewer too slow: it reconnects and backfills
            pass

    return app


class _Overflow(Exception):
    pass


async def _pump(ws: WebSocket, queue: asyncio.Queue):
    while True:
        text = await queue.get()
        if text is OVERFLOW:
            await ws.close(code=1013)  # "try again later"
            raise _Overflow
        await ws.send_text(text)


async def _drain(ws: WebSocket):
    """Read (and ignore) what the client sends: the only way to notice a closed tab while no message goes out."""
    while True:
        await ws.receive_text()


def read_backfill(app: FastAPI, run_id: int, after_step: int, max_points: int) -> list[dict]:
    records = app.state.records
    run = records.get_run(run_id)
    metrics = rest.metric_series(app.state.series, run_id, None, after_step, max_points)
    attempts = [[a["started_at"], a["ended_at"]] for a in records.attempts(run_id)]  # as the poller's status has them
    return [{"type": "status", "run": {**run, "attempts": attempts}},
            {"type": "metrics", "series": metrics["series"], "backfill": True},
            {"type": "alerts", "alerts": records.alerts(run_id)},
            {"type": "events", "events": records.events(run_id)[-50:]},
            {"type": "backfilled", "after_step": after_step}]
