"""External runs meet the daemon: schema-only registration, idempotent retries, the report token, resume refused,
a dead run marked ended, the slot rule, ids never reused, and the ends of ingest tokens (issue 56)."""
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from sqlalchemy import text
from sqlmodel import Session

from app.auth import Auth
from app_support import FAST, ROOT, TOKEN, child_env, hook, logged_in, web, web_thread  # noqa: F401 (hook, web: fixtures)
from conftest import wait_until
from daemon.db import connect, run_dir, set_run, sqlite_engine, upgrade
from daemon.models import Alert, Attempt, Evaluation, Run
from daemon.records import Records
from daemon.report import HttpSink
from daemon.supervisor import Supervisor

REPORT = Auth(TOKEN).report
WHERE = {"host": "gpu-node-7", "pid": 4242}


def register(web, config: dict, token: str = TOKEN, key: str | None = None) -> httpx.Response:
    return httpx.post(f"{web['base']}/api/v1/external-runs", json={"config": config, **WHERE}, timeout=30,
                      headers={"Authorization": f"Bearer {token}", **({"Idempotency-Key": key} if key else {})})


def ingest(web, run_id: int, token: str, records: list) -> httpx.Response:
    return httpx.post(f"{web['base']}/api/v1/runs/{run_id}/ingest", json={"records": records, "heartbeat_age": 0},
                      headers={"Authorization": f"Bearer {token}"}, timeout=30)


def metrics(step: int) -> dict:
    return {"t": "metrics", "time": time.time(), "step": step, "values": {"reward_mean": 0.5, "version": step + 1}}


def external(web, config: dict | None = None) -> tuple[int, str]:
    response = register(web, config or {"env": "max_digit"})
    assert response.status_code == 201, response.text
    return response.json()["run"]["id"], response.json()["ingest_token"]


def supervisor(web, **options) -> Supervisor:
    """The daemon's supervisor in this process, on the test's database, never started: its ticks are called."""
    sup = Supervisor(web["home"], gpus=[], **options)
    sup.engine = connect(web["home"])
    return sup


@pytest.mark.parametrize("config", [
    {"env": "chat_calculator", "model": {"path": "/models/on-the-gpu-node/qwen"}},    # no chat template here
    {"env": "dataset", "env_args": {"path": "/data/on-the-gpu-node/train.jsonl"}},    # no such file here
    {"env": "my_env_from_molt_envs_there", "eval": {"suites": [{"name": "x", "env": "another_of_mine"}]}},
    {"env": "chat_calculator", "model": {"preset": "tiny-chat", "tool_parser": "my_parsers:parse_there"}}])
def test_an_external_run_whose_files_are_elsewhere_registers_and_reports(web, config):
    response = register(web, config)
    assert response.status_code == 201, response.text
    run_id, token = response.json()["run"]["id"], response.json()["ingest_token"]
    assert ingest(web, run_id, token, [metrics(0)]).status_code == 200
    run = web["client"].get(f"/api/v1/runs/{run_id}").json()
    assert run["status"] == "running" and run["step"] == 1 and run["config"]["env"] == config["env"]
    assert run_id in [r["id"] for r in web["client"].get("/api/v1/runs").json()]


def test_an_external_run_mirrored_to_a_tracker_not_installed_here_registers(web, monkeypatch):
    """The trackers are installed where the run trains (issue 64, item 7); a run queued here still needs them."""
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what find_spec sees when mlflow is not installed
    config = {**FAST, "report": {"to": ["mlflow"]}}
    assert register(web, config).status_code == 201
    refused = web["client"].post("/api/v1/runs", json={"config": config})
    assert refused.status_code == 422 and "mlflow is not installed" in refused.text
    assert register(web, {**FAST, "report": {"to": ["mlflow", "mlflow"]}}).status_code == 422  # the schema's rule


def test_an_external_config_is_still_checked_against_the_schema(web):
    response = register(web, {"env": "dataset", "loop": {"steps": 0, "stepz": 3}})
    assert response.status_code == 422
    assert {tuple(e["loc"]) for e in response.json()["detail"]} == {("body", "config", "loop", "steps"),
                                                                    ("body", "config", "loop", "stepz")}


def test_resume_of_an_external_run_is_refused_and_the_daemon_never_starts_it(web):
    run_id, token = external(web)
    assert ingest(web, run_id, token, [{"t": "end", "time": time.time(), "status": "stopped"}]).status_code == 200
    response = web["client"].post(f"/api/v1/runs/{run_id}/resume")
    assert response.status_code == 409 and "molt train --resume --report-to" in response.json()["detail"]
    page = web["client"].get(f"/runs/{run_id}").text
    assert f'hx-post="/runs/{run_id}/resume"' not in page and "resumes on gpu-node-7" in page
    with web["records"].engine.begin() as conn:  # queued anyway (what the old resume did): never started here
        set_run(conn, run_id, status="queued")
    sup = supervisor(web)
    sup.start_due()
    assert sup.workers == {} and web["records"].get_run(run_id)["status"] == "queued"
    with web["records"].engine.begin() as conn:
        set_run(conn, run_id, status="stopped")


def test_a_dead_external_run_is_marked_failed_by_the_api_or_stopped_from_the_page(web):
    dead, token = external(web)
    alive, alive_token = external(web)
    sup = supervisor(web, heartbeat_timeout=0.0)
    sup.watch_external()  # no heartbeat for 0 s: both unreachable
    assert ingest(web, alive, alive_token, []).json()["status"] == "running"  # it reports again
    assert web["client"].post(f"/api/v1/runs/{alive}/end", json={"status": "failed"}).status_code == 409
    assert web["client"].post(f"/api/v1/runs/{dead}/stop").json()["status"] == "stopping"  # nobody answers
    response = web["client"].post(f"/api/v1/runs/{dead}/end", json={"status": "failed"})
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "failed" and "no longer reported" in response.json()["last_error"]
    assert web["client"].get(f"/api/v1/runs/{dead}/attempts").json()[-1]["ended_at"] is not None
    assert ingest(web, dead, token, [metrics(1)]).status_code == 409  # its token writes no more
    assert web["client"].post(f"/api/v1/runs/{dead}/end", json={"status": "ended"}).status_code == 422

    sup.watch_external()
    browser, csrf = logged_in(web)
    assert 'hx-post="/runs/%d/mark-stopped"' % alive in browser.get(f"/runs/{alive}").text
    browser.post(f"/runs/{alive}/mark-stopped", data={"csrf_token": csrf})
    assert web["client"].get(f"/api/v1/runs/{alive}").json()["status"] == "stopped"
    assert web["client"].delete(f"/api/v1/runs/{alive}").status_code == 204  # ended: it can go


@pytest.mark.slow  # two daemon starts and a `molt daemon stop`: half a minute on busy cores
def test_a_graceful_daemon_stop_leaves_an_external_run_training_and_reporting(tmp_path):
    """`molt daemon stop` stops the daemon's own runs; an external run's process is not the daemon's: it goes on
    reporting through the dashboard, before the next daemon starts and after."""
    records = Records(tmp_path)

    def start_daemon():
        daemon = subprocess.Popen([sys.executable, "-m", "daemon", "--home", str(tmp_path), "--poll", "0.2"],
                                  cwd=ROOT, env=child_env(tmp_path), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        wait_until(lambda: records.daemon_status()["pid"] == daemon.pid, 60, message="the daemon up")
        return daemon
    with web_thread(tmp_path, TOKEN) as (base, _):
        site = {"base": base}
        run, token = external(site)
        daemon = start_daemon()
        assert ingest(site, run, token, [metrics(0)]).status_code == 200
        stop = subprocess.run([sys.executable, "-m", "app.cli", "daemon", "stop", "--home", str(tmp_path)],
                              capture_output=True, text=True, timeout=120, env=child_env(tmp_path), cwd=ROOT)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert daemon.wait(30) == 0 and f"run {run}" not in stop.stdout  # not one of the runs it stopped
        assert ingest(site, run, token, [metrics(1)]).json()["status"] == "running"  # no daemon: it reports on
        daemon = start_daemon()
        try:
            lock, touched = tmp_path / "daemon.lock", (tmp_path / "daemon.lock").stat().st_mtime_ns
            wait_until(lambda: lock.stat().st_mtime_ns > touched, 30, message="a tick of the next daemon")  # its touch
            assert ingest(site, run, token, [metrics(2)]).json()["status"] == "running"
            assert records.get_run(run)["status"] == "running" and records.attempts(run)[-1]["number"] == 1
            assert [m["step"] for m in records.metrics(run, names=["reward_mean"])] == [0, 1, 2]
        finally:
            daemon.terminate()
            daemon.wait(30)


def test_an_unreachable_external_run_holds_no_slot_so_an_evaluation_starts(web):
    run_id, _ = external(web)
    sup = supervisor(web, concurrency=1, heartbeat_timeout=0.0)
    sup.watch_external()
    assert web["client"].get(f"/api/v1/runs/{run_id}").json()["status"] == "unreachable"
    response = web["client"].post("/api/v1/evals", json={"model": {"preset": "tiny-dense"}, "env": "max_digit",
                                                         "episodes": 2})
    assert response.status_code == 201, response.text
    eval_id = response.json()["id"]
    from app.queue import queue_notes  # the dashboard's note reads the daemon's rule (daemon/slots.py): no slot held
    assert queue_notes(web["records"].engine, 1)[("evaluation", eval_id)].startswith("1st in line; no slot taken")
    with Session(web["records"].engine) as s:
        assert sup.free_slots(s) == 1
    sup.evals.tick()
    pid = web["client"].get(f"/api/v1/evals/{eval_id}").json()["pid"]
    try:
        assert pid, "the evaluation waits for a slot the external run holds"
        with Session(web["records"].engine) as s:
            assert sup.free_slots(s) == 0  # the evaluation holds the one slot now
    finally:
        if pid:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        with web["records"].engine.begin() as conn:
            conn.execute(text("UPDATE evaluation SET status = 'failed' WHERE id = :id"), {"id": eval_id})
            set_run(conn, run_id, status="failed")


def test_a_retried_registration_or_resume_with_its_idempotency_key_creates_one(web):
    before = len(web["client"].get("/api/v1/runs").json())
    first, again = (register(web, {"env": "max_digit"}, key="key-1") for _ in range(2))
    assert first.status_code == again.status_code == 201
    run_id = first.json()["run"]["id"]
    assert again.json()["run"]["id"] == run_id and len(web["client"].get("/api/v1/runs").json()) == before + 1
    token = again.json()["ingest_token"]  # the first answer was lost: its token is replaced
    assert ingest(web, run_id, first.json()["ingest_token"], []).status_code == 401
    assert ingest(web, run_id, token, [{"t": "end", "time": time.time(), "status": "stopped"}]).status_code == 200
    for _ in range(2):
        response = httpx.post(f"{web['base']}/api/v1/runs/{run_id}/attempts", json=WHERE, timeout=30,
                              headers={"Authorization": f"Bearer {token}", "Idempotency-Key": "resume-1"})
        assert response.status_code == 201 and response.json()["status"] == "running", response.text
    assert [a["number"] for a in web["client"].get(f"/api/v1/runs/{run_id}/attempts").json()] == [1, 2]


def test_an_ended_runs_token_writes_nothing_but_its_end_again_and_a_completed_run_resumes_only_to_go_further(web):
    run_id, token = external(web)
    end = [metrics(0), metrics(1), {"t": "end", "time": time.time(), "status": "completed"}]
    assert ingest(web, run_id, token, end).json()["status"] == "completed"
    assert ingest(web, run_id, token, end).status_code == 200  # the same batch again: its answer was lost
    assert ingest(web, run_id, token, [metrics(2)]).status_code == 409

    def resume(steps=None):
        return httpx.post(f"{web['base']}/api/v1/runs/{run_id}/attempts", json={**WHERE, "steps": steps},
                          headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert resume().status_code == 409 and resume(2).status_code == 409  # completed: only to train further
    assert resume(5).status_code == 201 and ingest(web, run_id, token, [metrics(2)]).status_code == 200
    assert web["client"].get(f"/api/v1/runs/{run_id}").json()["total_steps"] == 5


def test_the_report_token_registers_and_reports_runs_and_nothing_else(web, tmp_path):
    response = register(web, {"env": "max_digit"}, token=REPORT)
    assert response.status_code == 201, response.text
    assert httpx.get(f"{web['base']}/api/v1/runs", headers={"Authorization": f"Bearer {REPORT}"}).status_code == 401
    assert httpx.post(f"{web['base']}/api/v1/runs", json={"config": FAST},
                      headers={"Authorization": f"Bearer {REPORT}"}).status_code == 401
    printed = subprocess.run([sys.executable, "-m", "app.cli", "token", "--report"], capture_output=True, text=True,
                             cwd=ROOT, env={**child_env(tmp_path), "MOLT_TOKEN": TOKEN}, check=True).stdout
    assert printed.strip() == REPORT


def test_report_json_is_owner_only_even_when_it_was_there_before(web, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"url": "http://elsewhere", "run_id": 1, "ingest_token": "x"}))
    os.chmod(out / "report.json", 0o644)
    sink = HttpSink(web["base"], TOKEN, {"env": "max_digit"}, out, flush_every=0.05)
    sink.metrics(0, {"reward_mean": 1.0, "version": 1})
    sink.end("completed")
    saved = json.loads((out / "report.json").read_text())
    assert saved["url"] == web["base"] and oct((out / "report.json").stat().st_mode & 0o777) == "0o600"
    assert web["client"].get(f"/api/v1/runs/{saved['run_id']}").json()["status"] == "completed"


def test_a_sigkilled_ray_worker_leaves_no_attempt_file_and_its_ingest_token_is_revoked(web):
    run_id = web["records"].create_run(FAST)["id"]
    with Session(web["records"].engine) as s:
        attempt = Attempt(run_id=run_id, number=1)
        s.add(attempt)
        s.commit()
        attempt_id = attempt.id
        set_run(s, run_id, status="running", ingest_token="a-hash")
        s.commit()
    directory = run_dir(web["home"], run_id)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"attempt-{attempt_id}.json").write_text('{"ingest_token": "secret"}')
    supervisor(web).end_attempt(run_id, attempt_id, -signal.SIGKILL)  # what the daemon does when it finds it dead
    assert not (directory / f"attempt-{attempt_id}.json").exists()
    with Session(web["records"].engine) as s:
        run = s.get(Run, run_id)
        assert run.ingest_token is None and run.status == "restarting"
        set_run(s, run_id, status="stopped")
        s.commit()


def test_run_evaluation_and_alert_ids_are_never_reused_after_a_delete(tmp_path):
    (tmp_path / "old").mkdir()
    engine = sqlite_engine(f"sqlite:///{tmp_path / 'old' / 'molt.db'}")
    upgrade(engine, tmp_path / "old", "0008_external_runs")  # a database from before: its rows survive
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO run (id, name, status, config, tags, step, total_steps, version, restarts, "
                          "retries, max_restarts, created_at, notes, archived) VALUES (7, 'old', 'completed', '{}', "
                          "'[]', 0, 1, 0, 0, 0, 0, 0, '', 0)"))
        conn.execute(text("INSERT INTO alert (run_id, time, kind, message, data, acknowledged) "
                          "VALUES (7, 0, 'worker', 'm', '{}', 0)"))
    upgrade(engine, tmp_path / "old")
    with engine.connect() as conn:
        tables = dict(conn.execute(text("SELECT name, sql FROM sqlite_master WHERE type = 'table'")).all())
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert conn.execute(text("SELECT count(*) FROM alert WHERE run_id = 7")).scalar() == 1
    assert all("AUTOINCREMENT" in tables[t] for t in ("run", "evaluation", "alert")), tables

    from daemon.records import Records
    records = Records(tmp_path / "old")
    for model in (Run, Evaluation, Alert):
        ids = []
        for _ in range(2):
            with Session(records.engine) as s:
                row = {Run: lambda: Run(name="x", config={}, total_steps=1),
                       Evaluation: lambda: Evaluation(config={}),
                       Alert: lambda: Alert(run_id=7, kind="k", message="m")}[model]()
                s.add(row)
                s.commit()
                ids.append(row.id)
                s.delete(row)
                s.commit()
        assert ids[1] == ids[0] + 1, (model.__name__, ids)
    first = records.create_run(FAST)["id"]
    records.stop_run(first)
    records.delete_run(first)
    assert records.create_run(FAST)["id"] == first + 1


def test_ids_deleted_before_autoincrement_are_never_given_again(tmp_path):
    """Before 0009 a deleted run's or evaluation's id could be given again (SQLite's max(rowid) + 1), and 0009 began
    the sequences at the highest row kept: an id still named anywhere (an evaluation's directory an earlier delete
    left, a row of it, a run's directory its worker wrote after the delete) is never given again (issue 64)."""
    home = tmp_path / "old"
    home.mkdir()
    engine = sqlite_engine(f"sqlite:///{home / 'molt.db'}")
    upgrade(engine, home, "0008_external_runs")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO run (id, name, status, config, tags, step, total_steps, version, restarts, "
                          "retries, max_restarts, created_at, notes, archived) VALUES (2, 'kept', 'completed', '{}', "
                          "'[]', 0, 1, 0, 0, 0, 0, 0, '', 0)"))
        conn.execute(text("INSERT INTO evaluation (id, run_id, config, status, results, restarts, max_restarts, "
                          "created_at) VALUES (1, 2, '{}', 'completed', '{}', 0, 3, 0)"))
    (home / "runs" / "5").mkdir(parents=True)     # run 5 deleted, its worker's last log line written after
    (home / "evals" / "4").mkdir(parents=True)    # evaluation 4 deleted with its run: the old delete left this
    upgrade(engine, home)
    from daemon.records import Records
    records = Records(home)
    assert records.create_run(FAST)["id"] == 6
    with Session(records.engine) as s:
        evaluation = Evaluation(config={})
        s.add(evaluation)
        s.commit()
        assert evaluation.id == 5


@pytest.mark.slow
def test_the_token_is_on_no_ranks_command_line(web, tmp_path):
    """`molt train --nproc 2 --report-to` with the report token in $MOLT_TOKEN: torchrun's ranks get it through the
    environment, never as an argument (`ps` shows arguments to every user of the machine)."""
    config = {**FAST, "loop": {**FAST["loop"], "steps": 3}, "warm_start": {"steps": 0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "train", "--nproc", "2", "--config",
                             str(tmp_path / "config.json"), "--out", str(out), "--report-to", web["base"]],
                            cwd=ROOT, env={**child_env(tmp_path / "home"), "MOLT_TOKEN": REPORT},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, str] = {}

    def ranks():
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                args = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace").replace("\0", " ")
                environ = open(f"/proc/{entry}/environ", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if str(out) in args and "LOCAL_RANK=" in environ:
                seen[int(entry)] = args
        return len(seen) >= 2 or proc.poll() is not None

    wait_until(ranks, 240, 0.05, message="two ranks running")
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    assert len(seen) == 2 and not [a for a in seen.values() if REPORT in a or "--token" in a], seen
    run = [r for r in web["client"].get("/api/v1/runs").json() if r["host"] and r["ranks"] == 2][0]
    assert run["status"] == "completed" and run["step"] == 3


REFUSED = """
import json, signal, sys, time
from pathlib import Path
from daemon.report import HttpSink
asked = []
signal.signal(signal.SIGTERM, lambda *_: asked.append(time.monotonic()))  # the engine's stop, as in `molt train`
sink = HttpSink(sys.argv[2], "", {"env": "max_digit", "loop": {"steps": 2}}, Path(sys.argv[1]), resume=True,
                flush_every=0.05)
sink.metrics(1, {"reward_mean": 1.0})
deadline = time.monotonic() + 60
while not asked and time.monotonic() < deadline:
    time.sleep(0.05)
ending = time.monotonic()
sink.end("stopped")
print(json.dumps({"stopped": bool(asked), "end_s": time.monotonic() - ending}))
"""


def test_a_process_whose_run_the_dashboard_refuses_stops_keeps_its_records_and_does_not_wait(web, tmp_path):
    """`molt train --resume` of a completed run with no more steps: /attempts answers 409. The process stops (as at
    a stop from the dashboard) and ends at once, its records kept in the spool, instead of retrying for minutes."""
    run_id, token = external(web)
    ingest(web, run_id, token, [metrics(0), metrics(1), {"t": "end", "time": time.time(), "status": "completed"}])
    (tmp_path / "report.json").write_text(json.dumps({"url": web["base"], "run_id": run_id, "ingest_token": token}))
    proc = subprocess.run([sys.executable, "-c", REFUSED, str(tmp_path), web["base"]], capture_output=True, text=True,
                          cwd=ROOT, env=child_env(tmp_path / "home"), timeout=120)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["stopped"] and result["end_s"] < 30, (result, proc.stderr[-2000:])
    assert "takes no more records of this run" in proc.stderr and "is completed (2 steps)" in proc.stderr
    spooled = [json.loads(line) for p in tmp_path.glob("report-spool-*.jsonl") for line in p.read_text().splitlines()]
    assert {"metrics", "end"} <= {r["t"] for r in spooled}  # kept for a later --resume
    assert len(web["client"].get(f"/api/v1/runs/{run_id}/attempts").json()) == 1


def test_an_idempotency_key_finds_external_runs_only_and_a_future_sweeps_key_breaks_no_sweep(web):
    """External keys have their own namespace (issue 64, item 3): a sweep run's key registers a new external run
    (never that daemon run, with a token for it), and a key taken first by a registration leaves the sweep whole."""
    from daemon.sweep_tick import tick_sweeps
    from daemon.sweeps import SweepRequest
    grid = SweepRequest.model_validate({"name": "keys", "config": FAST, "seeds": 1,
                                        "params": {"algo.lr": {"values": [1e-3, 3e-3]}}})
    sweep_id = web["records"].queue_sweep(grid)["id"]
    future = sweep_id + 1
    taken = register(web, {"env": "max_digit"}, key=f"sweep:{future}:0:0")  # before that sweep exists
    tick_sweeps(web["records"].engine, lambda _s: 8)
    assert web["records"].queue_sweep(grid.model_copy(update={"name": "later"}))["id"] == future
    tick_sweeps(web["records"].engine, lambda _s: 8)
    later = web["records"].get_sweep(future)
    assert later["status"] == "running" and len(later["runs"]) == 2, later
    sweep_run = next(r for r in web["records"].get_sweep(sweep_id)["runs"] if r["sweep_point"] == 0)["id"]
    response = register(web, {"env": "max_digit"}, key=f"sweep:{sweep_id}:0:0")
    assert response.status_code == 201 and response.json()["run"]["id"] not in (sweep_run, taken.json()["run"]["id"])
    assert response.json()["run"]["host"] == WHERE["host"]
    assert ingest(web, sweep_run, response.json()["ingest_token"], [metrics(0)]).status_code == 403
    with Session(web["records"].engine) as s:
        assert s.get(Run, sweep_run).ingest_token is None and s.get(Run, sweep_run).status == "queued"
    for sweep in (sweep_id, future):
        web["client"].post(f"/api/v1/sweeps/{sweep}/stop")


def test_concurrent_registrations_with_one_key_return_one_run(web):
    """Real concurrent HTTP requests (a retry racing its lost first try): one run, the same for all, no 500."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier
    for attempt in range(3):
        barrier, key = Barrier(8), f"race-{attempt}"

        def racer(_):
            barrier.wait()
            return register(web, {"env": "max_digit"}, key=key)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(racer, range(8)))
        assert [a.status_code for a in answers] == [201] * 8, [a.text for a in answers if a.status_code != 201]
        assert len({a.json()["run"]["id"] for a in answers}) == 1
        with Session(web["records"].engine) as s:
            assert s.scalar(text("SELECT count(*) FROM run WHERE idempotency_key LIKE :k"), {"k": f"%{key}"}) == 1
