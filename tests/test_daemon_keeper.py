"""`molt serve` keeps its daemon alive and says when it is not: restarts of a killed daemon, health, /metrics, a run
that ends while no daemon watches, `molt daemon stop`. Real `molt serve`, daemon and worker processes, real signals."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlmodel import Session

from app_support import FAST, ROOT, child_env, molt, serve, web_thread
from conftest import wait_until
from daemon.records import Records
from daemon.db import set_run
from daemon.keeper import Keeper, stop_daemon
from daemon.models import Alert, Attempt
from daemon.sink import DbSink

START = 90  # seconds a worker may take to reach its first steps on a busy machine


def config(steps: int, **sections) -> dict:
    return {**FAST, "loop": {**FAST["loop"], "steps": steps}, **sections}


def gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped yet counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def health(served) -> tuple[int, dict]:
    r = served.client.get("/api/v1/health")
    return r.status_code, r.json()


def scrape(client) -> dict:
    """/metrics parsed by prometheus-client: {(sample name, ((label, value), ...)): value}."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def start_daemon(home: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "daemon", "--home", str(home), "--poll", "0.2"], cwd=ROOT,
                            env=child_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def assert_each_step_once(records: Records, run_id: int, steps: int):
    per_name = {}
    rows = records.metrics(run_id)
    for r in rows:
        per_name.setdefault(r["name"], []).append(r["step"])
    for name in ("reward_mean", "policy_loss", "version"):
        assert per_name[name] == list(range(steps)), name
    assert len(rows) == len({(r["name"], r["step"]) for r in rows})


@pytest.mark.slow  # three daemon restarts and a run: about 40 s
def test_serve_restarts_its_killed_daemon_each_time_health_and_metrics_say_so_and_the_run_completes(tmp_path):
    steps = 150
    with serve(tmp_path) as served:
        run = served.create(config(steps), name="kept")["id"]
        wait_until(lambda: served.client.get(f"/api/v1/runs/{run}").json()["step"] >= 3, START,
                   message="the run's first steps")
        labels = (("name", "kept"), ("run_id", str(run)))
        before = scrape(served.client)
        assert before[("molt_daemon_up", ())] == 1
        wait_until(lambda: scrape(served.client)[("molt_run_step", labels)] > before[("molt_run_step", labels)],
                   60, 0.2, message="the step gauge to move between two scrapes")

        restart_times = []
        for _ in range(3):
            status, body = wait_until(lambda: (h := health(served))[0] == 200 and h, 60, 0.05,
                                      message="a live daemon")
            assert body["status"] == "ok" and body["daemon"]["alive"]
            pid = body["daemon"]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            status, body = wait_until(lambda: (h := health(served))[0] == 503 and h, 10, 0.05,
                                      message="health to report the daemon down")
            assert body["status"] == "degraded" and not body["daemon"]["alive"]
            wait_until(lambda: scrape(served.client)[("molt_daemon_up", ())] == 0, 10, 0.05,
                       message="daemon_up 0 while it is down")
            wait_until(lambda: (h := health(served))[0] == 200 and h[1]["daemon"]["pid"] != pid, 60, 0.05,
                       message="a new daemon")
            restart_times.append(time.monotonic() - killed)
            assert scrape(served.client)[("molt_daemon_up", ())] == 1
        print(f"\nSIGKILL of the daemon -> a new one alive (health 200): "
              f"{', '.join(f'{t:.2f}' for t in restart_times)} s (backoff 1, 2, 4 s)")

        final = served.wait(run, timeout=600)
        records = Records(tmp_path)
        assert final["status"] == "completed", final["last_error"]
        assert_each_step_once(records, run, steps)
        downs = [e for e in records.daemon_events() if e["kind"] == "down"]
        assert [e["cause"] for e in downs] == ["SIGKILL"] * 3
        events = records.events(run)
        assert [e["data"]["cause"] for e in events if e["kind"] == "daemon_down"] == ["SIGKILL"] * 3
        assert len([e for e in events if e["kind"] == "completed"]) == 1, "the worker's and the daemon's, once"
        assert len(records.attempts(run)) == 1, "each new daemon adopted the worker, none started another"
        after = scrape(served.client)
        assert after[("molt_daemon_restarts_total", (("cause", "SIGKILL"),))] == 3
        assert after[("molt_runs", (("status", "completed"),))] == 1
        assert ("molt_run_step", labels) not in after, "only running runs have per-run series"


def test_a_hung_daemon_is_killed_and_replaced(tmp_path):
    records = Records(tmp_path)
    keeper = Keeper(records, [sys.executable, "-m", "daemon", "--home", str(tmp_path)], poll=0.2, hang=3)
    keeper.start()
    try:
        first = wait_until(lambda: (d := records.daemon_status())["alive"] and d["pid"], 30, message="a daemon")
        os.kill(first, signal.SIGSTOP)  # alive, holding its lock, but no longer beating
        down = wait_until(lambda: [e for e in records.daemon_events() if e["kind"] == "down"], 30,
                          message="the hang noticed")
        assert down[0]["pid"] == first and down[0]["cause"].startswith("hang: no heartbeat for")
        assert gone(first)
        wait_until(lambda: records.daemon_status()["pid"] not in (None, first), 30, message="a new daemon")
        assert records.daemon_status()["alive"]
    finally:
        keeper.close()
        stop_daemon(records, 10)
        if keeper.proc is not None:
            keeper.proc.wait(30)


def test_a_run_that_ends_while_no_daemon_watches_is_completed_at_once(tmp_path):
    records = Records(tmp_path)
    run = records.create_run(config(25))["id"]
    daemon = start_daemon(tmp_path)
    try:
        wait_until(lambda: records.get_run(run)["step"] >= 5, START, message="the run's first steps")
        worker = records.get_run(run)["pid"]
    finally:
        daemon.kill()
        daemon.wait()
    wait_until(lambda: gone(worker), 180, 0.01, message="the worker to finish")
    exited = time.time()

    done = records.get_run(run)
    print(f"\nrun completed {exited - done['finished_at']:.3f} s before its worker's exit was seen")
    assert done["status"] == "completed" and done["finished_at"] <= exited and done["pid"] is None
    (attempt,) = records.attempts(run)
    assert (attempt["outcome"], attempt["cause"], attempt["end_step"]) == ("completed", "completed", 25)
    assert attempt["ended_at"] <= exited
    assert [e["kind"] for e in records.events(run)][-1] == "completed"


@pytest.mark.slow  # ~30 s end to end: runs in CI with the slow tests
def test_daemon_stop_stops_an_orphaned_daemon_its_worker_checkpoints_and_the_next_daemon_resumes(tmp_path):
    with serve(tmp_path, "--keep-daemon") as served:
        run = served.create(config(100000, checkpoint={"every": 0}))["id"]  # no checkpoint but the stop's
        wait_until(lambda: served.client.get(f"/api/v1/runs/{run}").json()["step"] >= 3, START,
                   message="the run's first steps")
        daemon_pid = health(served)[1]["daemon"]["pid"]
        assert served.interrupt() == 0
        assert "the daemon keeps running" in served.output, served.output
    records = Records(tmp_path)
    assert records.daemon_status()["pid"] == daemon_pid and records.get_run(run)["status"] == "running"

    stop = subprocess.run(molt("daemon", "stop", "--home", str(tmp_path)), capture_output=True, text=True,
                          timeout=180, env=child_env(tmp_path), cwd=ROOT)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert f"run {run} stopped" in stop.stdout
    assert gone(daemon_pid) and not records.daemon_status()["running"]
    stopped = records.get_run(run)
    assert stopped["status"] == "stopped" and stopped["pid"] is None
    checkpoints = records.checkpoints(run)
    assert checkpoints and checkpoints[-1]["exists"] and checkpoints[-1]["step"] == stopped["step"]
    again = subprocess.run(molt("daemon", "stop", "--home", str(tmp_path)), capture_output=True, text=True,
                           timeout=60, env=child_env(tmp_path), cwd=ROOT)
    assert again.returncode == 1 and "no daemon owns" in again.stderr

    daemon = start_daemon(tmp_path)
    try:
        second = wait_until(lambda: [a for a in records.attempts(run) if a["number"] == 2
                                     and a["start_step"] is not None], START, message="the resumed attempt")[0]
        assert second["start_step"] == stopped["step"], "resumed from the stop's checkpoint"
        assert any(e["kind"] == "resume_requested" for e in records.events(run))
    finally:
        stop_daemon(records, 60, say=print)
        daemon.wait(30)


def test_a_stopped_daemon_stays_stopped_under_the_keeper_until_molt_daemon_start(tmp_path):
    records = Records(tmp_path)
    keeper = Keeper(records, [sys.executable, "-m", "daemon", "--home", str(tmp_path), "--poll", "0.2"], poll=0.2)
    keeper.start()
    try:
        with web_thread(tmp_path, "secret") as (base, _), httpx.Client(base_url=base, timeout=30) as client:
            run = records.create_run(config(100000, checkpoint={"every": 0}))["id"]
            wait_until(lambda: records.get_run(run)["step"] >= 3, START, message="the run's first steps")
            first = records.daemon_status()["pid"]
            stop = subprocess.run(molt("daemon", "stop", "--home", str(tmp_path)), capture_output=True, text=True,
                                  timeout=180, env=child_env(tmp_path), cwd=ROOT)
            assert stop.returncode == 0 and f"run {run} stopped" in stop.stdout, stop.stdout + stop.stderr
            response = wait_until(lambda: (r := client.get("/api/v1/health")).json()["status"] == "stopped" and r,
                                  30, 0.05, message="health to say stopped")
            assert response.status_code == 503 and not response.json()["daemon"]["running"]
            # several of the keeper's looks later (its first restart would come 1 s after a death): still stopped
            checks = keeper.checks
            wait_until(lambda: keeper.checks >= checks + 10, 30, 0.05, message="10 looks of the keeper")
            status = records.daemon_status()
            assert not status["running"] and status["stopped"] and status["restarts"] == 0 and keeper.proc is None
            assert records.get_run(run)["status"] == "stopped", "no new daemon resumed the run just stopped"
            assert client.get("/api/v1/health").json()["status"] == "stopped"

            start = subprocess.run(molt("daemon", "start", "--home", str(tmp_path)), capture_output=True,
                                   text=True, timeout=120, env=child_env(tmp_path), cwd=ROOT)
            assert start.returncode == 0, start.stdout + start.stderr
            second = records.daemon_status()["pid"]
            assert second not in (None, first) and keeper.proc is not None and keeper.proc.pid == second, \
                "the keeper started its own daemon (with serve's options)"
            assert f"the daemon (pid {second}) owns" in start.stdout
            response = client.get("/api/v1/health")
            assert response.status_code == 200 and response.json()["status"] == "ok"
            # the next daemon resumes the runs stopped with the last one, as `molt daemon stop` says
            wait_until(lambda: records.get_run(run)["status"] in ("running", "restarting"), 30,
                       message="the stopped run resumed")
            assert records.daemon_status()["restarts"] == 0
    finally:
        keeper.close()
        stop_daemon(records, 60)
        if keeper.proc is not None:
            keeper.proc.wait(30)


def test_a_start_requested_before_the_keeper_saw_its_stopped_daemon_exit_is_no_crash(tmp_path):
    """The race a browser test met: `molt daemon stop`, then the dashboard's Start, both between two of the keeper's
    looks. The daemon said `stopped` before it exited: that exit is a stop, not a `down` (a restart), and the start
    requested since is served at the next look. The keeper is driven by hand (no thread), so the order is exact."""
    records = Records(tmp_path)
    keeper = Keeper(records, [sys.executable, "-m", "daemon", "--home", str(tmp_path), "--poll", "0.2"], poll=0.2)
    try:
        keeper.check()  # no daemon yet: it starts one
        first = wait_until(lambda: (d := records.daemon_status())["running"] and d["pid"], 60, message="a daemon")
        assert stop_daemon(records, 60, say=lambda _: None)
        keeper.proc.wait(60)                               # it has exited; the keeper has not looked yet
        records.request_daemon_start(by="the test")        # the dashboard's Start, before that look
        keeper.check()                                     # sees the exit: a stop on request
        assert records.daemon_status()["restarts"] == 0 and keeper.proc is None
        keeper.check()                                     # serves the start requested
        second = wait_until(lambda: (d := records.daemon_status())["running"] and d["pid"], 60, message="again")
        assert second not in (None, first) and keeper.proc is not None and keeper.proc.pid == second
        assert [e["kind"] for e in records.daemon_events()].count("down") == 0
    finally:
        stop_daemon(records, 60, say=lambda _: None)
        if keeper.proc is not None:
            keeper.proc.wait(30)


def test_molt_daemon_start_without_a_keeper_starts_a_daemon_itself_and_its_help_names_the_real_default(tmp_path):
    records = Records(tmp_path)
    start = subprocess.run(molt("daemon", "start", "--home", str(tmp_path), "--poll", "0.2"), capture_output=True,
                           text=True, timeout=120, env=child_env(tmp_path), cwd=ROOT)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        status = records.daemon_status()
        assert status["alive"] and not status["kept"] and f"(pid {status['pid']}) owns" in start.stdout
        again = subprocess.run(molt("daemon", "start", "--home", str(tmp_path)), capture_output=True, text=True,
                               timeout=60, env=child_env(tmp_path), cwd=ROOT)
        assert again.returncode == 0 and "already owns" in again.stdout
    finally:
        stop_daemon(records, 30)
    assert not records.daemon_status()["running"] and records.daemon_status()["stopped"]
    for command in ("start", "stop"):
        usage = subprocess.run(molt("daemon", command, "--help"), capture_output=True, text=True, timeout=60,
                               env=child_env(tmp_path), cwd=ROOT).stdout
        assert "else the user data directory" in " ".join(usage.split()) and "./var" not in usage, usage


def test_serve_adopts_a_running_daemon_and_stops_it_on_ctrl_c(tmp_path):
    records = Records(tmp_path)
    daemon = start_daemon(tmp_path)
    try:
        wait_until(lambda: records.daemon_status()["alive"], 30, message="the daemon")
        with serve(tmp_path) as served:
            assert wait_until(lambda: f"watching the daemon (pid {daemon.pid})" in served.output, 10)
            assert health(served)[1]["daemon"]["pid"] == daemon.pid
            assert served.interrupt() == 0
        assert daemon.wait(30) == 0, "stopped by SIGTERM, cleanly"
        assert [e["kind"] for e in records.daemon_events()[:2]] == ["stopped", "started"]
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


def test_ctrl_c_while_the_daemon_is_still_starting_stops_it_too(tmp_path):
    # an env file that holds the daemon (only) in its start, before it takes the lock, until the gate file exists
    envs, gate = tmp_path / "envs", tmp_path / "gate"
    envs.mkdir()
    (envs / "slow_daemon.py").write_text(
        "import sys, time\nfrom pathlib import Path\n"
        f"while sys.argv[0].endswith('__main__.py') and not Path({str(gate)!r}).exists():\n    time.sleep(0.05)\n")
    with serve(tmp_path / "home", "--envs", str(envs)) as served:
        assert wait_until(lambda: "daemon started (pid" in served.output, 30), served.output
        pid = int(served.output.split("daemon started (pid ")[1].split(")")[0])
        try:
            assert not Records(tmp_path / "home").daemon_status()["running"], "the daemon is still starting"
            assert served.interrupt() == 0, served.output
            assert gone(pid), "the starting daemon was stopped with `molt serve`"
            assert "molt serve: stopped" in served.output
        finally:
            gate.touch()
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_health_and_metrics_without_a_daemon_and_the_metrics_token(tmp_path):
    # records as workers leave them: a running run with metrics and a breaker trip, attempts that ended uncleanly
    records = Records(tmp_path)
    run = records.create_run(FAST, name="watched")["id"]
    with Session(records.engine) as s:
        set_run(s, run, ("queued",), status="running", step=7)
        s.add(Alert(run_id=run, kind="breaker", message="tripped"))
        for number, cause in enumerate(["SIGKILL", "ValueError: boom", "ValueError: again", "completed"], 1):
            s.add(Attempt(run_id=run, number=number, ended_at=time.time(), cause=cause))
        s.add(Attempt(run_id=run, number=5))  # the live one
        s.commit()
    sink = DbSink(records.engine, run, 5, flush_every=0.05)
    sink.metrics(6, {"reward_mean": 0.75, "samples_per_s": 120.0, "staleness_mean": 0.5, "staleness_max": 1.0})
    sink.close()
    records.create_run(FAST)

    with web_thread(tmp_path, "secret") as (base, _):
        with httpx.Client(base_url=base) as client:
            response = client.get("/api/v1/health")
            assert response.status_code == 503 and response.json()["status"] == "degraded"
            assert client.get("/metrics").status_code == 401
            client.headers["Authorization"] = "Bearer secret"
            found = scrape(client)
    labels = (("name", "watched"), ("run_id", str(run)))
    assert found[("molt_daemon_up", ())] == 0 and found[("molt_queue_length", ())] == 1
    assert found[("molt_runs", (("status", "running"),))] == 1
    assert found[("molt_worker_restarts_total", (("cause", "SIGKILL"),))] == 1
    assert found[("molt_worker_restarts_total", (("cause", "ValueError"),))] == 2
    assert ("molt_worker_restarts_total", (("cause", "completed"),)) not in found
    assert [found[(name, labels)] for name in ("molt_run_step", "molt_run_reward", "molt_run_samples_per_second",
                                               "molt_run_staleness_mean", "molt_run_staleness_max",
                                               "molt_run_breaker_trips_total")] == [7, 0.75, 120.0, 0.5, 1.0, 1]
    with web_thread(tmp_path, "secret", metrics_public=True) as (base, _):
        assert scrape(httpx.Client(base_url=base))[("molt_daemon_up", ())] == 0
