"""Runs mirrored to W&B, MLflow, TensorBoard and Trackio (daemon/trackers.py), each in its offline or local mode, read
back with the tracker's own reader or client: real daemons, real workers, a real kill -9."""
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from app_support import hook, logged_in, new_run, sink_for, web  # noqa: F401 (hook, web: fixtures)
from conftest import wait_until
from daemon import trackers
from daemon.records import Records
from daemon.trackers import is_eval, tracker_name
from molt_engine import RunConfig, config_errors, train
from molt_engine.config import ValidationError

ROOT = Path(__file__).resolve().parent.parent
RUN = {"env": "max_digit", "loop": {"steps": 6, "groups_per_step": 4, "group_size": 4, "eval_every": 3,
                                    "eval_episodes": 4},
       "warm_start": {"steps": 0}, "checkpoint": {"every": 3},
       "breaker": {"abs_max": 100.0}, "drills": {"spike_at": [2]}}  # the spike trips the breaker: an alert


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A data directory and a daemon on it; the trackers' local stores under tmp_path (the worker inherits these)."""
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    # trackio reads TRACKIO_DIR once, at its import: this process reads each test's store (an earlier test's otherwise)
    monkeypatch.setattr("trackio.sqlite_storage.TRACKIO_DIR", tmp_path / "trackio")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    home = tmp_path / "home"
    home.mkdir()
    log = open(home / "daemon.log", "ab")
    # A long heartbeat timeout: the resume test's hang drill holds the trainer until the test kills it
    daemon = subprocess.Popen([sys.executable, "-m", "daemon", "--home", str(home), "--poll", "0.2",
                               "--backoff", "0.2", "--heartbeat-timeout", "600"], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT)
    yield home
    daemon.terminate()
    daemon.wait(60)
    log.close()


def report(tmp_path: Path, *to: str, **sections) -> dict:
    return {"to": list(to), "samples_every": 2, "wandb": {"mode": "offline"},
            "mlflow": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}, **sections}


def wandb_records(run_dir: Path) -> list:
    """Every record of the run's W&B offline files (all attempts), parsed with wandb's own protobuf. The file is a
    LevelDB log: a 7-byte header, then 32 KiB blocks of chunks (crc32, length, type: 1 whole, 2-4 first/middle/last)."""
    from wandb.proto import wandb_internal_pb2
    records = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, parts = path.read_bytes(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(parts)
                records.append(record)
                parts = b""
    return records


def mirrored(tmp_path: Path, run_dir: Path, name: str) -> dict:
    """What each tracker holds: {tracker: {"metrics": {metric: [(step, value), ...]}, "config", "alerts", "tables"}}."""
    found = {}
    if (run_dir / "wandb").exists():
        metrics, alerts, tables, config = {}, [], [], {}
        for r in wandb_records(run_dir):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                items = {"/".join(i.nested_key) or i.key: i.value_json for i in r.history.item}
                for key, value in items.items():  # an eval's metrics and samples are at their step on eval/step
                    step = int(items["eval/step" if is_eval(key) or key.startswith("samples/eval") else "_step"])
                    if key.startswith("samples/") and key.endswith("/_type"):
                        tables.append((key.removesuffix("/_type"), step))
                    elif not key.startswith(("_", "samples/", "events")) and key != "eval/step":
                        metrics.setdefault(key, []).append((step, float(json.loads(value))))
            elif kind == "alert":
                alerts.append(r.alert.title)
            elif kind == "run":
                config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        found["wandb"] = {"metrics": metrics, "alerts": alerts, "tables": tables, "steps": config["loop"]["steps"]}
    if (tmp_path / "mlflow.db").exists():
        from mlflow import MlflowClient
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
        experiment = client.get_experiment_by_name("molt")
        runs = client.search_runs([experiment.experiment_id])
        assert len(runs) == 1, "one MLflow run, resumed or not"
        run = runs[0]
        metrics = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
                   for k in run.data.metrics}
        events = client.download_artifacts(run.info.run_id, "events.txt", str(tmp_path))
        tables = [(f"samples/{f.path.split('/')[-1].split('-')[0]}", int(f.path.split("-")[-1].split(".")[0]))
                  for f in client.list_artifacts(run.info.run_id, "samples")]
        rows = client.load_table(experiment.experiment_id, tables and f"samples/train-{tables[0][1]:06d}.json",
                                 run_ids=[run.info.run_id]) if tables else None
        found["mlflow"] = {"metrics": metrics, "tables": tables, "steps": int(run.data.params["loop.steps"]),
                           "alerts": [line.split(" ALERT ")[1].split(":")[0] for line in Path(events).read_text()
                                      .splitlines() if " ALERT " in line], "rows": rows}
    if (run_dir / "tensorboard").exists():
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        tags = events.Tags()
        config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
        found["tensorboard"] = {
            "metrics": {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags["scalars"]},
            "alerts": [t.split("/")[1] for t in tags["tensors"] if t.startswith("alerts/")],
            "tables": [(t.removesuffix("/text_summary"), e.step) for t in tags["tensors"] if t.startswith("samples/")
                       for e in events.Tensors(t)],
            "steps": int(config.split("loop.steps: ")[1].split()[0])}
    if (tmp_path / "trackio").exists():
        from trackio.sqlite_storage import SQLiteStorage
        assert SQLiteStorage.get_runs("molt") == [name]
        metrics, tables = {}, []
        for row in SQLiteStorage.get_logs("molt", name):
            for key, value in row.items():
                if key.startswith("samples/"):
                    tables.append((key, row["step"]))
                elif key not in ("step", "timestamp"):
                    metrics.setdefault(key, []).append((row["step"], value))
        found["trackio"] = {"metrics": metrics, "tables": tables,
                            "alerts": [a["title"] for a in SQLiteStorage.get_alerts("molt", level="warn")],
                            "steps": SQLiteStorage.get_run_config("molt", name)["loop"]["steps"]}
    return found


def assert_each_metric_at_each_step_once(api: Records, run_id: int, found: dict, values: bool = True):
    """Every metric the dashboard recorded, at every step, once, in every tracker, with its value (after a resume
    the timings of the steps trained again differ: the trackers keep the first ones)."""
    recorded = {}
    for row in api.metrics(run_id):  # but the worker's system metrics: a tracker samples the machine itself
        if not row["name"].startswith("system/"):
            recorded.setdefault(tracker_name(row["name"]), []).append((row["step"], row["value"]))
    assert {"reward/mean", "loss/policy", "staleness/version"} <= set(recorded)
    for tracker, got in found.items():
        assert set(got["metrics"]) == set(recorded), tracker
        for name, points in recorded.items():
            steps = [s for s, _ in got["metrics"][name]]
            assert steps == [s for s, _ in points], (tracker, name)
            if values:
                assert [v for _, v in got["metrics"][name]] == pytest.approx(  # TensorBoard keeps float32
                    [v for _, v in points], rel=1e-6, nan_ok=True), (tracker, name)


@pytest.mark.slow  # four trackers started in one worker: about 30 s
def test_a_daemon_run_is_mirrored_to_all_four_trackers(home, tmp_path):
    api = Records(home)
    run = api.create_run({**RUN, "report": report(tmp_path, "wandb", "mlflow", "tensorboard", "trackio")},
                         name="mirrored")["id"]
    final = api.wait_run(run, timeout=300)
    assert final["status"] == "completed", final["last_error"]
    assert [e["message"] for e in api.events(run, kind="tracker")] == []  # no errors, nothing dropped
    found = mirrored(tmp_path, api.run_dir(run), f"mirrored #{run}")
    assert set(found) == {"wandb", "mlflow", "tensorboard", "trackio"}
    assert_each_metric_at_each_step_once(api, run, found)
    for tracker, got in found.items():
        assert [s for s, _ in got["metrics"]["eval/reward"]] == [0, 3, 6], tracker
        assert got["steps"] == 6, tracker  # the config
        assert got["alerts"] == ["breaker"], tracker
        # train samples at steps 0, 2, 4 (report.samples_every 2) and every eval's (steps 0, 3, 6)
        assert sorted(got["tables"]) == [("samples/eval", s) for s in (0, 3, 6)] + [
            ("samples/train", s) for s in (0, 2, 4)], tracker
    assert (tmp_path / "mlartifacts").is_dir()  # beside the MLflow database, not in the worker's directory
    rows = found["mlflow"]["rows"]
    assert list(rows.columns) == list(trackers.COLUMNS) and len(rows) == 8 and set(rows["step"]) == {0}


@pytest.mark.slow  # a few minutes on 2 busy cores: two starts of a worker and of MLflow
def test_a_worker_killed_and_resumed_continues_the_same_tracker_runs_with_no_duplicate_steps(home, tmp_path):
    api = Records(home)
    steps, held = 20, 12
    # The hang drill holds the trainer at step 12 (after step 11's metrics and the checkpoint at 12) while the mirror
    # threads go on: the test kills once every mirror has step 11, so nothing the killed process queued is lost
    config = {**RUN, "loop": {**RUN["loop"], "steps": steps, "eval_every": 0}, "checkpoint": {"every": 4},
              "drills": {"hang_at": [held], "hang_seconds": 600},
              "report": report(tmp_path, "wandb", "mlflow", "tensorboard", "trackio")}
    run = api.create_run(config, name="resumed")["id"]
    states = {name: api.run_dir(run) / "trackers" / f"{name}.json" for name in ("mlflow", "tensorboard", "trackio")}

    def mirrored_step(name):  # the trainer's metrics of a step may reach a mirror after its reward's: the least of them
        state = json.loads(states[name].read_text()) if states[name].exists() else {}
        steps = state.get("steps", {})
        if name == "trackio" and "name" in state:  # it writes what it is given every 0.5 s: count what its store holds
            from trackio.sqlite_storage import SQLiteStorage
            steps = {}
            for row in SQLiteStorage.get_logs("molt", state["name"]):
                for key in row.keys() - {"step", "timestamp"}:
                    steps[key] = max(steps.get(key, -1), row["step"])
        return min(steps.get(metric, -1) for metric in ("reward/mean", "loss/policy", "loss/breaker_threshold"))
    wait_until(lambda: all(mirrored_step(name) == held - 1 for name in states) and api.get_run(run)["pid"], 240,
               message=f"step {held - 1} mirrored by MLflow, TensorBoard and Trackio")
    first_id, killed_at = json.loads(states["mlflow"].read_text())["id"], held - 1
    os.kill(api.get_run(run)["pid"], signal.SIGKILL)  # steps from the last checkpoint on are trained again
    final = api.wait_run(run, timeout=300)
    assert final["status"] == "completed", final["last_error"]
    attempts = api.attempts(run)
    assert len(attempts) == 2 and attempts[1]["start_step"] <= killed_at + 1  # steps the trackers have, trained again
    assert json.loads(states["mlflow"].read_text())["id"] == first_id
    wandb_runs = {r.run.run_id for r in wandb_records(api.run_dir(run)) if r.WhichOneof("record_type") == "run"}
    assert len(list(api.run_dir(run).glob("wandb/offline-run-*"))) == 2 and len(wandb_runs) == 1  # one per attempt
    found = mirrored(tmp_path, api.run_dir(run), f"resumed #{run}")  # one MLflow run, one Trackio run
    assert set(found) == {"wandb", "mlflow", "tensorboard", "trackio"}
    # W&B offline may lose the last steps before a kill -9 (its service had not written them: docs/trackers.md);
    # online, W&B's own run.step says what it holds and the rest is sent again. Never a step twice.
    for name, points in found.pop("wandb")["metrics"].items():
        points_steps = [s for s, _ in points]
        assert points_steps == sorted(set(points_steps)) and set(points_steps) <= set(range(steps + 1)), name
    assert_each_metric_at_each_step_once(api, run, found, values=False)
    for got in found.values():
        assert [s for s, _ in got["metrics"]["reward/mean"]] == list(range(steps))


class Failing:
    """A tracker that starts, then raises on every call."""
    def __init__(self, *args): pass

    def metrics(self, *args, **kwargs): raise ConnectionError("tracker down")
    text = samples = finish = metrics


class Stuck:
    """A tracker that never gets past its start until the run is over: its queue fills up."""
    release = None

    def __init__(self, *args):
        Stuck.release.wait(120)

    def metrics(self, step, values): pass
    def text(self, *args, **kwargs): pass
    def samples(self, *args): pass
    def finish(self, *args): pass


class Recorder:
    def __init__(self):
        self.metrics_seen, self.events = [], []

    def metrics(self, step, values): self.metrics_seen.append((step, values))
    def alert(self, kind, message, **data): pass
    def event(self, kind, message, **data): self.events.append((kind, message, data))
    def checkpoint(self, step, path, **info): pass


def test_a_failing_or_stuck_tracker_never_fails_the_run_and_its_losses_are_counted(tmp_path, monkeypatch):
    import threading
    Stuck.release = threading.Event()
    monkeypatch.setitem(trackers.TRACKERS, "wandb", Failing)
    monkeypatch.setitem(trackers.TRACKERS, "mlflow", Stuck)
    cfg = RunConfig.model_validate({**RUN, "report": {"to": ["wandb", "mlflow"], "queue": 3}, "drills": {}})
    sink = Recorder()
    mirror = trackers.Mirror(sink, cfg, tmp_path, "failing")
    summary = train(cfg, mirror, out_dir=tmp_path)
    Stuck.release.set()
    mirror.close(summary["status"])
    assert summary["status"] == "completed"
    by_tracker = {}
    for kind, message, data in sink.events:
        if kind == "tracker":
            by_tracker.setdefault(data["tracker"], []).append(message)
    failing, stuck = by_tracker["wandb"], by_tracker["mlflow"]
    assert "wandb: ConnectionError: tracker down" in failing[0] and len(failing) == 2, failing
    assert "more than report.queue (3) records waiting" in stuck[0] and len(stuck) == 2, stuck
    lost = {t: int(m[-1].split(": ")[1].split()[0]) for t, m in by_tracker.items()}  # "NAME: N records not mirrored"
    assert lost["wandb"] >= 6 + 3  # every step's metrics and every eval's, at least
    assert lost["mlflow"] > 0
    dropped = [values["report/dropped"] for _, values in sink.metrics_seen if "report/dropped" in values]
    assert dropped == sorted(dropped) and 0 < dropped[-1] <= lost["wandb"] + lost["mlflow"]


def test_wandb_keeps_every_eval_on_its_own_step_axis_though_evals_end_after_later_train_steps(tmp_path):
    cfg = RunConfig.model_validate({**RUN, "drills": {}, "eval": {"suites": [{"name": "math", "env": "max_digit"}]},
                                    "report": {"to": ["wandb"], "wandb": {"mode": "offline"}}})
    mirror = trackers.Mirror(Recorder(), cfg, tmp_path, "evals")
    wait_until((tmp_path / "trackers" / "wandb.json").exists, 120, message="W&B started")  # as a run's steps take
    for step in range(3):
        mirror.metrics(step, {"reward_mean": step / 10})
    mirror.metrics(0, {"eval_reward": 1.0, "math/eval_reward": 1.5})  # step 0's eval ends after train step 2
    mirror.samples(0, "eval", [{"reward": 1.0, "text": "9"}])
    mirror.metrics(3, {"reward_mean": 0.3})
    mirror.metrics(3, {"eval_reward": 2.0})  # the last periodic eval ends after the last train step ...
    mirror.metrics(4, {"eval_reward": 3.0})  # ... and so does the final one: one W&B row cannot hold both
    mirror.close("completed")
    wait_until(lambda: any(r.WhichOneof("record_type") == "exit" for r in wandb_records(tmp_path)), 60,
               message="W&B's service writing the run's end")  # it writes its log a moment after finish()
    found = mirrored(tmp_path, tmp_path, "evals")["wandb"]
    assert found["metrics"] == {"reward/mean": [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3)],
                                "eval/reward": [(0, 1.0), (3, 2.0), (4, 3.0)], "math/eval_reward": [(0, 1.5)]}
    assert found["tables"] == [("samples/eval", 0)]
    axes = {r.metric.glob_name or r.metric.name: r.metric.step_metric for r in wandb_records(tmp_path)
            if r.WhichOneof("record_type") == "metric"}
    assert axes == {"eval/step": "", "eval/*": "eval/step", "math/*": "eval/step"}


def test_a_missing_tracker_package_is_a_config_error_naming_the_extra(monkeypatch):
    monkeypatch.setattr("molt_engine.report_config.find_spec", lambda name: None if name == "mlflow" else object())
    with pytest.raises(ValidationError) as e:
        RunConfig.model_validate({"env": "max_digit", "report": {"to": ["tensorboard", "mlflow"]}})
    assert config_errors(e.value) == ["report.to: mlflow is not installed: pip install -e '.[mlflow]'"]
    with pytest.raises(ValidationError) as e:
        RunConfig.model_validate({"env": "max_digit", "report": {"to": ["neptune"]}})
    assert config_errors(e.value)[0].startswith("report.to.0: Input should be 'wandb', 'mlflow'")


def test_molt_train_takes_the_trackers_from_its_flag(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "app.cli", "train", "--env", "max_digit", "--out", str(tmp_path),
                           "--report-to-tracker", "tensorboard,neptune"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 2 and "report.to.1: Input should be 'wandb'" in proc.stderr, proc.stderr


def test_metric_names_are_grouped_as_the_trackers_group_them():
    assert [tracker_name(n) for n in ("reward_mean", "policy_loss", "eval_reward", "staleness_max", "samples_per_s",
                                      "math/eval_reward", "expert_share_l0_e1", "something_new")] == [
        "reward/mean", "loss/policy", "eval/reward", "staleness/max", "speed/samples_per_s", "math/eval_reward",
        "experts/expert_share_l0_e1", "something_new"]


class Linked(Stuck):
    """A tracker whose run has a page (W&B online, an MLflow server, a Trackio Space)."""
    def __init__(self, cfg, out_dir, run_name, state):
        state["url"] = f"https://wandb.example/team/molt/runs/{run_name}"


def test_the_run_page_links_the_run_in_each_tracker_that_has_a_url(web, tmp_path, monkeypatch):
    monkeypatch.setitem(trackers.TRACKERS, "wandb", Linked)
    run = new_run(web)["id"]
    browser, _ = logged_in(web)
    assert 'id="ov-trackers"' not in browser.get(f"/runs/{run}").text
    sink = sink_for(web, run)
    mirror = trackers.Mirror(sink, RunConfig.model_validate({**RUN, "report": {"to": ["wandb", "tensorboard"]}}),
                             tmp_path, f"run-{run}")
    mirror.close("completed")
    sink.close()
    assert (f'<dd id="ov-trackers"><a href="https://wandb.example/team/molt/runs/run-{run}" rel="noopener">wandb</a>'
            f'</dd>') in browser.get(f"/runs/{run}").text  # TensorBoard, local files, has no page


def test_the_run_page_shows_a_tracking_uri_without_its_credentials_and_the_api_keeps_them_for_clone(web):
    uri = "http://alice:s3cret@127.0.0.1:9/"
    run = new_run(web, config={**RUN, "report": {"to": ["mlflow"], "mlflow": {"tracking_uri": uri}}})
    browser, _ = logged_in(web)
    page = browser.get(f"/runs/{run['id']}").text
    assert "http://127.0.0.1:9/" in page and "s3cret" not in page and "alice" not in page
    assert web["client"].get(f"/api/v1/runs/{run['id']}").json()["config"]["report"]["mlflow"]["tracking_uri"] == uri


@pytest.mark.slow  # two ranks start torch and gloo: about a minute on 2 busy cores
def test_a_two_rank_molt_train_is_mirrored_from_rank_0_only(tmp_path):
    config = {**RUN, "loop": {**RUN["loop"], "steps": 3, "eval_every": 0}, "drills": {}, "checkpoint": {"every": 0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "app.cli", "train", "--config", str(tmp_path / "config.json"),
                           "--nproc", "2", "--out", str(tmp_path / "out"), "--report-to-tracker", "tensorboard"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))) == 1  # one writer
    found = mirrored(tmp_path, tmp_path / "out", "")
    assert [s for s, _ in found["tensorboard"]["metrics"]["reward/mean"]] == [0, 1, 2]
