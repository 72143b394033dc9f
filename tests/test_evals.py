"""Evaluations as jobs: pass@k against a hand computation, the REST API's 422s, the daemon supervising their workers
(hung, stopped, adopted by a new daemon: real processes and signals), and (slow) a trained run's checkpoints evaluated
through `molt eval`, with a worker SIGKILLed mid-evaluation."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlmodel import Session

from app_support import ROOT, child_env, molt, serve
from conftest import freeze, wait_until
from daemon import eval_jobs, eval_records, supervisor
from daemon.db import eval_dir, run_dir, set_run
from daemon.eval_records import ENDED, EvalRequest, get_eval, queue_eval, stop_eval
from daemon.models import Sample
from daemon.records import Records
from daemon.sink import DbSink
from molt_engine import checkpoint
from molt_engine.scores import pass_at_k, scores


def test_pass_at_k_is_the_unbiased_estimator_on_a_hand_computed_table():
    # (n samples, c passed, k) -> 1 - C(n-c, k) / C(n, k), worked out by hand
    table = [(4, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 2, 1, 0.5), (4, 4, 1, 1.0),
             (4, 1, 2, 1 - 3 / 6), (4, 2, 2, 1 - 1 / 6), (4, 3, 2, 1.0), (4, 1, 4, 1.0), (4, 0, 4, 0.0),
             (5, 2, 3, 1 - 1 / 10), (10, 3, 5, 1 - 21 / 252), (8, 1, 4, 1 - 35 / 70)]
    for n, c, k, expected in table:
        assert pass_at_k(n, c, k) == pytest.approx(expected), (n, c, k)
    # per prompt, then averaged: prompt A passes 1 of 4 (reward 1 each pass), prompt B 3 of 4, prompt C none
    prompts = [[(1.0, True), (0.0, False), (0.0, False), (0.0, False)],
               [(1.0, True), (1.0, True), (0.5, False), (1.0, True)],
               [(0.0, False)] * 4]
    got = scores(prompts, 2)
    assert got["pass@1"] == pytest.approx((0.25 + 0.75 + 0.0) / 3)
    assert got["pass@2"] == pytest.approx(((1 - 3 / 6) + 1.0 + 0.0) / 3)
    assert got["avg@2"] == pytest.approx((0.25 + 3.5 / 4 + 0.0) / 3)
    assert got["mean_reward"] == pytest.approx(4.5 / 12)
    # its standard error clustered by prompt: the prompts' means 0.25, 0.875, 0 around 0.375 deviate by -0.125,
    # 0.5, -0.375 (squares 0.40625 in all), over 3 - 1, over 3 prompts (12 independent episodes would say 0.139)
    assert got["mean_reward_se"] == pytest.approx((0.40625 / 2 / 3) ** 0.5)
    assert scores([[(1.0, True)], [(0.0, False)], [(0.5, False)]], 1)["mean_reward_se"] == pytest.approx(
        ((0.25 + 0.25 + 0) / 2 / 3) ** 0.5)  # one sample a prompt: the plain standard error of the mean


def fake_checkpoints(home: Path, run_id: int, steps: list[int]):
    """Complete checkpoint directories as the engine leaves them (a state.pt marks one whole), for the 422 checks."""
    for step in steps:
        path = run_dir(home, run_id) / "checkpoints" / f"step-{step:06d}"
        (path / "policy").mkdir(parents=True)
        (path / "state.pt").write_bytes(b"")


def test_bad_requests_are_422_naming_the_field_and_listing_filters(tmp_path):
    with serve(tmp_path) as studio:
        client = studio.client
        run = studio.create({"env": "max_digit", "loop": {"steps": 1}}, name="never-started")
        client.post(f"/api/v1/runs/{run['id']}/stop")
        other = studio.create({"env": "max_digit", "loop": {"steps": 1}}, name="with-checkpoints")
        client.post(f"/api/v1/runs/{other['id']}/stop")
        fake_checkpoints(tmp_path, other["id"], [5, 10])

        def invalid(body: dict, field: str, words: str):
            response = client.post("/api/v1/evals", json=body)
            assert response.status_code == 422, response.text
            detail = response.json()["detail"]
            assert detail[0]["loc"][:2] == ["body", field], detail
            assert words in detail[0]["msg"], detail

        invalid({"run_id": other["id"], "checkpoint": 7}, "checkpoint", "no checkpoint at step 7; it has 5, 10")
        invalid({"run_id": run["id"], "checkpoint": "latest"}, "checkpoint", "has no checkpoints")
        invalid({"run_id": run["id"], "checkpoint": "best"}, "checkpoint", "no best policy")
        invalid({"run_id": run["id"], "checkpoint": "newest"}, "checkpoint", 'must be "best"')
        invalid({"run_id": 999}, "run_id", "no run 999")
        invalid({"run_id": other["id"], "checkpoint": 5, "episodes": 4, "k": 8}, "k", "more than episodes")
        invalid({"run_id": other["id"], "checkpoint": 5, "episodes": 6, "k": 4}, "episodes", "multiple of k")
        invalid({"run_id": other["id"], "checkpoint": 5, "episodes": 8, "k": 4, "temperature": 0.0}, "k",
                "k (4) needs a temperature above 0: at temperature 0")  # pass@4 would be pass@1
        invalid({"run_id": other["id"], "checkpoint": 5, "env": "no_such_env"}, "env", "unknown env 'no_such_env'")
        invalid({"model": {"preset": "huge"}, "env": "max_digit"}, "model", "unknown preset")
        invalid({"model": {"preset": "tiny-dense"}}, "env", "give env")
        invalid({"run_id": other["id"], "model": {"preset": "tiny-dense"}}, "run_id", "not both")
        assert client.post("/api/v1/evals", json={"run_id": other["id"], "k": "4"}).status_code == 422  # strict
        assert client.get("/api/v1/evals/12345").status_code == 404
        assert client.get("/api/v1/evals", params={"run_id": other["id"]}).json() == []
        assert client.get("/api/v1/evals", params={"run_idd": 1}).status_code == 422

        # a valid one is queued (201) and listed under its run; stopped while queued, it is stopped at once. "latest"
        # is the checkpoint the `latest` pointer names (as resume takes it; the worker points it back to the
        # records), not the highest step
        root = run_dir(tmp_path, other["id"]) / "checkpoints"
        checkpoint.point_latest(root, root / "step-000005")
        created = client.post("/api/v1/evals", json={"run_id": other["id"], "checkpoint": "latest", "episodes": 8,
                                                     "k": 2, "temperature": 1.0})
        assert created.status_code == 201, created.text
        evaluation = created.json()
        assert evaluation["step"] == 5 and evaluation["config"]["env"] == "max_digit"
        assert evaluation["policy_path"] == str(root / "step-000005" / "policy")
        assert [e["id"] for e in client.get("/api/v1/evals", params={"run_id": other["id"]}).json()] == \
            [evaluation["id"]]
        stopped = client.post(f"/api/v1/evals/{evaluation['id']}/stop")
        # the daemon may have started it meanwhile: then it is stopping until its worker is gone
        assert stopped.status_code == 202 and stopped.json()["status"] in ("stopped", "stopping")
        final = client.get(f"/api/v1/evals/{evaluation['id']}/wait", params={"timeout": 60}).json()
        assert final["status"] == "stopped"
        assert client.post(f"/api/v1/evals/{evaluation['id']}/stop").status_code == 409

        # the Evaluations page lists it, and its form (the run page's Evaluate) names a bad field on the form
        page = client.get("/evals", params={"run_id": other["id"]})
        assert page.status_code == 200 and f'id="eval-{evaluation["id"]}"' in page.text and "stopped" in page.text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        form = {"run_id": other["id"], "checkpoint": "7", "episodes": 8, "k": 2, "temperature": 1, "csrf_token": csrf}
        refused = client.post("/evals", data=form, headers={"Origin": studio.base})
        assert refused.status_code == 422 and "checkpoint: run" in refused.text and "at step 7" in refused.text
        queued = client.post("/evals", data={**form, "checkpoint": "5"}, headers={"Origin": studio.base})
        assert queued.status_code == 303 and queued.headers["location"] == f"/evals?run_id={other['id']}"
        listed = client.get("/api/v1/evals", params={"run_id": other["id"]}).json()
        assert [e["step"] for e in listed] == [5, 5]  # at step 5 (the form), and "latest" above
        client.post(f"/api/v1/evals/{listed[0]['id']}/stop")  # its checkpoint is an empty stand-in: never run it
        # k 2 with the temperature left empty samples at the run's own temperature, as `molt eval --k 2` does
        blank = client.post("/evals", data={**form, "checkpoint": "5", "temperature": ""}, headers={"Origin": studio.base})
        assert blank.status_code == 303, blank.text
        newest = max(client.get("/api/v1/evals", params={"run_id": other["id"]}).json(), key=lambda e: e["id"])
        assert newest["config"]["k"] == 2 and newest["config"]["temperature"] == other["config"]["loop"]["temperature"] > 0
        client.post(f"/api/v1/evals/{newest['id']}/stop")
        table = client.get("/evals.csv", params={"run_id": other["id"]}).text.splitlines()
        assert table[0].startswith("id,run_id,checkpoint,step,env,episodes,k,temperature,status") and len(table) == 4
        assert f'href="/evals?run_id={other["id"]}"' in client.get(f"/runs/{other['id']}").text  # Evaluate…


TRAIN = {"env": "max_digit", "seed": 0, "warm_start": {"steps": 150},
         "loop": {"steps": 4, "groups_per_step": 8, "group_size": 4, "eval_every": 2, "eval_episodes": 32},
         "checkpoint": {"every": 1, "keep": 10}}


def trained_with_checkpoints(home: Path) -> int:
    """A max_digit run trained in this process into the data directory (checkpoints, best/, final/), completed."""
    from molt_engine import train
    records = Records(home)
    run = records.create_run(TRAIN, name="trained")
    sink = DbSink(records.engine, run["id"], 0)
    try:
        summary = train(TRAIN, sink, out_dir=run_dir(records.home, run["id"]))
    finally:
        sink.close()
    with records.engine.begin() as conn:
        set_run(conn, run["id"], status="completed", summary=summary)
    return run["id"]


def molt_eval(studio, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(molt("eval", "--url", studio.base, "--token", studio.token, *args), cwd=ROOT,
                          env=child_env(studio.home), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_trained_runs_best_scores_high_its_initial_policy_low_and_a_killed_worker_records_each_episode_once(
        tmp_path):
    run_id = trained_with_checkpoints(tmp_path)
    with serve(tmp_path) as studio:
        # the best checkpoint, greedy, through the CLI with a threshold it meets: exit 0 and the metrics as JSON
        best = molt_eval(studio, "--run", str(run_id), "--checkpoint", "best", "--env", "max_digit",
                         "--episodes", "32", "--k", "1", "--wait", "--min", "pass@1=0.9", "--min", "mean_reward=0.9")
        assert best.returncode == 0, best.stdout + best.stderr
        metrics = json.loads(best.stdout)
        print("best:", metrics)
        assert metrics["pass@1"] >= 0.9 and metrics["mean_reward"] >= 0.9 and metrics["episodes"] == 32
        # the run's step-0 policy (the preset from the run's seed, before any training) is far lower: exit 6
        initial = molt_eval(studio, "--model", json.dumps({"preset": "tiny-dense"}), "--env", "max_digit",
                            "--seed", "0", "--episodes", "16", "--k", "4", "--temperature", "1.0",
                            "--min", "pass@1=0.9")
        assert initial.returncode == 6, initial.stdout + initial.stderr
        low = json.loads(initial.stdout)
        print("initial:", low)
        assert low["pass@1"] <= metrics["pass@1"] - 0.5 and "below threshold: pass@1" in initial.stderr
        assert {"pass@4", "avg@4", "mean_reward"} <= set(low)

        # a worker SIGKILLed mid-evaluation: the daemon restarts it, and every episode is recorded exactly once
        client = studio.client
        evaluation = client.post("/api/v1/evals", json={"run_id": run_id, "checkpoint": 2, "episodes": 256, "k": 4,
                                                        "temperature": 1.0}).json()
        eval_id = evaluation["id"]
        running = wait_until(lambda: (e := client.get(f"/api/v1/evals/{eval_id}").json())["done"] >= 16 and e,
                             300, 0.05, message="16 episodes recorded")
        assert running["done"] < 256, "finished before the kill: make it longer"
        os.killpg(running["pid"], signal.SIGKILL)
        final = wait_until(lambda: (e := client.get(f"/api/v1/evals/{eval_id}/wait", params={"timeout": 30}).json())
                           ["status"] in ("completed", "failed", "stopped") and e, 600, message="the evaluation's end")
        assert final["status"] == "completed", final
        assert final["restarts"] == 1 and "SIGKILL" in final["last_error"]
        assert final["metrics"]["episodes"] == 256 and 0 <= final["metrics"]["pass@4"] <= 1
        assert final["metrics"]["pass@1"] <= final["metrics"]["pass@4"]
        # its episodes are the run's samples of kind "evaluation" at step = the evaluation's id (the samples view)
        page = client.get(f"/api/v1/runs/{run_id}/samples", params={"kind": "evaluation", "step": eval_id,
                                                                     "limit": 500}).json()
        assert page["total"] == 256
        assert sorted(s["position"] for s in page["samples"]) == list(range(256))
        assert all(s["kind"] == "evaluation" and s["step"] == eval_id for s in page["samples"])
        assert [e["id"] for e in client.get("/api/v1/evals", params={"run_id": run_id}).json()][0] == eval_id


# ---- supervising evaluation workers: a run whose best/ is the tiny preset, evaluated by real daemons -----------------

def run_with_a_policy(records: Records) -> int:
    """A completed run whose best/ policy is the tiny preset as built from seed 0 (saved as a checkpoint is)."""
    from molt_engine.config import RunConfig
    from molt_engine.models import load_policy
    config = {"env": "max_digit", "loop": {"steps": 1}}
    run = records.create_run(config, name="policy")
    model, tokenizer = load_policy(RunConfig.model_validate(config).model, 0)
    model.save_pretrained(run_dir(records.home, run["id"]) / "best")
    tokenizer.save_pretrained(run_dir(records.home, run["id"]) / "best")
    with records.engine.begin() as conn:  # before any daemon starts: never trained
        set_run(conn, run["id"], status="completed", summary={"best_step": 0})
    return run["id"]


def start_daemon(home: Path, *args: str) -> subprocess.Popen:
    with open(home / "daemon.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "daemon", "--home", str(home), "--poll", "0.2", *args],
                                cwd=ROOT, env=child_env(home), stdout=log, stderr=subprocess.STDOUT)


def recorded(records: Records, eval_id: int) -> list[int]:
    """The positions of the evaluation's episodes recorded as samples, sorted (a position twice would show)."""
    with Session(records.engine) as s:
        return sorted(s.scalars(select(Sample.position).where(Sample.kind == "evaluation", Sample.step == eval_id)))


def ended(records: Records, eval_id: int, timeout: float = 300) -> dict:
    return wait_until(lambda: (e := get_eval(records.engine, eval_id))["status"] in ENDED and e, timeout, 0.1,
                      message=f"the end of evaluation {eval_id}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture
def policy(tmp_path):
    records = Records(tmp_path)
    return records, run_with_a_policy(records)


def queue(records: Records, run_id: int, **fields) -> int:
    request = EvalRequest(run_id=run_id, temperature=1.0, **fields)
    return queue_eval(records.engine, records.home, request)["id"]


def test_an_eval_worker_that_never_beats_is_killed_as_hung(policy, monkeypatch):
    records, run_id = policy
    monkeypatch.setattr(eval_jobs, "FIRST_BEAT_S", 3.0)  # the daemon runs in this process: its first-beat limit
    eval_id = queue(records, run_id, episodes=4, max_restarts=0)
    sup = supervisor.Supervisor(records.home, heartbeat_timeout=1.0, poll=0.1, gpus=[])
    stop = threading.Event()
    thread = threading.Thread(target=sup.run, args=(stop,), daemon=True)
    thread.start()
    try:
        pid = wait_until(lambda: get_eval(records.engine, eval_id)["pid"], 60, 0.01, message="the worker's start")
        os.killpg(pid, signal.SIGSTOP)  # still importing: it never gets to load the policy and beat
        final = ended(records, eval_id, 60)
    finally:
        stop.set()
        thread.join(30)
    assert not (eval_dir(records.home, eval_id) / "heartbeat").exists(), "it did beat: stopped too late"
    assert final["status"] == "failed" and final["last_error"].startswith("worker hang: no first heartbeat in ")
    assert final["pid"] is None and not alive(pid)


def test_a_hung_eval_worker_is_killed_and_restarted_and_each_episode_recorded_once(policy):
    records, run_id = policy
    daemon = start_daemon(records.home, "--heartbeat-timeout", "5")
    try:
        eval_id = queue(records, run_id, episodes=128, k=4)
        running = wait_until(lambda: (e := get_eval(records.engine, eval_id))["done"] >= 8 and e, 300, 0.05,
                             message="8 episodes recorded")
        freeze([running["pid"]], records.home / "molt.db")  # hung: alive, holding its lock, but no longer beating
        final = ended(records, eval_id)
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert running["done"] < 128, "finished before the hang: make it longer"
    assert final["status"] == "completed", final
    assert final["restarts"] == 1 and final["last_error"].startswith("worker hang: no progress for "), final
    assert not alive(running["pid"])
    assert final["metrics"]["episodes"] == 128 and final["done"] == 128
    assert recorded(records, eval_id) == list(range(128))


def test_stopping_a_running_eval_ends_its_worker_with_its_records_consistent(policy):
    records, run_id = policy
    daemon = start_daemon(records.home)
    try:
        eval_id = queue(records, run_id, episodes=256, k=4)
        running = wait_until(lambda: (e := get_eval(records.engine, eval_id))["done"] >= 8 and e, 300, 0.05,
                             message="8 episodes recorded")
        assert stop_eval(records.engine, eval_id)
        final = ended(records, eval_id, 60)
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert final["status"] == "stopped" and final["finished_at"] and final["pid"] is None, final
    assert 8 <= final["done"] < 256 and final["metrics"] is None and final["restarts"] == 0
    assert not alive(running["pid"])
    with Session(records.engine) as s:
        from daemon.models import EvalResult
        done = sorted(s.scalars(select(EvalResult.position).where(EvalResult.eval_id == eval_id)))
    assert recorded(records, eval_id) == done, "every finished episode has its sample, and no other"
    assert not stop_eval(records.engine, eval_id)


def test_a_running_eval_is_adopted_by_a_new_daemon_after_a_sigkill(policy):
    records, run_id = policy
    daemon = start_daemon(records.home)
    eval_id = queue(records, run_id, episodes=256, k=4)
    running = wait_until(lambda: (e := get_eval(records.engine, eval_id))["done"] >= 8 and e, 300, 0.05,
                         message="8 episodes recorded")
    freeze([running["pid"]], records.home / "molt.db")  # held still while the daemons change: the next one finds it running
    daemon.kill()  # no chance to clean up
    daemon.wait(30)
    assert alive(running["pid"]), "the worker outlives its daemon"
    paused = get_eval(records.engine, eval_id)
    assert paused["status"] == "running" and paused["done"] < 256, paused
    daemon = start_daemon(records.home)
    try:
        wait_until(lambda: records.daemon_status()["pid"] == daemon.pid, 60, message="the new daemon")
        os.killpg(running["pid"], signal.SIGCONT)
        final = ended(records, eval_id)
    finally:
        daemon.terminate()
        daemon.wait(30)
    log = (eval_dir(records.home, eval_id) / "worker.log").read_text()
    assert final["status"] == "completed" and final["restarts"] == 0, final
    assert log.count("episodes already recorded") == 1, "adopted, never started again"
    assert final["metrics"]["episodes"] == 256 and recorded(records, eval_id) == list(range(256))


def test_a_model_sections_evaluation_records_its_episodes_and_the_samples_view_opens_on_them(policy):
    import httpx

    from app_support import web_thread
    records, run_id = policy
    request = EvalRequest(model={"preset": "tiny-dense"}, env="max_digit", episodes=16, k=4, temperature=1.0)
    model_eval = queue_eval(records.engine, records.home, request)["id"]
    run_eval = queue(records, run_id, episodes=8, k=2)
    daemon = start_daemon(records.home)
    try:
        finals = [ended(records, model_eval), ended(records, run_eval)]
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert [f["status"] for f in finals] == ["completed", "completed"], finals
    with Session(records.engine) as s:
        from daemon.models import EvalResult
        passes = sum(s.scalars(select(EvalResult.success).where(EvalResult.eval_id == model_eval)))
    with web_thread(records.home, "t0ken") as (base, _), \
            httpx.Client(base_url=base, headers={"Authorization": "Bearer t0ken"}) as client:
        api = f"/api/v1/evals/{model_eval}"
        page = client.get(f"{api}/samples", params={"limit": 500, "order": "newest"}).json()
        assert page["total"] == 16 and sorted(s["position"] for s in page["samples"]) == list(range(16))
        assert all((s["run_id"], s["kind"], s["step"]) == (0, "evaluation", model_eval) for s in page["samples"])
        assert all(s["tokens"] and s["prompt"] for s in page["samples"])
        assert client.get(f"{api}/samples", params={"passed": True}).json()["total"] == passes  # the filters apply
        first = client.get(f"{api}/samples", params={"limit": 10}).json()
        rest = client.get(f"{api}/samples", params={"limit": 10, "cursor": first["next_cursor"]}).json()
        assert len(first["samples"]) + len(rest["samples"]) == 16 and rest["next_cursor"] is None
        assert client.get(f"{api}/samples/steps").json() == [{"step": model_eval, "kind": "evaluation", "count": 16}]
        assert len(client.get(f"{api}/samples.jsonl").text.splitlines()) == 16
        assert client.get("/api/v1/evals/999/samples").status_code == 404
        # the samples view: a model section's on its own API, a run's evaluation on its run's samples at its step
        view = client.get(f"/evals/{model_eval}/samples")
        assert view.status_code == 200 and f'"api": "{api}"' in view.text and f"evaluation #{model_eval}" in view.text
        moved = client.get(f"/evals/{run_eval}/samples", follow_redirects=False)
        assert moved.headers["location"] == f"/runs/{run_id}/samples?kind=evaluation&step={run_eval}"
        assert client.get(f"/api/v1/evals/{run_eval}/samples").json()["total"] == 8
        listing = client.get("/evals").text
        assert f'href="/evals/{model_eval}/samples"' in listing and f'href="/evals/{run_eval}/samples"' in listing


def test_the_throughput_bench_measures_a_job_and_the_in_run_eval_on_the_same_episodes(monkeypatch):
    import runpy

    from daemon import evals
    monkeypatch.setattr(evals, "CONCURRENT_EPISODES", evals.CONCURRENT_EPISODES)  # --in-flight sets it: put it back
    bench = runpy.run_path(str(ROOT / "bench" / "evals.py"))  # a script, not a package: its functions by name
    result = bench["main"](["--episodes", "8", "--repeats", "1", "--in-flight", "4"])
    assert result["episodes"] == 8 and result["in_flight"] == 4 and len(result["load"]) == 3
    assert result["job"] > 0 and result["in_run"] > 0 and result["job_episodes"] >= result["job"]
    assert result["ratio"] == pytest.approx(result["job"] / result["in_run"])


def test_an_evaluations_samples_survive_its_runs_keep_steps(tmp_path):
    from daemon.sink import write_records
    records = Records(tmp_path)
    run_id = run_with_a_policy(records)
    episode = {"group": 0, "seed": 0, "version": 0, "reward": 1.0, "advantage": 0.0, "success": True, "turns": 1,
               "tool_calls": 0, "tool_errors": 0, "prompt": "p", "text": "p a", "tokens": {}, "images": []}
    evaluation = queue(records, run_id, episodes=4)  # its samples as its worker writes them: step = its id
    with records.engine.begin() as conn:
        conn.execute(Sample.__table__.insert(), [
            {**{k: v for k, v in episode.items() if k not in ("group", "advantage")}, "group_id": 0, "position": i,
             "run_id": run_id, "eval_id": evaluation, "step": evaluation, "kind": "evaluation", "time": 0.0}
            for i in range(4)])
        for step in range(evaluation, evaluation + 10):  # the run trains on, keeping its last 2 steps' samples
            write_records(conn, run_id, 0, [{"t": "samples", "step": step, "kind": "train", "keep": 2, "time": 0.0,
                                             "records": [episode]}])
    with Session(records.engine) as s:
        kept = s.execute(select(Sample.kind, Sample.step).where(Sample.run_id == run_id)).all()
    assert sorted(kept) == [("evaluation", evaluation)] * 4 + [("train", evaluation + 8), ("train", evaluation + 9)]


def test_an_agent_envs_evaluation_completes(tmp_path):
    records = Records(tmp_path)  # its episodes' requests need the loopback server a run starts, the worker too
    request = EvalRequest(model={"preset": "tiny-chat"}, env="calculator_agent", episodes=4, max_restarts=0)
    eval_id = queue_eval(records.engine, records.home, request)["id"]
    daemon = start_daemon(records.home)
    try:
        final = ended(records, eval_id, 240)
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert final["status"] == "completed", final
    assert final["metrics"]["episodes"] == 4 and final["metrics"]["errors"] == 0, final
    with Session(eval_records.samples_db(eval_dir(records.home, eval_id))) as s:
        assert sorted(s.scalars(select(Sample.position).where(Sample.eval_id == eval_id))) == [0, 1, 2, 3]


STALLED_ENV = """
import asyncio
from molt_engine import Env, register

@register
class StalledEnv(Env):
    name = "test_stalled_eval"

    async def reset(self, seed):
        await asyncio.Event().wait()  # what never comes; the worker's event loop goes on

    async def step(self, action):
        raise AssertionError("never reached")
"""


def test_an_eval_worker_whose_episodes_make_no_progress_ends_as_hung(tmp_path, monkeypatch):
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "stalled.py").write_text(STALLED_ENV)
    monkeypatch.setenv("MOLT_ENVS", str(tmp_path / "envs"))  # here (the request is checked) and in the daemon
    records = Records(tmp_path / "home")
    request = EvalRequest(model={"preset": "tiny-dense"}, env="test_stalled_eval", episodes=2, max_restarts=0)
    eval_id = queue_eval(records.engine, records.home, request)["id"]
    daemon = start_daemon(records.home, "--heartbeat-timeout", "3")
    try:
        final = ended(records, eval_id, 120)
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert final["status"] == "failed" and final["last_error"].startswith("worker hang: no progress for "), final
    beat = (eval_dir(records.home, eval_id) / "heartbeat").read_text()
    assert beat == "0 tokens sampled, 0 episodes recorded", "it beat once, loaded, and never progressed"


def test_a_lora_runs_steps_are_evaluated_as_its_adapter_on_its_base(tmp_path):
    from molt_engine import train
    records = Records(tmp_path)
    config = {"env": "max_digit", "model": {"lora": {"r": 8}}, "warm_start": {"steps": 2}, "algo": {"lr": 3e-3},
              "loop": {"steps": 2, "groups_per_step": 2, "group_size": 4, "eval_every": 0}, "checkpoint": {"every": 2}}
    run_id = records.create_run(config, name="lora")["id"]
    train(config, out_dir=run_dir(records.home, run_id))  # its step checkpoints hold the adapter alone
    with records.engine.begin() as conn:
        set_run(conn, run_id, status="completed", summary={"step": 2})
    assert not (run_dir(records.home, run_id) / "checkpoints" / "step-000002" / "policy" / "config.json").exists()
    evals = [queue_eval(records.engine, records.home, EvalRequest(run_id=run_id, checkpoint=checkpoint, episodes=8,
                                                                  max_restarts=0))["id"]
             for checkpoint in ("latest", "final")]  # greedy: the same policy gives the same episodes
    daemon = start_daemon(records.home)
    try:
        finals = [ended(records, eval_id) for eval_id in evals]
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert [(f["status"], f["step"], f["restarts"]) for f in finals] == [("completed", 2, 0)] * 2, finals
    with Session(records.engine) as s:
        texts = [s.scalars(select(Sample.text).where(Sample.eval_id == e).order_by(Sample.position)).all()
                 for e in evals]
    assert len(texts[0]) == 8 and texts[0] == texts[1], "step 2's adapter on its base is the merged final policy"


def test_deleting_a_run_ends_its_evaluations_workers_and_removes_their_files(policy):
    records, run_id = policy
    daemon = start_daemon(records.home, "--concurrency", "2")
    try:
        done = queue(records, run_id, episodes=4)
        live = queue(records, run_id, episodes=4096)
        assert ended(records, done)["status"] == "completed"
        running = wait_until(lambda: (e := get_eval(records.engine, live))["done"] >= 8 and e, 300, 0.05,
                             message="8 episodes recorded")
        records.delete_run(run_id)
        wait_until(lambda: not alive(running["pid"]), 60, 0.05, message="the deleted evaluation's worker ended")
        wait_until(lambda: not eval_dir(records.home, live).exists(), 60, 0.05, message="its files removed")
        assert daemon.poll() is None
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert get_eval(records.engine, live) is None and not eval_dir(records.home, done).exists()
    assert "Traceback" not in (records.home / "daemon.log").read_text(), "the daemon read the deleted evaluation"
    with Session(records.engine) as s:
        assert s.scalars(select(Sample.id).where(Sample.run_id == run_id)).all() == []


def migrated_from(tmp_path, revision: str, *statements: str):
    """A database made at an earlier `revision`, with `statements` run in it, then brought up to date."""
    from alembic import command

    from daemon.db import alembic_config, sqlite_engine, upgrade
    engine = sqlite_engine(f"sqlite:///{tmp_path / 'molt.db'}")
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), revision)
        for statement in statements:
            conn.exec_driver_sql(statement)
    upgrade(engine, tmp_path)
    return engine


def test_the_migration_gives_earlier_evaluations_their_samples(tmp_path):
    engine = migrated_from(  # samples recorded before they had eval_id
        tmp_path, "0008_external_runs",
        "INSERT INTO run (id, name, status, config, tags, step, total_steps, version, restarts, retries, max_restarts, "
        "created_at) VALUES (1, 'r', 'completed', '{}', '[]', 0, 0, 0, 0, 0, 3, 0)",
        "INSERT INTO sample (run_id, step, kind, position, group_id, seed, version, success, turns, tool_calls, "
        "tool_errors, prompt, text, tokens, images, time) VALUES "
        "(1, 7, 'evaluation', 0, 0, 0, 0, 1, 1, 0, 0, '', '', '{}', '[]', 0), "
        "(1, 7, 'train', 0, 0, 0, 0, 1, 1, 0, 0, '', '', '{}', '[]', 0)")
    with engine.connect() as conn:
        assert sorted(conn.exec_driver_sql("SELECT kind, eval_id FROM sample")) == [("evaluation", 7), ("train", None)]


def test_an_evaluations_results_cost_linear_writes_and_read_back_as_its_samples(tmp_path):
    """Each episode's result is a row appended as it ends (issue 64, item 9): 4x the episodes write about 4x the
    bytes (the whole results JSON rewritten per episode wrote 16x), and every episode's row matches its sample."""
    import asyncio

    from sqlalchemy import event

    from daemon.evals import evaluate
    from daemon.models import EvalResult
    records = Records(tmp_path)
    written = []
    event.listen(records.engine, "before_cursor_execute",  # what the worker sends to the evaluation's records
                 lambda conn, cursor, statement, parameters, *_: written.append(
                     len(statement) + len(repr(parameters)) if "eval" in statement.split("(")[0].lower() else 0))

    def bytes_written(episodes: int) -> tuple[int, int]:
        request = EvalRequest(model={"preset": "tiny-dense"}, env="max_digit", episodes=episodes)
        eval_id = queue_eval(records.engine, records.home, request)["id"]
        eval_dir(records.home, eval_id).mkdir(parents=True)  # as the worker's main makes it, started as the daemon does
        with records.engine.begin() as conn:
            conn.exec_driver_sql("UPDATE evaluation SET status = 'running' WHERE id = ?", (eval_id,))
        written.clear()
        asyncio.run(evaluate(records.engine, eval_id, eval_dir(records.home, eval_id)))
        return sum(written), eval_id

    small, _ = bytes_written(12)
    large, eval_id = bytes_written(48)
    print(f"bytes written to the evaluation's records: 12 episodes {small}, 48 episodes {large}")
    assert large < 6 * small, (small, large)
    with Session(records.engine) as s:
        rows = {r.position: (r.reward, r.success) for r in s.scalars(select(EvalResult)
                                                                       .where(EvalResult.eval_id == eval_id))}
    with Session(eval_records.samples_db(eval_dir(records.home, eval_id))) as s:
        samples = {p: (r, ok) for p, r, ok in s.execute(select(Sample.position, Sample.reward, Sample.success)
                                                         .where(Sample.eval_id == eval_id))}
    assert sorted(rows) == list(range(48)) and rows == samples
    final = get_eval(records.engine, eval_id)
    assert final["done"] == 48 and final["metrics"]["episodes"] == 48
    assert final["metrics"]["mean_reward"] == pytest.approx(sum(r for r, _ in rows.values()) / 48)


def test_the_migration_moves_earlier_results_to_their_rows(tmp_path):
    engine = migrated_from(  # results as one JSON per evaluation
        tmp_path, "0011_sweeps",
        "INSERT INTO evaluation (id, config, status, results, restarts, max_restarts, created_at) VALUES (3, '{}', "
        "'running', '{\"0\": [1.0, true, {\"len\": 2}, null], \"1\": [0.0, false, {}, \"ValueError: x\"]}', 0, 3, 0)")
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT position, reward, success, metrics, error FROM eval_result "
                                    "WHERE eval_id = 3 ORDER BY position").all()
    assert [tuple(r) for r in rows] == [(0, 1.0, 1, '{"len":2}', None), (1, 0.0, 0, "{}", "ValueError: x")]
    assert get_eval(engine, 3)["done"] == 2


def test_molt_eval_with_k_and_no_temperature_samples_at_the_runs_own_and_says_so(tmp_path):
    """`molt eval --k 4` with the temperature left out (issue 64, item 10) is queued at the run's loop.temperature,
    as it was before k > 1 at temperature 0 was refused; only an explicit 0 is refused (422, exit 2)."""
    from app_support import web_thread
    records = Records(tmp_path)
    run = records.create_run({"env": "max_digit", "loop": {"steps": 1, "temperature": 0.7}}, name="warm")
    (run_dir(tmp_path, run["id"]) / "best").mkdir(parents=True)
    (run_dir(tmp_path, run["id"]) / "best" / "config.json").write_text("{}")  # a policy's files, never loaded here
    with records.engine.begin() as conn:
        set_run(conn, run["id"], status="completed", summary={"best_step": 1})
    with web_thread(tmp_path, "eval-token") as (base, _app):
        studio = type("Studio", (), {"base": base, "token": "eval-token", "home": tmp_path})
        queued = molt_eval(studio, "--run", str(run["id"]), "--k", "4", "--episodes", "8")
        assert queued.returncode == 0, queued.stderr
        assert "--k 4 without --temperature: sampling at the run's temperature 0.7" in queued.stderr
        assert json.loads(queued.stdout)["config"]["temperature"] == 0.7
        greedy = molt_eval(studio, "--run", str(run["id"]), "--episodes", "8")  # k 1: greedy, as before
        assert greedy.returncode == 0 and json.loads(greedy.stdout)["config"]["temperature"] == 0.0
        refused = molt_eval(studio, "--run", str(run["id"]), "--k", "4", "--episodes", "8", "--temperature", "0")
        assert refused.returncode == 2 and "k (4) needs a temperature above 0" in refused.stderr
