"""A tracker that is down, hangs or fails at once never stops or fails a run, nor holds its end (daemon/trackers.py);
the credentials in a tracker's URL are never shown; GPU metrics find the worker's own GPUs (daemon/system.py)."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import wait_until
from daemon import trackers
from daemon.records import Records
from daemon.system import cuda_devices
from daemon.trackers import shown
from molt_engine import RunConfig

ROOT = Path(__file__).resolve().parent.parent
TINY = {"env": "max_digit", "loop": {"steps": 3, "groups_per_step": 2, "group_size": 2, "eval_every": 0},
        "warm_start": {"steps": 0}, "checkpoint": {"every": 0}}


class Recorder:
    """The run's own sink, as the mirror sees it: what reached it, and when it was told the worker lives."""
    def __init__(self):
        self.metrics_seen, self.events, self.beats = [], [], []

    def metrics(self, step, values): self.metrics_seen.append((step, values))
    def alert(self, kind, message, **data): pass
    def event(self, kind, message, **data): self.events.append((kind, message, data))
    def checkpoint(self, step, path, **info): pass
    def heartbeat(self): self.beats.append(time.monotonic())


@pytest.fixture
def down_port():
    """A loopback port where nothing listens: bound, never listening, so a connection is refused (and the port
    is not handed to anyone else meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture
def hanging_port():
    """A real TCP server on loopback that accepts every connection and never answers."""
    server, held = socket.create_server(("127.0.0.1", 0)), []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # closed: the test is over
                return
    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for conn in held:
        conn.close()


def test_mlflow_down_is_told_within_seconds_counted_and_its_url_credentials_never_shown(tmp_path, down_port,
                                                                                        monkeypatch):
    for name in trackers.MLFLOW_HTTP:  # the mirror's bounds, not this machine's; unset again after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    uri = f"http://alice:s3cret@127.0.0.1:{down_port}"
    cfg = RunConfig.model_validate({**TINY, "report": {"to": ["mlflow"], "mlflow": {"tracking_uri": uri}}})
    assert trackers.tracker_config(cfg)["report"]["mlflow"]["tracking_uri"] == f"http://127.0.0.1:{down_port}"
    sink = Recorder()
    mirror = trackers.Mirror(sink, cfg, tmp_path, "down")
    for step in range(3):
        mirror.metrics(step, {"reward_mean": 0.5})
    # MLflow's default retries would take minutes to give up; the mirror's bounds (MLFLOW_HTTP) take seconds
    wait_until(lambda: any("could not start" in m for _, m, _ in sink.events), 60, message="MLflow's start failing")
    mirror.metrics(3, {"reward_mean": 0.5})
    mirror.close("completed")
    told = [m for kind, m, _ in sink.events if kind == "tracker"]
    assert f"127.0.0.1:{down_port}" in told[0], told  # what failed is said ...
    assert not [m for m in told if "s3cret" in m or "alice" in m], told  # ... and never its credentials
    assert told[-1] == "mlflow: 4 records not mirrored in all", told
    assert sink.metrics_seen[-1] == (3, {"report/dropped": 4.0})  # the losses after step 3's metrics, at step 3


class Hung:
    """A tracker that takes its first record and never returns: a server that accepts and never answers."""
    release = None

    def __init__(self, *args): pass
    def metrics(self, *args): Hung.release.wait(120)
    text = samples = finish = metrics


def test_the_end_waits_for_a_hung_tracker_flush_s_at_most_beating_and_counts_what_it_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(trackers, "FLUSH_S", 2.0)
    Hung.release = threading.Event()
    monkeypatch.setitem(trackers.TRACKERS, "mlflow", Hung)
    sink = Recorder()
    mirror = trackers.Mirror(sink, RunConfig.model_validate({**TINY, "report": {"to": ["mlflow"]}}), tmp_path, "hung")
    for step in range(5):
        mirror.metrics(step, {"reward_mean": 0.5})
    wait_until(lambda: mirror.feeds[0].queue.qsize() == 4, 10, message="the first record in the tracker's hands")
    started = time.monotonic()
    mirror.close("completed")
    took = time.monotonic() - started
    Hung.release.set()
    assert 2.0 <= took < 10.0, took
    beats = [t for t in sink.beats if t >= started]
    # beats all along (about every second), so a hang timeout far above FLUSH_S never fires
    assert len(beats) >= 2 and max(b - a for a, b in zip([started, *beats], [*beats, started + took])) < 5.0, beats
    told = [m for kind, m, _ in sink.events if kind == "tracker"]
    # the first record is in the tracker's hands; the four behind it and the finish are lost
    assert told == ["mlflow: still sending after 2 s at the end; records it loses are counted in report/dropped",
                    "mlflow: 5 records not mirrored in all"], told
    assert sink.metrics_seen[-1] == (4, {"report/dropped": 5.0})


class FailsAtOnce:
    """A tracker whose start raises at once (an import error, a refused login)."""
    def __init__(self, *args):
        raise PermissionError("login refused")


def test_a_tracker_that_fails_at_once_is_told_and_has_every_record_counted(tmp_path, monkeypatch):
    monkeypatch.setitem(trackers.TRACKERS, "wandb", FailsAtOnce)
    sink = Recorder()
    cfg = RunConfig.model_validate({**TINY, "report": {"to": ["wandb"]}})
    mirror = trackers.Mirror(sink, cfg, tmp_path, "fails")
    wait_until(lambda: sink.events, 10, message="the tracker's failure told")
    for step in range(10):
        mirror.metrics(step, {"reward_mean": 0.5})
    started = time.monotonic()
    mirror.close("completed")
    assert time.monotonic() - started < 5.0
    assert [m for _, m, _ in sink.events] == [
        "wandb: could not start: PermissionError: login refused; records it loses are counted in report/dropped",
        "wandb: 10 records not mirrored in all"]


def test_credentials_are_taken_out_of_every_url_shown():
    assert shown("API request to http://alice:s3cr%40t@mlflow.internal:5000/api/2.0/mlflow/runs/get failed") == (
        "API request to http://mlflow.internal:5000/api/2.0/mlflow/runs/get failed")
    assert shown('{"uri": "https://token@host/x", "db": "sqlite:///tmp/a@b.db", "mail": "me@example.com"}') == (
        '{"uri": "https://host/x", "db": "sqlite:///tmp/a@b.db", "mail": "me@example.com"}')
    assert shown("http://mlflow.internal:5000/#/experiments/1/runs/ab") == (
        "http://mlflow.internal:5000/#/experiments/1/runs/ab")


def test_gpu_metrics_map_cuda_visible_devices_by_uuid_and_pci_order():
    # NVML's order is not CUDA's: NVML lists these GPUs 0: bus 81, 1: bus 01, 2: bus 41
    devices = [("GPU-aaaa-1111", "00000000:81:00.0"), ("GPU-bbbb-2222", "00000000:01:00.0"),
               ("GPU-cccc-3333", "00000000:41:00.0")]
    assert cuda_devices(None, devices) == [("gpu0", 1), ("gpu1", 2), ("gpu2", 0)]  # PCI bus order, nvidia-smi's
    assert cuda_devices("2,0", devices) == [("gpu2", 0), ("gpu0", 1)]
    assert cuda_devices("GPU-cccc-3333,GPU-aaaa", devices) == [("gpu1", 2), ("gpu2", 0)]  # a UUID, or its prefix
    assert cuda_devices("", devices) == []  # a CPU run's: none
    assert cuda_devices("1,7,0", devices) == [("gpu1", 2)]  # as CUDA: the first entry naming no GPU ends the list
    assert cuda_devices("GPU-,1", devices) == []  # a prefix of several names none
    assert cuda_devices("MIG-aaaa-1111/1/0", devices) == []


@pytest.mark.slow  # two short runs on a real daemon: about a minute, more on busy cores
def test_a_daemon_run_mirrored_to_an_mlflow_that_is_down_or_hangs_completes_in_one_attempt(tmp_path, down_port,
                                                                                         hanging_port):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in trackers.MLFLOW_HTTP}
    with open(home / "daemon.log", "ab") as log:
        # a hang timeout of 45 s: the trackers' end (FLUSH_S) fits in it; 60 s of silence, as before, did not
        daemon = subprocess.Popen([sys.executable, "-m", "daemon", "--home", str(home), "--poll", "0.2", "--backoff",
                                   "0.2", "--heartbeat-timeout", "45", "--concurrency", "2"], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, env={**env, "PYTHONPATH": str(ROOT)})
        try:
            api = Records(home)
            runs = [api.create_run({**TINY, "report": {"to": ["mlflow"], "mlflow": {
                "tracking_uri": f"http://127.0.0.1:{port}"}}}, name=name)["id"]
                for name, port in (("down", down_port), ("hangs", hanging_port))]
            for run in runs:
                final = api.wait_run(run, timeout=600)
                assert final["status"] == "completed", final["last_error"]
                assert len(api.attempts(run)) == 1
                dropped = [m["value"] for m in api.metrics(run, names=["report/dropped"])]
                assert dropped and dropped[-1] > 0, dropped
                told = [e["message"] for e in api.events(run, kind="tracker")]
                assert len(told) >= 2 and told[-1].endswith("records not mirrored in all"), told
        finally:
            daemon.terminate()
            daemon.wait(60)


class Taker:
    """A tracker that takes every record at once."""
    def __init__(self, *args): pass
    def metrics(self, *args, **kwargs): pass
    text = samples = finish = metrics


def test_a_tracker_state_file_on_a_full_disk_counts_its_records_as_lost_with_one_event(tmp_path, monkeypatch):
    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", Taker)
    sink = Recorder()
    cfg = RunConfig.model_validate({**TINY, "report": {"to": ["tensorboard"]}})
    mirror = trackers.Mirror(sink, cfg, tmp_path, "full")
    state = tmp_path / "trackers" / "tensorboard.json"
    wait_until(state.exists, 10, message="the tracker's state saved at its start")
    mirror.metrics(0, {"reward_mean": 0.5})
    wait_until(lambda: json.loads(state.read_text())["steps"] == {"reward/mean": 0}, 10,
               message="step 0 mirrored and saved")
    # From now on the state file's writes meet a full disk: the kernel's /dev/full answers ENOSPC to every write
    state.with_suffix(".part").symlink_to("/dev/full")
    for step in (1, 2, 3):
        mirror.metrics(step, {"reward_mean": 0.5})
    mirror.close("completed")
    told = [m for kind, m, _ in sink.events if kind == "tracker"]
    assert told == ["tensorboard: OSError: [Errno 28] No space left on device; records it loses are counted in "
                    "report/dropped", "tensorboard: 3 records not mirrored in all"], told
    assert sink.metrics_seen[-1] == (3, {"report/dropped": 3.0})
    assert json.loads(state.read_text())["steps"] == {"reward/mean": 0}  # the last one saved whole: a resume resends


@pytest.mark.slow  # a real daemon, worker and MLflow start: about a minute on busy cores
def test_a_graceful_daemon_stop_ends_the_tracker_run_after_its_last_step_and_the_resume_continues_it(tmp_path):
    from mlflow.tracking import MlflowClient
    home, uri = tmp_path / "home", f"sqlite:///{tmp_path}/mlflow.db"
    home.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k not in trackers.MLFLOW_HTTP}, "PYTHONPATH": str(ROOT)}
    api = Records(home)
    run = api.create_run({**TINY, "loop": {**TINY["loop"], "steps": 100000}, "report": {
        "to": ["mlflow"], "mlflow": {"tracking_uri": uri}}}, name="stopped")["id"]
    state, first = api.run_dir(run) / "trackers" / "mlflow.json", None
    for attempt in (1, 2):
        with open(home / "daemon.log", "ab") as log:
            daemon = subprocess.Popen([sys.executable, "-m", "daemon", "--home", str(home), "--poll", "0.2"],
                                      cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_until(lambda: state.exists() and json.loads(state.read_text())["steps"].get("reward/mean", -1)
                       >= 3 * attempt, 240, message=f"attempt {attempt} mirrored to MLflow")
            stop = subprocess.run([sys.executable, "-m", "app.cli", "daemon", "stop", "--home", str(home)],
                                  capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
            assert stop.returncode == 0, stop.stdout + stop.stderr
        finally:
            daemon.terminate()
            daemon.wait(60)
        stopped = api.get_run(run)
        assert stopped["status"] == "stopped", stopped
        mlflow_run = MlflowClient(uri).get_run(json.loads(state.read_text())["id"])
        assert mlflow_run.info.status == "KILLED" and mlflow_run.info.end_time  # ended, not left RUNNING
        history = MlflowClient(uri).get_metric_history(mlflow_run.info.run_id, "reward/mean")
        last = max(m["step"] for m in api.metrics(run, names=["reward_mean"]))
        assert sorted(m.step for m in history) == list(range(last + 1))  # every step, once, up to the last
        first = first or mlflow_run.info.run_id
        assert mlflow_run.info.run_id == first  # the resume continued the same MLflow run
        api.resume_run(run)


@pytest.mark.slow  # a sweep's two runs and a run of two ranks on one daemon: about a minute, more on busy cores
def test_a_sweeps_runs_and_a_two_rank_run_mirrored_to_an_mlflow_that_is_down_complete_in_one_attempt(tmp_path,
                                                                                                   down_port):
    from daemon.sweeps import SweepRequest
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in trackers.MLFLOW_HTTP}
    down = {**TINY, "report": {"to": ["mlflow"], "mlflow": {"tracking_uri": f"http://127.0.0.1:{down_port}"}}}
    api = Records(home)
    sweep = api.queue_sweep(SweepRequest.model_validate({"name": "down", "config": down, "metric": "reward_mean",
                                                         "params": {"algo.lr": {"values": [1e-3, 3e-3]}}}))["id"]
    ranks = api.create_run({**down, "dist": {"nproc": 2}}, name="two-ranks")["id"]
    with open(home / "daemon.log", "ab") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "daemon", "--home", str(home), "--poll", "0.2", "--backoff",
                                   "0.2", "--heartbeat-timeout", "45", "--concurrency", "3"], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, env={**env, "PYTHONPATH": str(ROOT)})
        try:
            final = api.wait_run(ranks, timeout=600)
            done = wait_until(lambda: (s := api.get_sweep(sweep))["status"] != "running" and s, 600, 0.5,
                              message="the sweep's end")
        finally:
            daemon.terminate()
            daemon.wait(60)
    assert final["status"] == "completed", final["last_error"]
    assert done["status"] == "completed" and len(done["points"]) == 2, done
    assert all(p["score"] is not None for p in done["points"]), done["points"]
    for run in [r["id"] for r in done["runs"]] + [ranks]:
        assert len(api.attempts(run)) == 1, api.attempts(run)
        assert api.get_run(run)["status"] == "completed"
        told = [e["message"] for e in api.events(run, kind="tracker")]
        # one mirror (rank 0's) told the failure and its count once; its count is the last report/dropped
        assert len(told) == 2 and "could not start" in told[0], told
        lost = int(told[1].split("mlflow: ")[1].split(" records not mirrored in all")[0])
        dropped = [m["value"] for m in api.metrics(run, names=["report/dropped"])]
        assert lost > 0 and dropped[-1] == lost, (told, dropped)
