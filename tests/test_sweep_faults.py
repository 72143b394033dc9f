"""Sweeps under faults: a graceful daemon stop (`molt daemon stop`, Ctrl-C of `molt serve`) never ends a sweep, a
bad sweep fails alone while the others go on, a large grid's runs come in bounded batches, and the lesser seams
(TPE's integer ends, its random start, `seed` in params, a metric no run records). Real SQLite files, real
`molt serve` processes and signals."""
import math
import os
import signal
import statistics
import subprocess

import httpx
import pytest
from sqlalchemy import select, update
from sqlmodel import Session

from app_support import ROOT, child_env, molt, serve, web_thread
from conftest import freeze, wait_until
from daemon.db import set_run
from daemon.models import Event, Metric, Run, Sweep
from daemon.records import Records
from daemon.sweep_records import RUNS_PER_TICK
from daemon.sweep_tick import tick_sweeps
from daemon.sweeps import SweepInvalid, SweepRequest, check, suggest

TOKEN = "sweep-faults-token"
BASE = {"env": "max_digit", "loop": {"steps": 4, "groups_per_step": 2, "group_size": 4, "eval_every": 0}}
GRID = {"name": "lr", "config": BASE, "params": {"algo.lr": {"values": [1e-3, 3e-3]}}}


def request(**fields) -> SweepRequest:
    return SweepRequest.model_validate({**GRID, **fields})


def all_slots(_session) -> int:
    return 8


def end(records: Records, run_id: int, status: str, values: list[float] = (), first_step: int = 1):
    """A run's eval_reward values at consecutive steps, as its worker would have written them, then its status."""
    with Session(records.engine) as s:
        for i, value in enumerate(values):
            s.add(Metric(run_id=run_id, name="eval_reward", step=first_step + i, value=value))
        set_run(s, run_id, None, status=status, step=first_step + len(values))
        s.commit()


def test_runs_stopped_by_a_daemon_shutdown_never_finish_their_sweep_and_resume_inside_it(tmp_path):
    """The rule behind `molt daemon stop` and Ctrl-C of `molt serve`: a run in the shutdown's list that ended
    `stopped` leaves its sweep running; once it runs again and ends for its own reasons the sweep completes. A run
    stopped by the user still counts as ended."""
    records = Records(tmp_path)
    grid = records.queue_sweep(request(name="grid"))
    tick_sweeps(records.engine, all_slots)
    runs = [r["id"] for r in records.get_sweep(grid["id"])["runs"]]
    end(records, runs[0], "completed", [0.5])
    end(records, runs[1], "stopped", [0.1])
    shutdown = {runs[1]}
    tick_sweeps(records.engine, all_slots, shutdown)
    assert records.get_sweep(grid["id"])["status"] == "running"
    # the next daemon resumes them: they run again inside their sweeps and end for their own reasons
    end(records, runs[1], "completed", [0.9], first_step=2)
    tick_sweeps(records.engine, all_slots)
    done = records.get_sweep(grid["id"])
    assert done["status"] == "completed" and done["best"]["score"] == pytest.approx(0.9)
    # a run the user stopped counts as ended: its sweep completes
    user = records.queue_sweep(request(name="user"))
    tick_sweeps(records.engine, all_slots)
    for run in records.get_sweep(user["id"])["runs"]:
        end(records, run["id"], "stopped", [0.3])
    tick_sweeps(records.engine, all_slots, shutdown)
    assert records.get_sweep(user["id"])["status"] == "completed"


TRAIN = {"env": "max_digit", "loop": {"steps": 12, "groups_per_step": 2, "group_size": 4, "eval_every": 6,
                                      "eval_episodes": 8}, "warm_start": {"steps": 2}, "checkpoint": {"every": 0}}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["molt daemon stop", "ctrl-c of molt serve"])
def test_a_graceful_daemon_stop_mid_sweep_leaves_it_running_and_it_completes_after_the_restart(tmp_path, how):
    """Both points train when the daemon is stopped gracefully: their runs checkpoint and end `stopped`, the sweep
    stays running; the next daemon resumes them inside it and the sweep completes with both points scored. The
    workers are held (SIGSTOP) from before the stop until it is requested, so that it lands midway on any machine."""
    home = tmp_path / "home"
    records = Records(home)
    with serve(home, "--concurrency", "2") as served:
        answer = served.client.post("/api/v1/sweeps", json={"name": "graceful", "config": TRAIN,
                                                            "params": {"algo.lr": {"values": [1e-3, 3e-3]}}})
        assert answer.status_code == 201, answer.text
        sweep_id = answer.json()["id"]
        runs = wait_until(lambda: len(runs := records.list_runs(tag="graceful")) == 2 and all(
            r["status"] == "running" and r["step"] >= 2 and r["pid"] for r in runs) and runs, 300,
                          message="both of the sweep's runs training")
        freeze([run["pid"] for run in runs], home / "molt.db")
        if how == "molt daemon stop":
            stopper = subprocess.Popen(molt("daemon", "stop", "--home", str(home)), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, env=child_env(home), cwd=ROOT)
        else:
            served.proc.send_signal(signal.SIGINT)
            stopper = served.proc
        wait_until(lambda: all(records.get_run(r["id"])["status"] == "stopping" for r in runs), 120,
                   message="the stop requested")
        for run in runs:
            os.killpg(run["pid"], signal.SIGCONT)
        assert stopper.wait(300) == 0, served.output if stopper is served.proc else stopper.stdout.read()
        stopped = records.get_sweep(sweep_id)
        assert {r["status"] for r in stopped["runs"]} == {"stopped"}
        assert all(r["step"] < 12 for r in stopped["runs"]), "stopped midway"
        assert stopped["status"] == "running", "a daemon's shutdown ended the sweep"
        if how == "molt daemon stop":  # serve's keeper starts its daemon again on request
            start = subprocess.run(molt("daemon", "start", "--home", str(home)), capture_output=True, text=True,
                                   timeout=120, env=child_env(home), cwd=ROOT)
            assert start.returncode == 0, start.stdout + start.stderr
            wait_until(lambda: records.get_sweep(sweep_id)["status"] != "running", 600, 0.5,
                       message="the sweep to end")
    if how != "molt daemon stop":
        with serve(home, "--concurrency", "2"):
            wait_until(lambda: records.get_sweep(sweep_id)["status"] != "running", 600, 0.5,
                       message="the sweep to end")
    done = records.get_sweep(sweep_id)
    assert done["status"] == "completed" and len(done["points"]) == 2
    assert {(r["status"], r["step"]) for r in done["runs"]} == {("completed", 12)}
    assert all(p["score"] is not None for p in done["points"])
    for run in done["runs"]:
        assert any(e["kind"] == "resume_requested" for e in records.events(run["id"])), "resumed, not restarted"


def test_one_bad_sweep_fails_alone_saying_why_and_the_others_go_on(tmp_path):
    """Three sweeps that can no longer run, each for a reason the tick used to let escape every poll: a run key
    already taken (IntegrityError), a stored request that no longer validates (an int log range from 0.5: Optuna
    refuses it), a stored request with a field this version does not know. Each fails with its own last_error; the
    sweep queued after them gets its runs; each still reads (no 500 on its page)."""
    records = Records(tmp_path)
    taken = records.queue_sweep(request(name="taken"))
    old_int_log = records.queue_sweep(request(name="int-log"))
    unknown = records.queue_sweep(request(name="unknown"))
    fine = records.queue_sweep(request(name="fine"))
    with Session(records.engine) as s:
        s.add(Run(name="squatter", config=BASE, total_steps=4, idempotency_key=f"sweep:{taken['id']}:1:0"))
        for sweep_id, change in ((old_int_log["id"], {"method": "tpe", "runs": 3, "params": {
                "loop.eval_every": {"min": 0.5, "max": 8, "int": True, "log": True}}}),
                                 (unknown["id"], {"retired_field": 1})):
            sweep = s.get(Sweep, sweep_id)
            sweep.request = {**sweep.request, **change}
            s.add(sweep)
        s.commit()
    tick_sweeps(records.engine, all_slots)
    for sweep, words in ((taken, "IntegrityError"), (old_int_log, "log int range needs min >= 1"),
                         (unknown, "retired_field")):
        failed = records.get_sweep(sweep["id"])
        assert failed["status"] == "failed" and words in failed["last_error"], failed
        assert failed["runs"] == [] and failed["finished_at"] is not None
    assert records.get_sweep(fine["id"])["status"] == "running" and len(records.get_sweep(fine["id"])["runs"]) == 2
    tick_sweeps(records.engine, all_slots)  # the failed ones stay failed, nothing more happens to them
    assert [s["status"] for s in records.list_sweeps()] == ["running", "failed", "failed", "failed"]


def test_the_api_answers_what_optuna_or_seeds_would_refuse_with_a_422_naming_it(tmp_path):
    with web_thread(tmp_path, TOKEN) as (base, _app):
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        int_log = {**GRID, "method": "tpe", "runs": 3,
                   "params": {"loop.eval_every": {"min": 0.5, "max": 8, "int": True, "log": True}}}
        answer = client.post("/api/v1/sweeps", json=int_log)
        assert answer.status_code == 422, answer.text
        (error,) = answer.json()["detail"]
        assert error["loc"][:3] == ["body", "params", "loop.eval_every"] and "min >= 1" in error["msg"], error
        answer = client.post("/api/v1/sweeps", json={**GRID, "seeds": 2, "params": {"seed": {"values": [1, 2]}}})
        assert answer.status_code == 422 and "seed is set by seeds" in answer.text, answer.text
        assert client.get("/api/v1/sweeps").json() == [], "nothing queued"


def test_a_large_grid_creates_its_runs_in_bounded_batches_across_polls(tmp_path):
    """500 runs (250 points, 2 seeds): no poll creates more than RUNS_PER_TICK of them (a poll that created them all
    at once held the daemon's tick past its hang limit), every one is created in the end, each once, and the sweep
    completes only once all exist and ended."""
    records = Records(tmp_path)
    big = records.queue_sweep(request(name="big", seeds=2, params={
        "algo.lr": {"values": [1e-4 * (i + 1) for i in range(25)]}, "loop.group_size": {"values": list(range(2, 12))}}))
    counts = [0]
    while counts[-1] < 500:
        tick_sweeps(records.engine, all_slots)
        with Session(records.engine) as s:
            counts.append(len(s.scalars(select(Run.id).where(Run.sweep_id == big["id"])).all()))
        assert counts[-1] - counts[-2] <= RUNS_PER_TICK, counts
        assert counts[-1] > counts[-2], f"no progress: {counts}"
        assert records.get_sweep(big["id"])["status"] == "running"
    assert len(counts) - 1 >= 500 // RUNS_PER_TICK
    with Session(records.engine) as s:
        keys = s.scalars(select(Run.idempotency_key).where(Run.sweep_id == big["id"])).all()
        assert len(keys) == len(set(keys)) == 500
        s.execute(update(Run).where(Run.sweep_id == big["id"]).values(status="completed"))
        s.commit()
    tick_sweeps(records.engine, all_slots)
    assert records.get_sweep(big["id"])["status"] == "completed"


def test_tpe_proposes_only_integers_the_check_validated():
    """An int range's ends are rounded by every method and by the check: TPE no longer truncates 1.6 to 1 (a value
    never validated); its draws stay within round(min)..round(max)."""
    tpe = request(method="tpe", runs=40, params={"loop.group_size": {"min": 1.6, "max": 4.4, "int": True}})
    check(tpe)
    done = []
    for _ in range(40):
        point = suggest(tpe, done)
        done.append((point, float(point["loop.group_size"])))
    assert {p["loop.group_size"] for p, _ in done} <= {2, 3, 4}


def test_tpe_startup_points_sets_how_many_points_are_random_before_tpe():
    """`startup_points` (Optuna's n_startup_trials, default 10): with 3, TPE models the scores from the 4th point on,
    and its points 4 to 10 lie closer to the best end of the range (1e-2) than the same points of a sweep that keeps
    the default, still random there."""
    space = {"algo.lr": {"min": 1e-5, "max": 1e-2, "log": True}}
    distances = {}
    for startup in (3, 10):
        tpe = request(method="tpe", runs=10, seed=3, startup_points=startup, params=space)
        done = []
        for _ in range(10):
            point = suggest(tpe, done)
            done.append((point, -abs(math.log10(point["algo.lr"]) + 2)))
        distances[startup] = [-value for _, value in done]
    assert statistics.median(distances[3][3:]) < statistics.median(distances[10][3:]) / 2, distances
    assert SweepRequest.model_fields["startup_points"].default == 10
    with pytest.raises(ValueError, match="startup_points"):
        request(method="tpe", runs=3, startup_points=0)


def test_a_metric_no_run_records_is_warned_about_in_events_and_on_the_sweep(tmp_path):
    """metric: a typo gives no scores. Once a run completed with none recorded, an event says so (once) and the
    sweep's page and API show it; it disappears once a run records the metric."""
    records = Records(tmp_path)
    typo = records.queue_sweep(request(name="typo", metric="eval_rewrad"))
    tick_sweeps(records.engine, all_slots)
    runs = [r["id"] for r in records.get_sweep(typo["id"])["runs"]]
    assert records.get_sweep(typo["id"])["warning"] is None, "nothing ended yet: no warning"
    end(records, runs[0], "completed", [0.4, 0.5])
    tick_sweeps(records.engine, all_slots)
    tick_sweeps(records.engine, all_slots)
    with Session(records.engine) as s:
        events = s.scalars(select(Event.message).where(Event.kind == "sweep_metric_missing")).all()
    assert len(events) == 1 and "'eval_rewrad'" in events[0] and "eval_reward" in events[0], events
    assert records.get_sweep(typo["id"])["warning"] == events[0]
    with web_thread(tmp_path, TOKEN) as (base, _app):
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert client.get(f"/api/v1/sweeps/{typo['id']}").json()["warning"] == events[0]
        page = client.get(f"/sweeps/{typo['id']}")
        assert page.status_code == 200 and 'id="sweep-warning"' in page.text and "eval_rewrad" in page.text
    with Session(records.engine) as s:
        s.add(Metric(run_id=runs[1], name="eval_rewrad", step=0, value=0.1))
        s.commit()
    assert records.get_sweep(typo["id"])["warning"] is None
