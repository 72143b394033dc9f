"""Sweeps: the space (grid, seeded random, TPE), validation (422 naming the key), scoring by the mean over seeds, the
median early-stopping rule, and the daemon's sweep tick against a real SQLite file (idempotent across daemons)."""
import json
import math
import os
import random
import signal
import statistics
import subprocess

import httpx
import pytest
from sqlalchemy import select
from sqlmodel import Session

from app_support import child_env, molt, serve, web_thread
from conftest import wait_until
from daemon.db import lock_holder, set_run
from daemon.models import Event, Metric, Run
from daemon.records import Records
from daemon.sweep_tick import tick_sweeps
from daemon.sweeps import (RUN_NAME_MAX, SweepInvalid, SweepRequest, behind_median, check, run_names, score,
                           suggest)

TOKEN = "sweep-test-token"
BASE = {"env": "max_digit", "loop": {"steps": 4, "groups_per_step": 2, "group_size": 4, "eval_every": 0}}
GRID = {"name": "lr-x-group", "config": BASE, "seeds": 2,
        "params": {"algo.lr": {"values": [1e-3, 3e-3]}, "loop.group_size": {"values": [2, 4]}}}


def request(**fields) -> SweepRequest:
    return SweepRequest.model_validate({**GRID, **fields})


def all_slots(_session) -> int:
    return 8


def record(records: Records, run_id: int, values: list[float], status: str = "completed", first_step: int = 1):
    """A run's eval_reward values at consecutive steps from the first after training (the eval at step 0 is the
    untrained policy), as its worker would have written them, then its status."""
    with Session(records.engine) as s:
        for i, v in enumerate(values):
            s.add(Metric(run_id=run_id, name="eval_reward", step=first_step + i, value=v))
        set_run(s, run_id, None, status=status, step=first_step + len(values))
        s.commit()


def test_grid_expands_every_combination_and_validates_each():
    points = check(request())
    assert sorted((p["algo.lr"], p["loop.group_size"]) for p in points) == [(1e-3, 2), (1e-3, 4), (3e-3, 2),
                                                                           (3e-3, 4)]


def test_a_random_sweep_with_a_fixed_seed_samples_the_same_points():
    space = {"algo.lr": {"min": 1e-4, "max": 1e-2, "log": True}, "loop.group_size": {"min": 2, "max": 8, "int": True},
             "algo.estimator": {"values": ["grpo", "rloo"]}}
    first = check(request(method="random", runs=6, seed=7, params=space))
    assert first == check(request(method="random", runs=6, seed=7, params=space))
    assert first != check(request(method="random", runs=6, seed=8, params=space))
    assert all(1e-4 <= p["algo.lr"] <= 1e-2 and isinstance(p["loop.group_size"], int) for p in first)


@pytest.mark.parametrize("params, key, words", [
    ({"algo.learning_rate": {"values": [0.1]}}, "algo.learning_rate", "Extra inputs"),
    ({"algo.lr": {"values": [-1.0]}}, "algo.lr", "-1.0"),
    ({"loop.group_size": {"values": [1, 4]}}, "loop.group_size", "loop.group_size=1"),
])
def test_a_bad_space_is_refused_naming_the_key_and_value(params, key, words):
    with pytest.raises(SweepInvalid) as e:
        check(request(params=params))
    assert e.value.loc == ("params", key) and words in str(e.value)


def test_scores_follow_the_rule_and_goal():
    values = [0.2, None, 0.9, 0.5, float("nan"), 0.4]
    assert score(values, "best", "max") == 0.9 and score(values, "best", "min") == 0.2
    assert score(values, "last", "max") == 0.4
    assert score(values, "mean", "max", last_n=2) == pytest.approx(0.45)
    assert score([None], "best", "max") is None


def test_the_median_rule_never_stops_the_best():
    rng = random.Random(0)
    for _ in range(200):
        values = [rng.uniform(-1, 1) for _ in range(rng.randint(2, 6))]
        for goal, best in (("max", max(values)), ("min", min(values))):
            i = values.index(best)
            assert behind_median(best, values[:i] + values[i + 1:], goal) is None
    assert behind_median(0.1, [0.5, 0.6, 0.9], "max") == 0.6
    assert behind_median(0.55, [0.5, 0.6, 0.9], "max", margin=0.1) is None


def test_a_2x2_grid_with_2_seeds_runs_8_runs_and_names_the_best_mean(tmp_path):
    records = Records(tmp_path)
    sweep = records.queue_sweep(request())
    tick_sweeps(records.engine, all_slots)
    runs = records.get_sweep(sweep["id"])["runs"]
    assert len(runs) == 8 and {r["status"] for r in runs} == {"queued"}
    for row in runs:  # ordinary runs: the point's params and seed in their config, the sweep's name as their tag
        run = records.get_run(row["id"])
        assert run["config"]["algo"]["lr"] == row["params"]["algo.lr"] and run["config"]["seed"] == row["seed"]
        assert run["tags"] == ["lr-x-group"] and run["sweep_id"] == sweep["id"]
    # a second daemon on the same file (a restart) creates none again
    tick_sweeps(Records(tmp_path).engine, all_slots)
    assert len(records.list_runs(tag="lr-x-group")) == 8

    rng = random.Random(3)
    written = {r["id"]: [rng.random() for _ in range(5)] for r in runs}
    for run_id, values in written.items():
        record(records, run_id, values)
    tick_sweeps(records.engine, all_slots)
    done = records.get_sweep(sweep["id"])
    means = {}
    for r in runs:  # the expected best, from what each run recorded: its best value, averaged over its seeds
        means.setdefault(r["sweep_point"], []).append(max(written[r["id"]]))
    best_point = max(means, key=lambda p: statistics.fmean(means[p]))
    assert done["status"] == "completed" and done["runs_done"] == 8
    assert done["best"]["point"] == best_point
    assert done["best"]["score"] == pytest.approx(statistics.fmean(means[best_point]))
    assert [p["score"] for p in done["points"]] == sorted((statistics.fmean(v) for v in means.values()), reverse=True)


def test_early_stopping_stops_a_run_clearly_behind_and_never_the_best(tmp_path):
    records = Records(tmp_path)
    sweep = records.queue_sweep(request(seeds=1, early_stop={"rule": "median", "at_steps": [3]}))
    tick_sweeps(records.engine, all_slots)
    runs = [r["id"] for r in records.get_sweep(sweep["id"])["runs"]]
    levels = dict(zip(runs, (0.9, 0.5, 0.4, 0.1)))
    for run_id, level in levels.items():  # all running, past step 3
        record(records, run_id, [level] * 4, status="running")
    tick_sweeps(records.engine, all_slots)
    status = {run_id: records.get_run(run_id)["status"] for run_id in runs}
    best = max(levels, key=levels.get)
    assert status[best] == "running"
    # each is compared with the median of the other three: 0.4 and 0.1 are behind theirs (0.5 and 0.5)
    assert [run_id for run_id in runs if status[run_id] == "stopping"] == [r for r in runs if levels[r] < 0.5]
    with Session(records.engine) as s:
        why = s.scalars(select(Event.message).where(Event.kind == "early_stopped")).all()
    assert len(why) == 2 and all("median" in m and "step 3" in m for m in why)
    tick_sweeps(records.engine, all_slots)  # judged once: nothing more happens
    with Session(records.engine) as s:
        assert len(s.scalars(select(Event.id).where(Event.kind == "early_stopped")).all()) == 2


def test_the_eval_at_step_0_before_training_is_not_a_score_unless_asked(tmp_path):
    """score best of eval_reward counted the eval of the untrained policy: a run that never learned scored its warm
    start (0.84), as high as one that learned. Step 0 is left out by default; score_untrained counts it."""
    records = Records(tmp_path)
    for untrained in (False, True):
        sweep = records.queue_sweep(request(name=f"untrained-{untrained}", seeds=1, score_untrained=untrained))
        tick_sweeps(records.engine, all_slots)
        runs = [r["id"] for r in records.get_sweep(sweep["id"])["runs"]]
        for run_id, learned in zip(runs, (0.9, 0.3, 0.2, 0.1)):
            record(records, run_id, [0.84, 0.1, learned], first_step=0)
        tick_sweeps(records.engine, all_slots)
        done = records.get_sweep(sweep["id"])
        scores = {r["id"]: r["score"] for r in done["runs"]}
        if untrained:
            assert scores == {runs[0]: 0.9, runs[1]: 0.84, runs[2]: 0.84, runs[3]: 0.84}
        else:
            assert scores == {runs[0]: 0.9, runs[1]: 0.3, runs[2]: 0.2, runs[3]: 0.1}
            assert done["best"]["point"] == next(r["sweep_point"] for r in done["runs"] if r["id"] == runs[0])


def test_tpe_asks_for_the_next_point_as_runs_end_across_daemon_restarts(tmp_path):
    records = Records(tmp_path)
    sweep = records.queue_sweep(request(method="tpe", runs=3, seeds=1, seed=5,
                                        params={"algo.lr": {"min": 1e-4, "max": 1e-2, "log": True}}))
    for n in range(3):
        daemon = Records(tmp_path)  # a fresh daemon each time: its state is the database's
        tick_sweeps(daemon.engine, all_slots)
        tick_sweeps(daemon.engine, all_slots)  # its run is queued: no new point yet
        runs = records.get_sweep(sweep["id"])["runs"]
        assert len(runs) == n + 1
        record(records, next(r["id"] for r in runs if r["status"] == "queued"), [0.5 + n / 10])
    tick_sweeps(records.engine, all_slots)
    done = records.get_sweep(sweep["id"])
    with Session(records.engine) as s:
        keys = s.scalars(select(Run.idempotency_key).where(Run.sweep_id == sweep["id"])).all()
    assert done["status"] == "completed" and len(keys) == len(set(keys)) == 3
    assert len({p["params"]["algo.lr"] for p in done["points"]}) == 3


def test_stop_resume_and_delete_apply_to_the_runs(tmp_path):
    records = Records(tmp_path)
    sweep = records.queue_sweep(request(seeds=1))
    tick_sweeps(records.engine, all_slots)
    stopped = records.stop_sweep(sweep["id"])
    assert stopped["status"] == "stopped" and {r["status"] for r in stopped["runs"]} == {"stopped"}
    resumed = records.resume_sweep(sweep["id"])
    assert resumed["status"] == "running" and {r["status"] for r in resumed["runs"]} == {"queued"}
    records.stop_sweep(sweep["id"])
    records.delete_sweep(sweep["id"])
    assert records.list_runs(tag="lr-x-group") == [] and records.list_sweeps() == []


def test_the_api_refuses_bad_spaces_with_422_naming_the_key(tmp_path):
    with web_thread(tmp_path, TOKEN) as (base, _app):
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        for params, key in (({"algo.nope": {"values": [1]}}, "algo.nope"), ({"algo.lr": {"values": [0.0]}}, "algo.lr"),
                            ({"algo.lr": {"min": 0.1, "max": 0.01}}, "algo.lr")):
            answer = client.post("/api/v1/sweeps", json={**GRID, "params": params})
            assert answer.status_code == 422, answer.text
            assert answer.json()["detail"][0]["loc"][:3] == ["body", "params", key], answer.text
        created = client.post("/api/v1/sweeps", json=GRID)
        assert created.status_code == 201 and created.json()["status"] == "running"
        sweep_id = created.json()["id"]
        assert client.get("/api/v1/sweeps").json()[0]["id"] == sweep_id
        assert client.get(f"/api/v1/sweeps/{sweep_id}").json()["points"][0]["params"] == {"algo.lr": 1e-3,
                                                                                         "loop.group_size": 2}
        assert client.post(f"/api/v1/sweeps/{sweep_id}/stop").json()["status"] == "stopped"
        assert client.get("/api/v1/sweeps/99").status_code == 404


def test_a_sweeps_runs_are_named_by_their_values_in_the_api(tmp_path):
    """Issue 67 item 6: names like `lr-x-group-p0-s0` hid the values; the key is its last part where unambiguous, a
    float has 3 significant digits (3e-4, not 0.00030000000000000003), and names stay short and distinct."""
    with web_thread(tmp_path, TOKEN) as (base, app):
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        params = {"algo.lr": {"values": [0.1 * 0.003, 9.999999999999999e-05]}, "loop.group_size": {"values": [4]}}
        sweep_id = client.post("/api/v1/sweeps", json={**GRID, "name": "lr-ux", "params": params}).json()["id"]
        tick_sweeps(app.state.records.engine, all_slots)
        names = {r["name"] for r in client.get(f"/api/v1/sweeps/{sweep_id}").json()["runs"]}
        assert names == {"lr-ux lr=3e-4 group_size=4 s0", "lr-ux lr=3e-4 group_size=4 s1",
                         "lr-ux lr=1e-4 group_size=4 s0", "lr-ux lr=1e-4 group_size=4 s1"}
        assert names <= {r["name"] for r in client.get("/api/v1/runs", params={"tag": "lr-ux"}).json()}
    assert run_names("s", [{"algo.lr": 1.0001e-3, "model.lr": 0.5}, {"algo.lr": 1.0002e-3, "model.lr": 0.5}]) == \
        ["s algo.lr=1e-3 model.lr=0.5 p0", "s algo.lr=1e-3 model.lr=0.5 p1"]  # shared last parts: whole keys
    long = run_names("x" * 64, [{"model.name": "Qwen/Qwen2.5-0.5B-Instruct-with-a-long-suffix"}])[0]
    assert len(long) <= RUN_NAME_MAX - len(" s0000") and long.endswith("…") and " name=Q" in long

@pytest.mark.slow
def test_molt_sweep_runs_a_real_2x2_grid_with_2_seeds_through_a_daemon_killed_midway(tmp_path):
    """8 real runs through `molt serve`'s daemon, which is SIGKILLed once the sweep's first runs train: the keeper's
    next daemon goes on, no point runs twice and none is lost, and `molt sweep --wait` prints the best point."""
    tiny = {"env": "max_digit", "loop": {"steps": 6, "groups_per_step": 2, "eval_every": 3, "eval_episodes": 8},
            "warm_start": {"steps": 2}, "checkpoint": {"every": 3}}
    (tmp_path / "sweep.yaml").write_text(
        "name: e2e\nconfig: " + json.dumps(tiny) + "\nseeds: 2\nscore: last\n"
        "params:\n  algo.lr: {values: [1e-3, 3e-3]}\n  loop.group_size: {values: [2, 4]}\n")
    home = tmp_path / "home"
    with serve(home, "--concurrency", "2") as served:
        cli = subprocess.Popen(molt("sweep", str(tmp_path / "sweep.yaml"), "--url", served.base, "--token",
                                    served.token, "--wait", "--timeout", "900"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(home))
        records = Records(home)
        wait_until(lambda: any(r["status"] == "running" and r["step"] >= 1 for r in records.list_runs(tag="e2e")),
                   300, message="no sweep run trained")
        first = int(lock_holder(home / "daemon.lock").split()[0])
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: (h := lock_holder(home / "daemon.lock")) and int(h.split()[0]) != first, 120,
                   message="no new daemon")
        out, err = cli.communicate(timeout=900)
        assert cli.returncode == 0, err
        best = json.loads(out)
        sweep = records.get_sweep(best["sweep"])
        with Session(records.engine) as s:
            keys = s.scalars(select(Run.idempotency_key).where(Run.sweep_id == sweep["id"])).all()
        assert len(keys) == len(set(keys)) == 8 and {r["status"] for r in sweep["runs"]} == {"completed"}
        assert best["params"] == sweep["best"]["params"] and best["config"]["algo"]["lr"] == best["params"]["algo.lr"]
        means = {}
        for r in sweep["runs"]:  # the best point's score: the mean of its seeds' last eval_reward, from their records
            last = records.metrics(r["id"], ["eval_reward"])[-1]["value"]
            means.setdefault(r["sweep_point"], []).append(last)
        assert sweep["status"] == "completed"
        assert best["score"] == pytest.approx(max(statistics.fmean(v) for v in means.values()))
        assert statistics.fmean(means[sweep["best"]["point"]]) == pytest.approx(best["score"])


def test_tpe_over_one_key_concentrates_near_the_better_end():
    """A synthetic objective of the learning rate alone (best at 1e-2, the top of the range): after Optuna's random
    start-up trials, TPE's points lie closer to it than the start-up's."""
    tpe = request(method="tpe", runs=30, seed=1, params={"algo.lr": {"min": 1e-5, "max": 1e-2, "log": True}})
    done = []
    for _ in range(30):
        point = suggest(tpe, done)
        done.append((point, -abs(math.log10(point["algo.lr"]) + 2)))
    distance = [-value for _, value in done]
    assert statistics.median(distance[-10:]) < statistics.median(distance[:10]) / 2


def test_a_sweep_that_can_no_longer_run_fails_saying_why_without_stopping_the_tick(tmp_path):
    from daemon.models import Sweep
    records = Records(tmp_path)
    broken = records.queue_sweep(request(name="broken", seeds=1))
    fine = records.queue_sweep(request(name="fine", seeds=1))
    with Session(records.engine) as s:  # its env's file removed since it was queued
        sweep = s.get(Sweep, broken["id"])
        sweep.request = {**sweep.request, "config": {**sweep.request["config"], "env": "gone"}}
        s.add(sweep)
        s.commit()
    tick_sweeps(records.engine, all_slots)
    failed = records.get_sweep(broken["id"])
    assert failed["status"] == "failed" and "unknown env 'gone'" in failed["last_error"] and failed["runs"] == []
    assert len(records.get_sweep(fine["id"])["runs"]) == 4
