"""External runs: `molt train --report-to` against a real `molt serve`: a dashboard SIGKILLed mid-run loses and
duplicates nothing, a stop from the dashboard checkpoints and exits 4, ingest tokens are scoped to their run."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from sqlmodel import Session

from conftest import wait_until
from daemon.db import connect
from daemon.models import Event, Metric
from molt_engine.envs import EVAL_SEEDS

from app_support import FAST, ROOT, Served, child_env, free_port, molt

CONFIG = {**FAST, "model": {"preset": "tiny-dense"}, "seed": 0}


def until(condition, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)
    return value


def train(tmp_path: Path, served: Served, steps: int, token: str | None = None, resume: bool = False
          ) -> subprocess.Popen:
    """`molt train --report-to` as a user runs it, in its own output directory; output to a file. `resume`: the
    same command with `--resume --steps` on the same directory."""
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "loop": {**CONFIG["loop"], "steps": steps}}))
    log = open(tmp_path / "train.log", "a")
    env = {**child_env(tmp_path / "unused-home"), "MOLT_TOKEN": token or served.token}
    how = ["--resume", "--steps", str(steps)] if resume else ["--config", str(tmp_path / "config.json")]
    return subprocess.Popen(molt("train", *how, "--out", str(tmp_path / "out"), "--report-to", served.base),
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def external_run(served: Served) -> dict | None:
    runs = [r for r in served.client.get("/api/v1/runs").json() if r["host"]]
    return runs[0] if runs else None


def ingest(base: str, run_id: int, token: str, records: list, age: float | None = 0.0) -> httpx.Response:
    return httpx.post(f"{base}/api/v1/runs/{run_id}/ingest", json={"records": records, "heartbeat_age": age},
                      headers={"Authorization": f"Bearer {token}"}, timeout=30)


@pytest.mark.slow
def test_a_dashboard_killed_mid_run_and_restarted_loses_and_duplicates_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MOLT_HEARTBEAT_TIMEOUT", "4")  # so its daemon marks the run unreachable while the web is down
    home, port, steps = tmp_path / "home", free_port(), 40
    served = Served(home, "--port", str(port))
    proc = None
    try:
        proc = train(tmp_path, served, steps)
        run = until(lambda: (r := external_run(served)) and r["step"] >= 5 and r, 240, "the run's step 5")
        assert run["status"] == "running" and run["host"] == os.uname().nodename and run["ranks"] == 1
        served.proc.kill()  # SIGKILL: no goodbye; its daemon lives on (its own session) and watches the run
        served.proc.wait(30)
        killed_at = time.monotonic()
        spool = tmp_path / "out"
        # the run goes on while the dashboard is down: its records pile up in the spool
        until(lambda: time.monotonic() - killed_at >= 10 and sum(p.stat().st_size for p in spool.glob(
            "report-spool-*.jsonl")) > 0, 60, "10 s down with records spooled")
        served = Served(home, "--port", str(port))
        assert proc.wait(300) == 0, (tmp_path / "train.log").read_text()[-3000:]
        run = served.client.get(f"/api/v1/runs/{run['id']}").json()
        assert run["status"] == "completed" and run["step"] == steps
        with Session(connect(home)) as s:
            counts = dict(s.execute(select(Metric.step, func.count()).where(
                Metric.run_id == run["id"], Metric.name == "reward_mean").group_by(Metric.step)).all())
            kinds = s.scalars(select(Event.kind).where(Event.run_id == run["id"])).all()
        assert counts == {step: 1 for step in range(steps)}, counts  # every step, once
        assert "report_failed" in kinds and kinds.count("completed") == 1, kinds  # it was really cut off
        assert kinds.count("unreachable") >= 1 and kinds.count("reachable") >= 1, kinds
        assert not list(spool.glob("report-spool-*.jsonl")) or all(
            p.stat().st_size == 0 for p in spool.glob("report-spool-*.jsonl"))  # everything delivered
        page = served.client.get(f"/runs/{run['id']}").text
        assert "external" in page and "completed" in page
    finally:
        if proc and proc.poll() is None:
            proc.kill()
        served.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOLT_HEARTBEAT_TIMEOUT", "3")  # its daemon's
        served = Served(tmp_path_factory.mktemp("home"))
    yield served
    served.close()


@pytest.mark.slow
def test_a_stop_from_the_dashboard_checkpoints_and_exits_4_and_resume_goes_on_in_the_same_run(served, tmp_path):
    proc = train(tmp_path, served, 500)
    try:
        run = until(lambda: (r := external_run(served)) and r["step"] >= 2 and r, 240, "the run's step 2")
        assert served.client.post(f"/api/v1/runs/{run['id']}/stop").json()["status"] == "stopping"
        assert proc.wait(120) == 4, (tmp_path / "train.log").read_text()[-3000:]
        run = served.client.get(f"/api/v1/runs/{run['id']}").json()
        checkpoints = served.client.get(f"/api/v1/runs/{run['id']}/checkpoints").json()
        assert run["status"] == "stopped" and 2 <= run["step"] < 500
        assert checkpoints and checkpoints[-1]["step"] == run["step"]  # the stop's own checkpoint, recorded
        assert Path(checkpoints[-1]["path"]).exists() and checkpoints[-1]["size_bytes"] > 0

        # What a process killed before delivering left in its spool (the sink's own file format), then --resume:
        # the same run goes on as attempt 2, and the leftover is delivered first, once
        leftover = {"t": "event", "time": time.time(), "kind": "left_over", "message": "never delivered", "data": {},
                    "uid": "killed:1"}
        (tmp_path / "out" / "report-spool-000007.jsonl").write_text(json.dumps(leftover) + "\n")
        runs_before, steps = len(served.client.get("/api/v1/runs").json()), run["step"] + 3
        proc = train(tmp_path, served, steps, resume=True)
        assert proc.wait(300) == 0, (tmp_path / "train.log").read_text()[-3000:]
        run = served.client.get(f"/api/v1/runs/{run['id']}").json()
        attempts = served.client.get(f"/api/v1/runs/{run['id']}/attempts").json()
        kinds = [e["kind"] for e in served.client.get(f"/api/v1/runs/{run['id']}/events").json()]
        series = served.client.get(f"/api/v1/runs/{run['id']}/metrics", params={"names": "reward_mean"}).json()
        assert len(served.client.get("/api/v1/runs").json()) == runs_before  # no second run registered
        assert run["status"] == "completed" and run["step"] == steps and run["total_steps"] == steps
        assert [(a["number"], a["outcome"]) for a in attempts] == [(1, "stopped"), (2, "completed")], attempts
        assert kinds.count("attempt") == 1 and kinds.count("left_over") == 1, kinds
        assert series["series"]["reward_mean"]["step"] == list(range(steps))  # every step, once
        assert not [p for p in (tmp_path / "out").glob("report-spool-*.jsonl") if p.stat().st_size]
        assert oct((tmp_path / "out" / "report.json").stat().st_mode & 0o777) == "0o600"  # it holds a credential
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ingest_tokens_are_scoped_and_a_resent_batch_duplicates_nothing(served):
    def register(host):
        response = served.client.post("/api/v1/external-runs", json={
            "config": {"env": "max_digit"}, "host": host, "pid": 1234, "ranks": 2})
        assert response.status_code == 201, response.text
        return response.json()

    first, second = register("node-a"), register("node-b")
    run_id, token = first["run"]["id"], first["ingest_token"]
    assert first["run"]["status"] == "running" and first["run"]["ranks"] == 2 and token != second["ingest_token"]
    episode = {"group": -1, "seed": EVAL_SEEDS + 7, "version": 3, "reward": 1.0, "advantage": None, "success": True,
               "turns": 1, "tool_calls": 0, "tool_errors": 0, "prompt": "p", "text": "t",
               "tokens": {"id": [5, 9], "text": ["p", "t"], "action": [False, True], "logprob": [None, -0.5],
                          "trainer_logprob": [None, None], "version": [-1, 3], "entropy": [None, 0.25]}}
    batch = [{"t": "metrics", "time": time.time(), "step": s, "values": {"reward_mean": s / 10, "version": s + 1}}
             for s in range(3)] + [{"t": "event", "time": time.time(), "kind": "saved", "message": "saved step 2",
                                    "data": {"step": 2}, "uid": "abc:1"},
                                   {"t": "samples", "time": time.time(), "step": 2, "kind": "eval",
                                    "records": [episode]}]  # an eval's seed is past 2**62 (envs.EVAL_SEEDS)
    assert ingest(served.base, run_id, second["ingest_token"], batch).status_code == 403  # another run's token
    assert ingest(served.base, run_id, "wrong", batch).status_code == 401
    assert ingest(served.base, run_id, served.token, batch).status_code == 401  # the dashboard's token: not here
    assert httpx.post(f"{served.base}/api/v1/external-runs", json={"config": {"env": "max_digit"}, "host": "x",
                                                                   "pid": 1}, timeout=30).status_code == 401
    assert ingest(served.base, run_id, token, [{"t": "metrics", "step": 0}]).status_code == 422
    shapeless = {**batch[-1], "records": [{**episode, "tokens": {}}]}  # a sample the samples view could not show
    assert ingest(served.base, run_id, token, [shapeless]).status_code == 422
    for _ in range(2):
        reply = ingest(served.base, run_id, token, batch)
        assert reply.status_code == 200 and reply.json() == {"run_id": run_id, "status": "running", "stop": False,
                                                             "written": 5}, reply.text
    series = served.client.get(f"/api/v1/runs/{run_id}/metrics", params={"names": "reward_mean"}).json()["series"]
    events = served.client.get(f"/api/v1/runs/{run_id}/events").json()
    assert series["reward_mean"]["step"] == [0, 1, 2]
    assert [e["kind"] for e in events] == ["external", "saved"]
    samples = served.client.get(f"/api/v1/runs/{run_id}/samples", params={"kind": "eval"}).json()
    assert [(x["seed"], x["step"]) for x in samples["samples"]] == [(EVAL_SEEDS + 7, 2)], samples
    assert served.client.get(f"/api/v1/runs/{second['run']['id']}/metrics").json()["names"] == []


def test_a_run_without_heartbeats_is_unreachable_not_failed_and_running_again_when_they_resume(served):
    registered = served.client.post("/api/v1/external-runs", json={
        "config": {"env": "max_digit"}, "host": "node-c", "pid": 99}).json()
    run_id, token = registered["run"]["id"], registered["ingest_token"]
    until(lambda: served.client.get(f"/api/v1/runs/{run_id}").json()["status"] == "unreachable", 60,
          "unreachable after the 3 s heartbeat timeout")
    assert served.client.get(f"/api/v1/runs/{run_id}/attempts").json()[0]["ended_at"] is None  # not ended, not failed
    assert served.client.get("/api/v1/runs", params={"status": "unreachable"}).json()[0]["id"] == run_id
    assert ingest(served.base, run_id, token, [], age=0.2).json()["status"] == "running"
    kinds = [e["kind"] for e in served.client.get(f"/api/v1/runs/{run_id}/events").json()]
    assert kinds == ["external", "unreachable", "reachable"], kinds


def test_a_full_spool_warns_once_trains_on_and_says_what_it_dropped_once_the_dashboard_is_back(tmp_path, capsys):
    """The dashboard is down for a whole run: past the spool's cap (small here, 256 MiB by default) new records are
    dropped with one warning and training goes on to its last step; once a dashboard answers, what was kept arrives,
    the count of what was dropped is said on the terminal and as an event, and the run ends `completed` there. A run
    that ends before any delivery works again tells its count before its end (the dashboard takes nothing after)."""
    from daemon.report import HttpSink
    from molt_engine import train as train_here
    home, port, steps = tmp_path / "home", free_port(), 10
    home.mkdir()
    (home / "token").write_text("spool-cap-token")  # the dashboard's token, known before it starts
    os.chmod(home / "token", 0o600)
    config = {**CONFIG, "loop": {**CONFIG["loop"], "steps": steps}}
    sink = HttpSink(f"http://127.0.0.1:{port}", "spool-cap-token", config, tmp_path / "out", name="capped",
                    spool_cap=16 * 2**10)
    summary = train_here(config, sink, out_dir=tmp_path / "out")  # nothing listens on the port meanwhile
    assert summary["status"] == "completed" and summary["step"] == steps, summary
    down = capsys.readouterr().err
    assert down.count("molt: WARNING: the spool holds") == 1, down  # once, however long it stays full
    assert "(its cap): new records are DROPPED until report succeeds again" in down, down
    served, said = Served(home, "--port", str(port)), []
    try:
        wait_until(lambda: said.append(capsys.readouterr().err) or "records were dropped" in "".join(said), 60,
                   message="the delivery working again")  # the sink's own retries, the run not ended yet
        sink.end(summary["status"], summary)
        run = external_run(served)
        events = served.client.get(f"/api/v1/runs/{run['id']}/events").json()

        # a second run whose records are not delivered before its end (a flush every hour)
        late = HttpSink(served.base, "spool-cap-token", config, tmp_path / "late", name="late", flush_every=3600,
                        spool_cap=4 * 2**10)
        for step in range(100):
            late.metrics(step, {"reward_mean": 0.5, "policy_loss": 0.1})
        late.end("completed", {"step": 100})
        late_run = [r for r in served.client.get("/api/v1/runs").json() if r["name"] == "late"][0]
        late_events = served.client.get(f"/api/v1/runs/{late_run['id']}/events").json()
    finally:
        served.close()
    back = "".join(said) + capsys.readouterr().err
    told = [line for line in back.splitlines() if "records were dropped" in line]
    assert len(told) == 2 and told[0].startswith("molt: report works again; "), back
    assert told[1].startswith("molt: the spool was full; "), back
    dropped = [int(line.split("; ")[1].split(" ")[0]) for line in told]
    assert back.count("WARNING") == 1 and "could not be reported" not in back, back  # the late run's warning
    assert run["status"] == "completed" and run["step"] < steps, run  # its later steps' records were dropped
    assert late_run["status"] == "completed", late_run  # its end never dropped, nor anything sent after it
    for got, n, cap in ((events, dropped[0], 0.015625), (late_events, dropped[1], 0.00390625)):
        assert n > 0 and [(e["message"], e["data"]) for e in got if e["kind"] == "spool_full"] == [
            (f"{n} records dropped: report failed while the spool held {cap:g} MiB (its cap)", {"dropped": n})], got
    assert not list((tmp_path / "out").glob("report-spool-*.jsonl")), "everything kept was delivered"
