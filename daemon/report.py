"""The sink of an external run (`molt train --report-to URL`): it posts its batches to a dashboard's ingest API."""
import json
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

from .sink import FLUSH_EVERY_S, SpoolSink, jsonable


class HttpSink(SpoolSink):
    """The sink of an external run (`molt train --report-to URL`): each batch is POSTed, in order, to the dashboard's
    ingest endpoint, which writes it with write_records (idempotent: a re-sent batch duplicates nothing). The run is
    registered with the dashboard token on the first delivery, which returns the run-scoped ingest token that every
    later request carries; until then records wait in the spool, so training never waits on the dashboard. With
    `resume` the run saved in out_dir/report.json gets a new attempt instead, and what an earlier process spooled
    but never delivered goes first. With `attach` (run id, ingest token) it is a daemon run's rank 0 on a Ray node
    (ray_place.place), writing into the attempt the daemon's worker opened. Each reply says whether a stop was
    requested: then this process gets SIGTERM, as a daemon's worker does, and the engine checkpoints and stops.
    `echo` (the terminal's progress sink) sees every call too."""
    what = "report"
    backoff = 16          # retries of a failing batch: every 0.3 s, doubling up to about 5 s
    drain_s = 120.0       # at the end, how long a dashboard that is down may take to come back
    chunk = 500           # records per request

    def __init__(self, url: str, token: str, config: dict, out_dir: Path, name: str | None = None, ranks: int = 1,
                 echo=None, flush_every: float = FLUSH_EVERY_S, spool_cap: int = 256 * 2**20, resume: bool = False,
                 attach: tuple[int, str] | None = None):
        import httpx
        self.url, self.token, self.echo, self.ranks = url.rstrip("/"), token, echo, ranks
        self.config, self.name = config, name
        # The registration, kept beside the checkpoints: `--resume` reports to the same run, as its next attempt
        self.saved = Path(out_dir) / "report.json"
        previous = json.loads(self.saved.read_text()) if resume and self.saved.exists() else {}
        same = previous.get("url") == self.url
        self.run_id, self.ingest_token = (previous["run_id"], previous["ingest_token"]) if same else (None, None)
        if attach:  # a daemon run's rank 0 on another node: (run id, ingest token); its worker opened the attempt
            self.run_id, self.ingest_token = attach
        self.attached = attach is not None
        self.session = uuid.uuid4().hex[:12]  # alert and event uids: "session:seq", unique per run
        self.once = uuid.uuid4().hex  # the Idempotency-Key of our registration or resume: its retries make one
        self.stop_requested = False
        self.client = httpx.Client(timeout=10)
        super().__init__("molt-report", out_dir, "report-spool", flush_every,
                         (config.get("record") or {}).get("keep_steps"), spool_cap, replay=resume)

    def metrics(self, step, values):
        super().metrics(step, values)
        self.echo and self.echo.metrics(step, values)

    def alert(self, kind, message, **data):
        super().alert(kind, message, **data)
        self.echo and self.echo.alert(kind, message, **data)

    def event(self, kind, message, **data):
        super().event(kind, message, **data)
        self.echo and self.echo.event(kind, message, **data)

    def checkpoint(self, step, path, **info):
        # its size measured here: the dashboard's machine cannot see this one's files
        info.setdefault("size_bytes", sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()))
        super().checkpoint(step, path, **info)

    def end(self, status: str, summary: dict | None = None, error: str | None = None):
        """The run's outcome (completed, stopped, tripped, failed): delivered last, then the sink closes, waiting up to
        drain_s for a dashboard that is down. What is still undelivered then stays in the spool."""
        self._tell_dropped("the spool was full")  # before the end: the dashboard takes nothing after it
        self._add({"t": "end", "time": time.time(), "status": status, "summary": summary, "error": error})
        self.close(self.drain_s + 30)
        if self._pending:
            print(f"molt: {len(self._pending)} records could not be reported to {self.url}; they stay in "
                  f"{self.spool_dir}", file=sys.stderr, flush=True)
        self.client.close()

    def _uid(self) -> str:
        return f"{self.session}:{self._seq}"

    def _post(self, path: str, token: str, body: dict, key: str | None = None) -> dict:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                   **({"Idempotency-Key": key} if key else {})}
        response = self.client.post(self.url + path, content=json.dumps(body, default=jsonable), headers=headers)
        if response.status_code == 409 and not self.stop_requested:
            # The dashboard ended this run (marked stopped or failed while it did not report) or will not reopen it
            # (a completed run resumed with no more steps): it takes nothing more, so training stops as if asked,
            # and the records stay in the spool for a later `--resume` (which opens a new attempt).
            self.stop_requested, self.drain_s = True, 1.0
            print(f"molt: the dashboard takes no more records of this run ({response.json().get('detail')}): "
                  f"stopping; what was not reported stays in {self.spool_dir}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)  # what the daemon sends its worker: the engine checkpoints
        if response.is_error:
            raise RuntimeError(f"{response.status_code} from {self.url + path}: {response.text[:300]}")
        return response.json()

    def _deliver(self, batch: list[dict], beat: float | None):
        where = {"host": socket.gethostname(), "pid": os.getpid(), "ranks": self.ranks}
        if self.run_id is None:
            registered = self._post("/api/v1/external-runs", self.token,
                                    {"name": self.name, "config": self.config, **where}, self.once)
            self.run_id, self.ingest_token = registered["run"]["id"], registered["ingest_token"]
            fd = os.open(self.saved, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the token is a credential
            os.fchmod(fd, 0o600)  # also when the file was there before (O_CREAT's mode applies only to a new one)
            with os.fdopen(fd, "w") as f:
                json.dump({"url": self.url, "run_id": self.run_id, "ingest_token": self.ingest_token}, f)
            print(f"molt: reporting to {self.url}/runs/{self.run_id}", file=sys.stderr, flush=True)
        elif not self.attached:
            self._post(f"/api/v1/runs/{self.run_id}/attempts", self.ingest_token,
                       {**where, "steps": (self.config.get("loop") or {}).get("steps")}, self.once)
            print(f"molt: resuming {self.url}/runs/{self.run_id}", file=sys.stderr, flush=True)
        self.attached = True
        age = None if beat is None else max(0.0, time.time() - beat)
        for i in range(0, max(1, len(batch)), self.chunk):
            reply = self._post(f"/api/v1/runs/{self.run_id}/ingest", self.ingest_token,
                               {"records": batch[i:i + self.chunk], "heartbeat_age": age})
            if reply["stop"] and not self.stop_requested:
                self.stop_requested = True
                print("molt: stop requested from the dashboard: checkpointing", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)  # what the daemon sends its worker: the engine checkpoints
