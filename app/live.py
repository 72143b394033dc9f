"""Live updates: one poller per app reads what was recorded since its last look and fans it out to websockets and
to the alert webhook; while a page is open it also looks at the daemon's state, for the banner every page shows.

Why one poller: its cost does not grow with the number of viewers. Every POLL_S it reads the rows newer than its
cursors (metric, alert and event ids: rowid range scans, microseconds when nothing is new) and the status of the
watched runs; each message is serialized once and queued to every viewer of that run.

A resumed or rolled-back run records again the steps after its checkpoint: those rows are updated in place (their
ids do not change), so for such a run the poller also watches that step range by time until the replay has caught
up."""
import asyncio
import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from sqlalchemy import bindparam, func, select
from sqlalchemy.engine import Engine

from daemon.db import DAEMON_HANG_S
from daemon.models import Alert, Attempt, Event, Metric, Run

from .series import NONFINITE_NAMES, REPLAY_EVENTS, metric_names

log = logging.getLogger("molt.app")
POLL_S = 0.1
QUEUE_MAX = 2000          # messages a slow viewer may lag behind before it is disconnected (it then reconnects)
OVERFLOW = object()
REPLAY_WATCH_S = 3600     # give up watching a replay that never catches up (e.g. the run was stopped meanwhile)
DAEMON_CHECK_S = 0.5      # how often the daemon's state is looked at while a page watches it

# The poller's queries, built once (a poll then costs ~0.1 ms when nothing is new). `runs`: the watched run ids.
METRIC_FIELDS = (Metric.id, Metric.run_id, Metric.name, Metric.step, Metric.value, Metric.time)
NEWEST = {table: select(func.coalesce(func.max(table.id), 0)) for table in (Metric, Alert, Event)}
NEW_METRICS = (select(*METRIC_FIELDS).where(Metric.id > bindparam("after"), Metric.id <= bindparam("newest"),
                                             Metric.run_id.in_(bindparam("runs", expanding=True))).order_by(Metric.id))
NEW_ALERTS = (select(Alert.id, Alert.run_id, Alert.time, Alert.step, Alert.kind, Alert.message, Alert.data,
                     Alert.acknowledged).where(Alert.id > bindparam("after")).order_by(Alert.id))
NEW_EVENTS = (select(Event.id, Event.run_id, Event.time, Event.step, Event.kind, Event.source, Event.message,
                     Event.data).where(Event.id > bindparam("after")).order_by(Event.id))
OPEN_ALERTS = (select(Alert.run_id, func.count()).where(~Alert.acknowledged,
                                                        Alert.run_id.in_(bindparam("runs", expanding=True)))
               .group_by(Alert.run_id))
RUNS = select(Run.id, Run.name, Run.status, Run.step, Run.total_steps, Run.version, Run.reward, Run.restarts, Run.pid,
              Run.last_error, Run.started_at, Run.finished_at).where(Run.id.in_(bindparam("runs", expanding=True)))
# each attempt's [start, end] (end None while it runs): the page counts training time from these, not the queued time
ATTEMPTS = (select(Attempt.run_id, Attempt.started_at, Attempt.ended_at)
            .where(Attempt.run_id.in_(bindparam("runs", expanding=True))).order_by(Attempt.number))
LAST_REWARD_STEP = select(func.max(Metric.step)).where(Metric.run_id == bindparam("run_id"),
                                                       Metric.name == "reward_mean")
REPLAYED = select(*METRIC_FIELDS).where(Metric.run_id == bindparam("run_id"), Metric.name == bindparam("name"),
                                        Metric.step > bindparam("after"), Metric.step <= bindparam("until"),
                                        Metric.time > bindparam("since"))


def dumps(message: dict) -> str:
    return json.dumps(_finite(message), separators=(",", ":"))


def _finite(v):
    """JSON has no NaN/infinity: the strings "NaN", "Infinity", "-Infinity" stand for them (see series.py)."""
    if isinstance(v, float) and not math.isfinite(v):
        return NONFINITE_NAMES[str(v)]
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def daemon_message(status: dict) -> dict:
    """What every page shows about the daemon (Records.daemon_status): `message` is empty while it is alive."""
    last = status["last_event"]
    if status["alive"]:
        message = ""
    elif status["running"]:
        message = (f"The daemon (pid {status['pid']}) is not responding: no heartbeat for over "
                   f"{DAEMON_HANG_S:.0f} s. Runs are not supervised until it is restarted.")
    elif status["stopped"]:
        message = (f"The daemon is stopped (pid {last['pid']} was asked to stop): queued runs wait until it starts "
                   f"again (Start, or `molt daemon start --home {status['home']}`).")
    elif last and last["kind"] == "start_requested":
        message = "A start of the daemon was requested: queued runs wait until it is up."
    elif last and last["kind"] == "down":
        message = (f"The daemon is down: {last['cause']} (pid {last['pid']}); it is being restarted. Queued runs "
                   f"wait; running workers train on.")
    else:
        message = "No daemon is running: queued runs wait, and nobody restarts a worker that dies."
    return {"type": "daemon", "alive": status["alive"], "pid": status["pid"], "restarts": status["restarts"],
            "stopped": status["stopped"], "message": message, "last_event": last}


class Hub:
    def __init__(self, engine: Engine, home: Path, daemon_status, webhook_url: str | None = None,
                 public_url: str | None = None, poll: float = POLL_S):
        self.engine, self.home, self.poll = engine, Path(home), poll
        self.daemon_status = daemon_status   # Records.daemon_status
        self.daemon_viewers: set[asyncio.Queue] = set()
        self.daemon: dict | None = None      # the daemon message last pushed
        self.daemon_checked = 0.0
        self.webhook_url, self.public_url = webhook_url, (public_url or "").rstrip("/")
        self.viewers: dict[int, set[asyncio.Queue]] = {}
        self.last_status: dict[int, dict] = {}
        self.cursor = {Metric: 0, Alert: 0, Event: 0}  # the newest row id seen, per table
        self.replays: dict[int, dict] = {}   # run id -> {"after", "until", "since", "started"}: see the docstring
        self.snapshot = asyncio.Event()      # set (and replaced) each time a poll fixes the set of watched runs
        self.webhook_queue: asyncio.Queue = asyncio.Queue()
        self.webhook_sent = 0                # posts that got a 2xx (tests and /api/v1/health read it)
        self.polls = 0

    # ---- viewers --------------------------------------------------------------------------------------------------

    @contextmanager
    def subscribe(self, run_id: int):
        """A queue of JSON texts about the run (OVERFLOW when the viewer fell too far behind). Subscribe before
        reading the backfill: a row committed in between then arrives twice (clients merge by step and id), never
        zero times."""
        queue: asyncio.Queue = asyncio.Queue(QUEUE_MAX)
        self.viewers.setdefault(run_id, set()).add(queue)
        try:
            yield queue
        finally:
            self.viewers[run_id].discard(queue)
            if not self.viewers[run_id]:
                del self.viewers[run_id]
                self.last_status.pop(run_id, None)

    async def watching(self):
        """Returns once a poll has started that includes the runs subscribed so far. A viewer reads its backfill
        only after this: the polls before it skipped the run's rows, but those were committed before this
        returns, so the backfill has them."""
        try:
            await asyncio.wait_for(self.snapshot.wait(), 2.0)
        except asyncio.TimeoutError:  # no poller running (an app without lifespan): nothing to wait for
            pass

    @contextmanager
    def subscribe_daemon(self):
        """A queue of the daemon's state changes (daemon_message), for the banner every page shows."""
        queue: asyncio.Queue = asyncio.Queue(QUEUE_MAX)
        self.daemon_viewers.add(queue)
        try:
            yield queue
        finally:
            self.daemon_viewers.discard(queue)

    def publish(self, run_id: int, message: dict):
        self.send(self.viewers.get(run_id, ()), message)

    def send(self, queues, message: dict):
        text = dumps(message)
        for queue in list(queues):
            try:
                queue.put_nowait(text)
            except asyncio.QueueFull:
                while not queue.empty():  # make room for the marker: the viewer reconnects and backfills
                    queue.get_nowait()
                queue.put_nowait(OVERFLOW)

    # ---- the poller -----------------------------------------------------------------------------------------------

    async def run(self):
        await asyncio.to_thread(self._start_cursors)
        sender = asyncio.create_task(self._send_webhooks()) if self.webhook_url else None
        try:
            while True:
                started = time.monotonic()
                watched = set(self.viewers)
                self.snapshot.set()
                self.snapshot = asyncio.Event()
                try:
                    self._dispatch(await asyncio.to_thread(self._read, watched))
                    if self.daemon_viewers and started - self.daemon_checked >= DAEMON_CHECK_S:
                        self.daemon_checked = started
                        daemon = daemon_message(await asyncio.to_thread(self.daemon_status))
                        if daemon != self.daemon:
                            self.daemon = daemon
                            self.send(self.daemon_viewers, daemon)
                except Exception:  # a busy or migrating database: try again next poll, never die of it
                    log.exception("live update poll failed")
                self.polls += 1
                await asyncio.sleep(max(0.0, self.poll - (time.monotonic() - started)))
        finally:
            if sender:
                sender.cancel()

    def _start_cursors(self):
        with self.engine.connect() as c:
            for table in self.cursor:
                self.cursor[table] = c.scalar(NEWEST[table])
        saved = self._webhook_cursor_path()
        if self.webhook_url and saved.exists():
            # alerts recorded while no app was running are still posted (the newest 100 at most)
            self.cursor[Alert] = max(int(saved.read_text() or 0), self.cursor[Alert] - 100)

    def _read(self, watched: set[int]) -> dict:
        with self.engine.connect() as c:
            # only the watched runs' rows are read; for the others the cursor just moves (max(id) is one seek)
            newest = c.scalar(NEWEST[Metric])
            metrics = []
            if watched and newest > self.cursor[Metric]:
                metrics = c.execute(NEW_METRICS, {"after": self.cursor[Metric], "newest": newest,
                                                  "runs": list(watched)}).all()
            alerts = [dict(a) for a in c.execute(NEW_ALERTS, {"after": self.cursor[Alert]}).mappings()]
            events = [dict(e) for e in c.execute(NEW_EVENTS, {"after": self.cursor[Event]}).mappings()]
            replayed = self._read_replays(c, watched, events)
            runs = {}
            if watched:
                open_alerts = dict(c.execute(OPEN_ALERTS, {"runs": list(watched)}).all())
                attempts: dict[int, list] = {}
                for run_id, started, ended in c.execute(ATTEMPTS, {"runs": list(watched)}):
                    attempts.setdefault(run_id, []).append([started, ended])
                for row in c.execute(RUNS, {"runs": list(watched)}).mappings():
                    runs[row["id"]] = {**row, "alerts_open": open_alerts.get(row["id"], 0),
                                       "attempts": attempts.get(row["id"], [])}
        return {"metrics": metrics + replayed, "newest_metric": newest, "alerts": alerts, "events": events,
                "runs": runs}

    def _read_replays(self, c, watched: set[int], events) -> list:
        """Rows rewritten in place since the last poll, for watched runs that resumed or rolled back."""
        for event in events:
            if event["kind"] in REPLAY_EVENTS:
                run_id = event["run_id"]
                start = event["step"] if event["step"] is not None else event["data"].get("step")
                until = c.scalar(LAST_REWARD_STEP, {"run_id": run_id})
                if start is not None and until is not None and until > start:
                    self.replays[run_id] = {"after": start - 1, "until": until, "since": event["time"],
                                            "started": time.time()}
        rows = []
        for run_id, replay in list(self.replays.items()):
            if time.time() - replay["started"] > REPLAY_WATCH_S:
                del self.replays[run_id]
                continue
            if run_id not in watched:
                continue
            found = []
            for name in metric_names(c, run_id):  # one index range per name: (run_id, name, step)
                found += c.execute(REPLAYED, {"run_id": run_id, "name": name, "after": replay["after"],
                                              "until": replay["until"], "since": replay["since"]}).all()
            if found:
                replay["since"] = max(r[5] for r in found)
                if any(r[3] >= replay["until"] for r in found):
                    del self.replays[run_id]  # caught up: later steps are new rows, which the id cursor sees
            rows += found
        return rows

    def _dispatch(self, batch: dict):
        self.cursor[Metric] = max(self.cursor[Metric], batch["newest_metric"])
        if batch["metrics"]:
            by_run: dict[int, dict] = {}
            for _, run_id, name, step, value, t in batch["metrics"]:
                if run_id in self.viewers:
                    s = by_run.setdefault(run_id, {}).setdefault(name, {"step": [], "value": [], "time": []})
                    s["step"].append(step)
                    s["value"].append(math.nan if value is None else value)
                    s["time"].append(t)
            for run_id, series in by_run.items():
                self.publish(run_id, {"type": "metrics", "series": series})
        for alert in batch["alerts"]:
            self.cursor[Alert] = alert["id"]
            self.publish(alert["run_id"], {"type": "alert", "alert": alert})
            if self.webhook_url:
                self.webhook_queue.put_nowait(alert)
        for event in batch["events"]:
            self.cursor[Event] = event["id"]
            self.publish(event["run_id"], {"type": "event", "event": event})
        for run_id, run in batch["runs"].items():
            if self.last_status.get(run_id) != run:
                self.last_status[run_id] = run
                self.publish(run_id, {"type": "status", "run": run})

    # ---- the webhook ----------------------------------------------------------------------------------------------

    def _webhook_cursor_path(self) -> Path:
        return self.home / "webhook.cursor"

    async def _send_webhooks(self):
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                alert = await self.webhook_queue.get()
                payload = await asyncio.to_thread(self.webhook_payload, alert)
                for attempt in range(4):
                    try:
                        response = await client.post(self.webhook_url, json=payload)
                        if response.is_success:
                            self.webhook_sent += 1
                            break
                        log.warning("webhook answered %d for alert %d", response.status_code, alert["id"])
                    except httpx.HTTPError as e:
                        log.warning("webhook failed for alert %d: %s", alert["id"], e)
                    await asyncio.sleep(2 ** attempt)
                self._webhook_cursor_path().write_text(str(alert["id"]))

    def webhook_payload(self, alert: dict) -> dict:
        """Slack-compatible (its incoming webhooks read `text`), with the structured alert beside it."""
        with self.engine.connect() as c:
            name = c.scalar(select(Run.name).where(Run.id == alert["run_id"]))
        link = f" {self.public_url}/runs/{alert['run_id']}" if self.public_url else ""
        step = f" at step {alert['step']}" if alert.get("step") is not None else ""
        return {"text": f"Molt Studio: {alert['kind']} alert on run {alert['run_id']} ({name}){step}: "
                        f"{alert['message']}{link}",
                "run": {"id": alert["run_id"], "name": name}, "alert": _finite(alert)}

