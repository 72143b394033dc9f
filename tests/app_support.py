"""Helpers of the app tests: `molt serve` as a real child process, the app under uvicorn in a thread, a webhook
receiver. Imported by tests/test_app*.py and tests/test_ui*.py (their fixtures are defined there)."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session

from daemon.db import set_run
from daemon.models import Attempt
from daemon.records import Records
from daemon.sink import DbSink

ROOT = Path(__file__).resolve().parent.parent
FAST = {"env": "max_digit", "loop": {"steps": 30, "groups_per_step": 4, "group_size": 4, "eval_every": 0},
        "warm_start": {"steps": 5}, "checkpoint": {"every": 5}}
# trips: a spike at every step from 10 on, with no rollback allowed, ends the run as `tripped`
TRIPS = {**FAST, "drills": {"spike_at": list(range(10, 21))}, "breaker": {"min_history": 3, "max_rollbacks": 0}}
# fails: the worker dies at step 3 on every attempt, and no restart is allowed
FAILS = {**FAST, "drills": {"crash_at": [3], "crash_repeat": True}}
URL_LINE = re.compile(r"Molt Studio is ready: (http://\S+)")


def molt(*args: str) -> list[str]:
    """The `molt` console script's command line, runnable without installing the package."""
    return [sys.executable, "-m", "app.cli", *args]


def child_env(home: Path, **extra) -> dict:
    env = {**os.environ, "MOLT_HOME": str(home), "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **extra}
    env.pop("MOLT_TOKEN", None)
    return env


class Served:
    """A `molt serve` child process: the URL it printed, its token, its output so far."""

    def __init__(self, home: Path, *extra_args: str):
        self.home = Path(home)
        self.proc = subprocess.Popen(molt("serve", "--home", str(home), "--port", "0", *extra_args),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                     env=child_env(home))
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 90
        while not (found := [m for line in list(self.lines) if (m := URL_LINE.search(line))]):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("molt serve printed no URL:\n" + self.output)
            time.sleep(0.05)
        self.url = found[0].group(1)                      # http://127.0.0.1:PORT/?token=...
        self.base = self.url.split("/?")[0]
        self.token = self.url.split("token=")[1]
        self.client = httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {self.token}"},
                                   timeout=60)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def create(self, config: dict, **fields) -> dict:
        response = self.client.post("/api/v1/runs", json={"config": config, **fields})
        assert response.status_code == 201, response.text
        return response.json()

    def wait(self, run_id: int, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            run = self.client.get(f"/api/v1/runs/{run_id}/wait", params={"timeout": 10}).json()
            if run["status"] in ("completed", "failed", "stopped", "tripped") or time.monotonic() > deadline:
                return run

    def interrupt(self, timeout: float = 90) -> int:
        """Ctrl-C, as a terminal sends it; the exit status."""
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        finally:
            self._reader.join(5)

    def close(self):
        self.client.close()
        if self.proc.poll() is None:
            self.interrupt()


@contextmanager
def serve(home: Path, *extra_args: str):
    served = Served(home, *extra_args)
    try:
        yield served
    finally:
        served.close()


@contextmanager
def web_thread(home: Path, token: str, **app_options):
    """The app under a real uvicorn on a free loopback port, in this process (no daemon): yields (base URL, app)."""
    import uvicorn

    from app.main import create_app
    app = create_app(home, token, **app_options)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(10)


class WebhookReceiver:
    """A local HTTP server that records the JSON bodies POSTed to it, with their arrival time."""

    def __init__(self):
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                received.append({"time": time.time(), "body": json.loads(body),
                                 "content_type": self.headers.get("content-type")})
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hook():
    """A local webhook receiver for the alerts' POSTs (import this fixture into a test module to use it)."""
    receiver = WebhookReceiver()
    yield receiver
    receiver.close()


# ---- the app in a thread over a real SQLite, for the REST and page tests (import `web` into a module to use it) ------

TOKEN = "test-token-1234"


@pytest.fixture(scope="module")
def web(tmp_path_factory, hook):
    home = tmp_path_factory.mktemp("home")
    with web_thread(home, TOKEN, webhook_url=hook.url, public_url="http://molt.example") as (base, app):
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        yield {"base": base, "app": app, "client": client, "records": Records(home), "home": home}
        client.close()


def new_run(web, name=None, config=FAST) -> dict:
    response = web["client"].post("/api/v1/runs", json={"config": config, **({"name": name} if name else {})})
    assert response.status_code == 201, response.text
    return response.json()


def sink_for(web, run_id) -> DbSink:
    """The daemon's database sink, as a worker of this run would hold it."""
    api = web["records"]
    with Session(api.engine) as s:
        attempt = Attempt(run_id=run_id, number=len(api.attempts(run_id)) + 1)
        s.add(attempt)
        s.commit()
        attempt_id = attempt.id
    return DbSink(api.engine, run_id, attempt_id, flush_every=0.05)


def logged_in(web) -> tuple[httpx.Client, str]:
    browser = httpx.Client(base_url=web["base"], timeout=10)
    browser.post("/login", data={"token": TOKEN})
    page = browser.get("/runs/new").text
    csrf = page.split('name="csrf_token" value="')[1].split('"')[0]
    return browser, csrf


def trained_run(records: Records, config: dict, name: str, **values) -> dict:
    """A run trained in this process into `records` (a real database), then marked completed (with `values`). In a
    thread: Playwright's sync API keeps an event loop running on this one."""
    from molt_engine import train

    run = records.create_run(config, name=name)
    sink = DbSink(records.engine, run["id"], 0)
    try:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(train, config, sink).result()
    finally:
        sink.close()
    with records.engine.begin() as conn:
        set_run(conn, run["id"], status="completed", **values)
    return run
