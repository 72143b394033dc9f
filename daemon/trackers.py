"""Mirrors of a run in experiment trackers (W&B, MLflow, TensorBoard, Trackio), as the run config's `report` asks.

`Mirror` is a Sink around the run's own sink (the database, the dashboard over HTTP, or the terminal): it forwards
every call, then queues a copy for each tracker's thread. A call never waits on a tracker: a full queue drops the
record, a tracker that raises loses it, and both are counted (the `report/dropped` metric, and an event per new
error). Each tracker keeps its state in OUT/trackers/NAME.json: its run's id, so a resumed run continues the same
tracker run, and the last step mirrored per metric, so the steps a resume replays are not mirrored twice."""
import json
import os
import queue
import re
import threading
import time
import uuid
from pathlib import Path

# At the end, how long the trackers get to send what is queued; what is left then is counted as dropped. The worker
# keeps beating meanwhile, and this stays well under the daemon's hang timeout (60 s by default), or a tracker that
# is down would get the worker killed as hung and the run restarted, again and again.
FLUSH_S = 15.0
UPLOAD_S = 600.0  # the same with report.log_model: the best and final weights take minutes to upload
# MLflow's own HTTP retries take minutes per call by default (7 retries, backoff 2, 120 s timeout): a tracker that
# does not answer would hold its feed that long per record. These apply where the variable is not set already.
MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
MAX_ERROR_EVENTS = 10  # distinct reasons a tracker loses records told as events; the count at the end has them all
# The trackers' section of each dashboard metric; in it the metric loses that word: reward_mean is reward/mean
GROUPS = {"reward": ("reward_mean", "reward_std", "pass_rate"),
          "loss": ("policy_loss", "kl_ref", "entropy", "clip_ratio", "ratio_mean", "grad_norm", "breaker_threshold",
                   "breaker_tripped", "lr"),
          "episode": ("response_length", "turns_mean", "tool_call_rate", "tool_errors", "env_errors",
                      "prompt_too_long"),
          "staleness": ("staleness_max", "staleness_mean", "stale_episodes_dropped", "stale_share", "trained_fraction",
                        "is_filter_ratio", "groups_filtered", "mismatch_kl", "mismatch_abs", "version"),
          "speed": ("samples_per_s", "tokens_per_s", "sampler_idle_ratio", "sampler_occupancy", "trainer_idle_ratio",
                    "rss_gb")}
GROUP_OF = {name: group for group, names in GROUPS.items() for name in names}
COLUMNS = ("step", "kind", "group", "seed", "version", "reward", "advantage", "success", "prompt", "text")


def shown(text: str) -> str:
    """`text` with the credentials taken out of every URL in it (`http://user:pass@host` -> `http://host`): what a
    tracker's URL or error message puts in events, the run page's link and the config a tracker shows."""
    return re.sub(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@\"']+@", r"\1", text)


def is_eval(name: str) -> bool:
    """A tracker metric an evaluation reports (`eval/reward`, a suite's `math/eval_reward`)."""
    return name.startswith("eval/") or "/eval_" in name


def tracker_name(name: str) -> str:
    """A dashboard metric's name in the trackers: `reward_mean` -> `reward/mean`, `eval_reward` -> `eval/reward`;
    a name already grouped (a suite's `NAME/eval_reward`) or in no group stays as it is."""
    if "/" in name:
        return name
    if name.startswith("eval_"):
        return "eval/" + name.removeprefix("eval_")
    if name.startswith("expert_share_"):
        return "experts/" + name
    group = GROUP_OF.get(name)
    return f"{group}/{name.removeprefix(group + '_').removesuffix('_' + group)}" if group else name


class Mirror:
    """The Sink the engine gets when report.to names trackers; `close(outcome)` at the end of the attempt."""

    def __init__(self, sink, cfg, out_dir: Path, name: str):
        self.sink, self.out_dir = sink, Path(out_dir)
        self.report = cfg.report
        self.dropped = 0  # records lost by all trackers together
        self.step, self.told = None, 0  # the latest step with metrics; the `dropped` that report/dropped last told
        self.closed = False  # after close, a feed still sending counts its losses but tells no one
        self.lock = threading.Lock()  # the feeds count losses from their threads and from the loop's
        self.feeds = [Feed(tracker, cfg, self.out_dir, name, self) for tracker in cfg.report.to]  # last: they count

    def metrics(self, step, values):
        if self.dropped:
            values = {**values, "report/dropped": float(self.dropped)}
            self.told = self.dropped
        self.step = step if self.step is None else max(self.step, step)
        self.sink.metrics(step, values)
        self._put("metrics", step, {tracker_name(k): v for k, v in values.items()})

    def alert(self, kind, message, **data):
        self.sink.alert(kind, message, **data)
        self._put("text", "alert", kind, message)

    def event(self, kind, message, **data):
        self.sink.event(kind, message, **data)
        self._put("text", "event", kind, message)

    def checkpoint(self, step, path, **info):
        self.sink.checkpoint(step, path, **info)
        self._put("text", "event", "checkpoint", f"step {step}: checkpoint {path}")

    def samples(self, step, kind, records):
        if hasattr(self.sink, "samples"):
            self.sink.samples(step, kind, records)
        every = self.report.samples_every
        if records and every and (kind == "eval" or step % every == 0):
            rows = [[step, kind, *(r.get(c) for c in COLUMNS[2:])] for r in records]
            self._put("samples", step, kind, rows)

    def heartbeat(self):
        if beat := getattr(self.sink, "heartbeat", None):
            beat()

    def close(self, outcome: str):
        """Send the best and final checkpoints' paths (with report.log_model their weights), end each tracker's
        run, and wait up to FLUSH_S (UPLOAD_S) for them, beating; what is still queued then is counted as dropped."""
        paths = {kind: str(self.out_dir / kind) for kind in ("best", "final") if (self.out_dir / kind).exists()}
        finish = ("finish", outcome, paths, self.report.log_model)
        limit = UPLOAD_S if self.report.log_model and paths else FLUSH_S
        deadline, unsent = time.monotonic() + limit, list(self.feeds)  # unsent: no room for `finish` yet
        while (alive := [f for f in self.feeds if f.thread.is_alive()]) and time.monotonic() < deadline:
            self.heartbeat()  # the loop's beats stopped with it: this wait, bounded, is no hang
            for feed in list(unsent):
                try:
                    feed.queue.put_nowait(finish)
                    unsent.remove(feed)
                except queue.Full:
                    pass
            alive[0].thread.join(min(1.0, max(0.0, deadline - time.monotonic())))
        for feed in self.feeds:
            if feed.thread.is_alive():
                feed.lose(feed.queue.qsize(), f"still sending after {limit:g} s at the end")
            if feed.lost:
                self.sink.event("tracker", f"{feed.name}: {feed.lost} records not mirrored in all",
                                tracker=feed.name, dropped=feed.lost)
        with self.lock:
            self.closed, dropped = True, self.dropped
        if dropped != self.told and self.step is not None:  # losses since the last metrics: counted at the last step
            self.sink.metrics(self.step, {"report/dropped": float(dropped)})

    def _put(self, *record):
        for feed in self.feeds:
            try:
                feed.queue.put_nowait(record)
            except queue.Full:
                feed.lose(1, f"more than report.queue ({self.report.queue}) records waiting")


class Feed:
    """One tracker's queue and thread: it starts the tracker (imports, login, resume), then sends the records in
    order. A record the tracker rejects is counted as lost; each new error is an event on the run."""

    def __init__(self, name: str, cfg, out_dir: Path, run_name: str, mirror: Mirror):
        self.name, self.mirror = name, mirror
        self.state_path = out_dir / "trackers" / f"{name}.json"
        self.queue = queue.Queue(cfg.report.queue)
        self.lost, self.errors = 0, set()  # records lost; the reasons already told as events
        self.thread = threading.Thread(target=self._run, args=(cfg, out_dir, run_name), name=f"mirror-{name}",
                                       daemon=True)
        self.thread.start()

    def lose(self, n: int, why: str):
        why = shown(why)  # an error message may quote the tracker's URL, credentials and all
        with self.mirror.lock:
            self.lost += n
            self.mirror.dropped += n
            new = why not in self.errors and len(self.errors) < MAX_ERROR_EVENTS and not self.mirror.closed
            self.errors.add(why)
        if new:
            self.mirror.sink.event("tracker", f"{self.name}: {why}; records it loses are counted in report/dropped",
                                   tracker=self.name, error=why)

    def _run(self, cfg, out_dir: Path, run_name: str):
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        steps = state.setdefault("steps", {})  # metric -> the last step mirrored
        try:
            tracker = TRACKERS[self.name](cfg, out_dir, run_name, state)
            self._save(state)  # its id, before anything is sent: a crash from now on resumes this run
            if url := state.get("url"):  # the run page links it
                url = shown(url)
                self.mirror.sink.event("tracker", f"mirrored to {self.name}: {url}", tracker=self.name, url=url)
        except Exception as e:
            tracker, failed = None, f"could not start: {type(e).__name__}: {e}"
            self.lose(0, failed)
        while True:
            record = self.queue.get()
            kind, args = record[0], record[1:]
            if tracker is None:
                if kind == "finish":
                    return
                self.lose(1, failed)
                continue
            try:
                if kind == "metrics":
                    step, values = args
                    values = {k: v for k, v in values.items() if step > steps.get(k, -1)}  # a resume's replay
                    if values:
                        tracker.metrics(step, values)
                        steps.update(dict.fromkeys(values, step))
                        self._save(state)
                elif kind == "samples" and args[0] > steps.get(f"samples/{args[1]}", -1):
                    tracker.samples(*args)
                    steps[f"samples/{args[1]}"] = args[0]
                    self._save(state)
                elif kind == "text":
                    tracker.text(*args, step=max(steps.values(), default=0))
                elif kind == "finish":
                    tracker.finish(*args)
                    return
            except Exception as e:
                self.lose(1, f"{type(e).__name__}: {e}")
                if kind == "finish":
                    return

    def _save(self, state: dict):
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        part = self.state_path.with_suffix(".part")
        part.write_text(json.dumps(state))
        os.replace(part, self.state_path)


def tracker_config(cfg) -> dict:
    """The run's config as the trackers show it: no credentials in its URLs (report.mlflow.tracking_uri's)."""
    return json.loads(shown(json.dumps(cfg.model_dump(mode="json"))))


def flat_config(config: dict, prefix="") -> dict:
    """{"loop": {"steps": 3}} -> {"loop.steps": 3}, as MLflow's params, TensorBoard's text and compare's config diff
    want it."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Wandb:
    """Alerts are W&B alerts (its Slack and e-mail notices); every alert and event also goes in an `events` table.
    Train metrics are logged at their step. An eval finishes after later train steps were logged, and W&B drops a
    step older than its latest: evals have their own axis, `eval/step` (define_metric), and join W&B's latest row."""

    def __init__(self, cfg, out_dir, run_name, state):
        import wandb
        self.wandb, c = wandb, cfg.report.wandb
        state.setdefault("id", uuid.uuid4().hex[:12])  # W&B ids: lowercase letters and digits
        self.run = wandb.init(project=c.project, entity=c.entity, name=c.name or run_name, tags=c.tags, mode=c.mode,
                              dir=c.dir or str(out_dir), id=state["id"], resume="allow",
                              config=tracker_config(cfg),
                              settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        state["url"] = self.run.url  # None offline
        if self.run.resumed and c.mode == "online":  # W&B has the steps before run.step: a killed run's last
            for key, step in state["steps"].items():  # steps may be missing (wandb holds them a moment), sent again
                state["steps"][key] = min(step, self.run.step - 1)
        self.run.define_metric("eval/step", hidden=True)
        for prefix in ["eval", *(s.name for s in cfg.eval.suites)]:  # a suite's metrics: NAME/eval_reward, ...
            self.run.define_metric(f"{prefix}/*", step_metric="eval/step")
        self.events = []
        self.eval_row = (-1, -1)  # the W&B row (its _step) that holds the latest eval, and that eval's step

    def metrics(self, step, values):
        if any(is_eval(k) for k in values):  # an eval's (with report/dropped, if any)
            self.run.log({**values, "eval/step": step}, step=self._eval_row(step))
        else:
            self.run.log(values, step=step)

    def _eval_row(self, step: int) -> int:
        """W&B's latest row, or the next one if it holds another eval already (two evals can end within one train
        step: the last periodic one and the final one): the next train step then joins that row."""
        row, (held, held_step) = self.run.step, self.eval_row
        if row == held and step != held_step:
            row += 1
        self.eval_row = (row, step)
        return row

    def text(self, kind, title, message, step):
        if kind == "alert":
            self.run.alert(title=title, text=message, level=self.wandb.AlertLevel.WARN)
        self.events.append([step, kind, title, message])
        self.run.log({"events": self.wandb.Table(columns=["step", "kind", "title", "message"], data=self.events)},
                     commit=False)  # into the current step's row

    def samples(self, step, kind, rows):
        table = {f"samples/{kind}": self.wandb.Table(columns=list(COLUMNS), data=rows)}
        if kind == "eval":  # beside its eval's metrics
            self.run.log({**table, "eval/step": step}, step=self._eval_row(step))
        else:
            self.run.log(table, step=step)

    def finish(self, outcome, paths, log_model):
        for kind, path in paths.items():
            self.run.summary[f"checkpoint/{kind}"] = path
            if log_model:
                artifact = self.wandb.Artifact(f"{self.run.id}-{kind}", type="model")
                artifact.add_dir(path)
                self.run.log_artifact(artifact)
        self.run.finish(exit_code=0 if outcome in ("completed", "stopped") else 1)


class Mlflow:
    """The config as params (dotted names), alerts and events in the artifact events.txt, samples as tables."""

    def __init__(self, cfg, out_dir, run_name, state):
        for name, value in MLFLOW_HTTP.items():  # read by MLflow at each request; only this worker's MLflow uses them
            os.environ.setdefault(name, value)
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param
        self.Metric, c = Metric, cfg.report.mlflow
        self.client = MlflowClient(tracking_uri=c.tracking_uri)
        if "id" in state:
            self.id = state["id"]
            self.client.update_run(self.id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(c.experiment)
            # A local store's artifacts go beside its database (MLflow's default: ./mlruns of whatever directory the
            # worker runs in); a server decides for itself
            uri, artifacts = self.client.tracking_uri, None
            if uri.startswith("sqlite:///"):
                artifacts = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
            eid = experiment.experiment_id if experiment else self.client.create_experiment(c.experiment, artifacts)
            run = self.client.create_run(eid, run_name=c.run_name or run_name, tags=c.tags)
            self.id = state["id"] = run.info.run_id
            params = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:6000])  # MLflow's longest value
                      for k, v in flat_config(tracker_config(cfg)).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.id, params=params[i:i + 100])
        uri = self.client.tracking_uri
        eid = self.client.get_run(self.id).info.experiment_id
        state["url"] = f"{uri.rstrip('/')}/#/experiments/{eid}/runs/{self.id}" if uri.startswith("http") else None
        self.events = []

    def metrics(self, step, values):
        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[self.Metric(k, v, now, step) for k, v in values.items()])

    def text(self, kind, title, message, step):
        self.events.append(f"step {step} {kind.upper()} {title}: {message}")
        self.client.log_text(self.id, "\n".join(self.events) + "\n", "events.txt")

    def samples(self, step, kind, rows):
        self.client.log_table(self.id, {c: [r[i] for r in rows] for i, c in enumerate(COLUMNS)},
                              f"samples/{kind}-{step:06d}.json")

    def finish(self, outcome, paths, log_model):
        for kind, path in paths.items():
            self.client.set_tag(self.id, f"checkpoint.{kind}", path)
            if log_model:
                self.client.log_artifacts(self.id, path, kind)
        status = {"completed": "FINISHED", "stopped": "KILLED"}.get(outcome, "FAILED")
        self.client.set_terminated(self.id, status)


class Tensorboard:
    """Scalars, text for the config, alerts, events and samples (a markdown table); flushed after every step, so
    that what a killed run reported is in its event files."""

    def __init__(self, cfg, out_dir, run_name, state):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(cfg.report.tensorboard.log_dir or str(Path(out_dir) / "tensorboard"))
        if not state.get("started"):
            config = "\n".join(f"    {k}: {v}" for k, v in flat_config(tracker_config(cfg)).items())
            self.writer.add_text("config", config, 0)
            state["started"] = True

    def metrics(self, step, values):
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def text(self, kind, title, message, step):
        self.writer.add_text(f"{kind}s/{title}", message, step)

    def samples(self, step, kind, rows):
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        table += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text(f"samples/{kind}", "\n".join(table), step)

    def finish(self, outcome, paths, log_model):
        self.writer.add_text("checkpoints", "\n\n".join(f"{k}: {p}" for k, p in paths.items()) or "none")
        self.writer.close()


class Trackio:
    """Alerts are Trackio alerts (WARN), events INFO alerts; it resumes a run by name."""

    def __init__(self, cfg, out_dir, run_name, state):
        import trackio
        self.trackio, c = trackio, cfg.report.trackio
        if "name" in state and not c.space_id:  # resumed: Trackio writes its local store every 0.5 s, so a killed
            from trackio.sqlite_storage import SQLiteStorage  # run's last steps may be missing: send them again
            held = {}
            for row in SQLiteStorage.get_logs(c.project, state["name"]):
                for key in row.keys() - {"step", "timestamp"}:
                    held[key] = max(held.get(key, -1), row["step"])
            state["steps"].clear()
            state["steps"].update(held)
        state.setdefault("name", c.name or run_name)
        self.run = trackio.init(project=c.project, name=state["name"], group=c.group, space_id=c.space_id,
                                config=tracker_config(cfg), resume="allow", embed=False,
                                auto_log_cpu=False, auto_log_gpu=False)
        state["url"] = f"https://huggingface.co/spaces/{c.space_id}" if c.space_id else None

    def metrics(self, step, values):
        self.run.log(values, step=step)

    def text(self, kind, title, message, step):
        level = self.trackio.AlertLevel.WARN if kind == "alert" else self.trackio.AlertLevel.INFO
        self.run.alert(title=title, text=message, level=level)

    def samples(self, step, kind, rows):
        self.run.log({f"samples/{kind}": self.trackio.Table(columns=list(COLUMNS), data=rows)}, step=step)

    def finish(self, outcome, paths, log_model):
        if paths:
            self.run.alert(title="checkpoints", text="\n".join(f"{k}: {p}" for k, p in paths.items()),
                           level=self.trackio.AlertLevel.INFO)
        self.run.finish()


TRACKERS = {"wandb": Wandb, "mlflow": Mlflow, "tensorboard": Tensorboard, "trackio": Trackio}
