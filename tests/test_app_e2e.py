"""B. End to end through `molt serve` (a real uvicorn, a real daemon child, real workers): the REST flow a CI job
uses, `molt runs create --wait` exit statuses, and Ctrl-C stopping both halves with the worker checkpointing."""
import csv
import io
import json
import os
import subprocess

import pytest

from app_support import FAILS, FAST, TRIPS, child_env, molt, serve
from conftest import wait_until


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("home")) as s:
        yield s


def test_rest_create_wait_metrics_checkpoints_csv(served):
    run = served.create(FAST, name="rest-e2e", tags=["ci"])
    assert run["status"] == "queued" and run["total_steps"] == 30
    done = served.wait(run["id"])
    assert done["status"] == "completed", done
    assert done["step"] == 30 and done["pid"] is None and done["finished_at"] >= done["started_at"]

    client = served.client
    metrics = client.get(f"/api/v1/runs/{run['id']}/metrics", params={"names": "reward_mean,grad_norm"}).json()
    assert metrics["series"]["reward_mean"]["step"] == list(range(30))
    assert {"policy_loss", "staleness_max", "samples_per_s", "breaker_tripped"} <= set(metrics["names"])
    small = client.get(f"/api/v1/runs/{run['id']}/metrics", params={"max_points": 10}).json()
    assert all(len(s["step"]) <= 10 for s in small["series"].values()) and small["downsampled"]

    checkpoints = client.get(f"/api/v1/runs/{run['id']}/checkpoints").json()
    assert [c["step"] for c in checkpoints][:2] == [5, 10] and checkpoints[-1]["exists"]
    attempts = client.get(f"/api/v1/runs/{run['id']}/attempts").json()
    assert len(attempts) == 1 and attempts[0]["cause"] == "completed"

    rows = list(csv.DictReader(io.StringIO(client.get(f"/api/v1/runs/{run['id']}/metrics.csv").text)))
    rewards = [r for r in rows if r["name"] == "reward_mean"]
    assert [int(r["step"]) for r in rewards] == list(range(30))
    assert [float(r["value"]) for r in rewards] == metrics["series"]["reward_mean"]["value"]
    assert "molt worker" in client.get(f"/api/v1/runs/{run['id']}/log").text
    listed = client.get("/api/v1/runs", params={"tag": "ci", "status": "completed"}).json()
    assert [r["id"] for r in listed] == [run["id"]]


def runs_cli(served, *args, timeout=180):
    return subprocess.run(molt("runs", "--url", served.base, f"--token={served.token}", *args), capture_output=True,
                          text=True, timeout=timeout, env=child_env(served.home))


@pytest.mark.slow  # ~30 s end to end: runs in CI with the slow tests
def test_cli_create_wait_exits_0_when_completed_and_1_when_failed(served, tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(FAST))
    bad.write_text(json.dumps(FAILS))
    done = runs_cli(served, "create", "--config", str(good), "--wait", "--timeout", "150", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "completed"

    failed = runs_cli(served, "create", "--config", str(bad), "--max-restarts", "0", "--wait", "--timeout", "150",
                      "--json")
    assert failed.returncode == 1, failed.stderr
    run = json.loads(failed.stdout)
    assert run["status"] == "failed" and "exit code" in run["last_error"]

    listed = runs_cli(served, "list")
    assert listed.returncode == 0 and f"{run['id']:>5}  failed" in listed.stdout


def test_cli_bad_config_exits_2_naming_the_field_and_a_timeout_exits_124(served, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"env": "max_digit", "loop": {"steps": -5}}))
    result = runs_cli(served, "create", "--config", str(bad))
    assert result.returncode == 2 and "config.loop.steps" in result.stderr
    bad.write_text('{"env": "max_digit",')  # not JSON: the same exit code and the file's name, from both commands
    for result in (runs_cli(served, "create", "--config", str(bad)),
                   subprocess.run(molt("train", "--config", str(bad)), capture_output=True, text=True, timeout=60)):
        assert result.returncode == 2 and f"cannot read {bad} as JSON" in result.stderr, result.stderr
    # a queued run behind a long one cannot finish in half a second
    long = tmp_path / "long.json"
    long.write_text(json.dumps({**FAST, "loop": {**FAST["loop"], "steps": 100000}}))
    created = runs_cli(served, "create", "--config", str(long), "--name", "long")
    run_id = int(created.stderr.split("run ")[1].split()[0])
    # a summary, not the ~130-line record: --json gives that
    assert created.returncode == 0 and created.stdout.splitlines() == [
        f"id      {run_id}", "name    long", "status  queued", "env     max_digit", "model   tiny-dense",
        "steps   0/100000", f"url     {served.base}/runs/{run_id}"]
    result = runs_cli(served, "wait", str(run_id), "--timeout", "0.5")
    assert result.returncode == 124, result.stderr
    stopped = runs_cli(served, "stop", str(run_id))
    assert stopped.returncode == 0 and json.loads(stopped.stdout)["status"] in ("stopped", "stopping")
    waited = runs_cli(served, "wait", str(run_id), "--timeout", "60")
    assert waited.returncode == 4 and "status  stopped" in waited.stdout.splitlines()  # stopped
    full = runs_cli(served, "wait", str(run_id), "--json")
    assert full.returncode == 4 and json.loads(full.stdout)["config"]["loop"]["steps"] == 100000
    assert runs_cli(served, "--token", "wrong", "list").returncode == 5


def test_ctrl_c_stops_the_worker_with_a_checkpoint_then_the_daemon_and_the_next_serve_resumes(tmp_path):
    config = {**FAST, "loop": {**FAST["loop"], "steps": 100000}, "checkpoint": {"every": 0}}
    with serve(tmp_path) as served:
        run = served.create(config, name="interrupted")
        wait_until(lambda: served.client.get(f"/api/v1/runs/{run['id']}").json()["step"] >= 3, 90,
                   message="the run to train a few steps")
        daemon_pid = json.loads(served.client.get("/api/v1/health").text)["daemon"]["pid"]
        daemon_args = open(f"/proc/{daemon_pid}/cmdline").read().split("\0")
        assert daemon_args[daemon_args.index("--stop-grace") + 1] == "120.0"  # serve's grace reaches the daemon
        assert served.interrupt() == 0, served.output
        assert "molt serve: run %d stopped" % run["id"] in served.output, served.output
    from daemon.records import Records
    records = Records(tmp_path)
    stopped = records.get_run(run["id"])
    assert stopped["status"] == "stopped" and not records.daemon_status()["running"]
    checkpoints = records.checkpoints(run["id"])
    assert checkpoints and checkpoints[-1]["exists"] and checkpoints[-1]["step"] == stopped["step"]
    assert daemon_pid is not None and not pid_alive(daemon_pid)
    with serve(tmp_path) as again:  # the run interrupted by Ctrl-C continues from its checkpoint
        wait_until(lambda: f"resuming run {run['id']}" in again.output, 60, message="the daemon to say it resumes")
        resumed = wait_until(lambda: [a for a in again.client.get(f"/api/v1/runs/{run['id']}/attempts").json()
                                      if a["number"] == 2 and a["start_step"] is not None], 90)
        assert resumed[0]["start_step"] == stopped["step"]


def pid_alive(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_molt_train_exits_3_when_the_run_trips_and_only_its_own_bar_shows(tmp_path):
    trips = tmp_path / "trips.json"
    trips.write_text(json.dumps(TRIPS))
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    done = subprocess.run(molt("train", "--config", str(trips), "--out", str(tmp_path / "run")), capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 3, done.stderr
    assert '"status": "tripped"' in done.stdout
    assert any((tmp_path / "run" / "checkpoints").glob("step-*"))  # it saved policies, with no bar of their own
    assert "step" in done.stderr and "Writing model shards" not in done.stderr and "Loading weights" not in done.stderr
