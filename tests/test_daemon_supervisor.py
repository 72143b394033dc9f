"""The daemon end to end: real daemon and worker processes, real signals, a real SQLite file (acceptance A-F)."""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from conftest import wait_until
from daemon.records import Records

ROOT = Path(__file__).resolve().parent.parent
FAST = {"env": "max_digit", "loop": {"steps": 30, "groups_per_step": 4, "group_size": 4, "eval_every": 0},
        "warm_start": {"steps": 5}, "checkpoint": {"every": 5}}
START = 60  # seconds a worker may take to reach its first steps (imports take ~5 s alone on an idle machine)


def config(steps: int, **sections) -> dict:
    cfg = json.loads(json.dumps(FAST))
    cfg["loop"]["steps"] = steps
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


class Studio:
    """A data directory with daemons started on it, and a census of its worker processes taken every 50 ms."""

    def __init__(self, home: Path):
        self.home, self.api = home, Records(home)
        self.daemons: list[subprocess.Popen] = []
        self.max_workers: Counter = Counter()    # per run: most worker processes ever seen alive at once
        self.max_total = 0
        self._stop = threading.Event()
        self._census = threading.Thread(target=self._count, daemon=True)
        self._census.start()

    def start_daemon(self, *args: str) -> subprocess.Popen:
        log = open(self.home / "daemon.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "daemon", "--home", str(self.home), "--poll", "0.2",
                                 "--backoff", "0.2", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.daemons.append(proc)
        return proc

    def workers(self) -> dict[int, int]:
        """Live worker processes of this data directory: pid -> run id. Zombies (dead) are not counted, nor are
        children that a worker forks for a moment (a library running a helper program): they have the worker's
        command line until they exec, but a worker leads its own session and they do not."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                args = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
                if "daemon.worker" not in args or str(self.home) not in args:
                    continue
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] == "Z" or stat[3] != entry:  # state, session id
                    continue
            except OSError:
                continue
            found[int(entry)] = int(args[args.index("daemon.worker") + 1])
        return found

    def _count(self):
        while not self._stop.wait(0.05):
            found = self.workers()
            per_run = Counter(found.values())
            for run_id, n in per_run.items():
                if n > self.max_workers[run_id]:
                    self.max_workers[run_id] = n
                    if n > 1:
                        print(f"census: {n} workers of run {run_id}: {found}")
            self.max_total = max(self.max_total, sum(per_run.values()))

    def worker_pid(self, run_id: int) -> int:
        """The pid of the run's current attempt, once it is recorded."""
        return wait_until(lambda: next((a["pid"] for a in reversed(self.api.attempts(run_id))
                                        if a["ended_at"] is None and a["pid"]), None), START, message="a worker pid")

    def wait_step(self, run_id: int, step: int, timeout: float = START + 60):
        return wait_until(lambda: self.api.get_run(run_id)["step"] >= step, timeout, 0.05,
                          message=f"run {run_id} at step {step}")

    def close(self):
        self._stop.set()
        self._census.join()
        for proc in self.daemons:  # only the processes this test started (and their workers), by pid
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for pid in self.workers():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log = self.home / "daemon.log"
        if log.exists():
            print("---- daemon log ----\n" + log.read_text()[-5000:])


@pytest.fixture
def studio(tmp_path):
    s = Studio(tmp_path)
    yield s
    s.close()


def logs(studio: Studio) -> str:
    return "".join(p.read_text(errors="replace") for p in [studio.home / "daemon.log",
                                                            *studio.home.glob("runs/*/attempt-*.log")])


def assert_each_step_once(api: Records, run_id: int, steps: int):
    """The trainer's metrics: exactly one row per (name, step), for every step (the unique index guarantees the
    'at most one'; this checks 'at least one', i.e. nothing was lost to a kill)."""
    rows = api.metrics(run_id)
    per_name = {}
    for r in rows:
        per_name.setdefault(r["name"], []).append(r["step"])
    for name in ("reward_mean", "policy_loss", "version"):
        assert per_name[name] == list(range(steps)), name
    assert len(rows) == len({(r["name"], r["step"]) for r in rows})


def test_crash_and_sigkill_restart_from_the_latest_checkpoint_with_no_lost_or_duplicate_metrics(studio):
    api = studio.api
    run = api.create_run(config(30, drills={"crash_at": [8]}))["id"]  # os._exit(1) at step 8, once
    studio.start_daemon()
    wait_until(lambda: len(api.attempts(run)) == 2, START + 30, message="the restart after the crash")
    studio.wait_step(run, 18)
    pid = studio.worker_pid(run)
    os.kill(pid, signal.SIGKILL)
    final = api.wait_run(run, timeout=120)  # the worker marks the run completed itself, then exits
    wait_until(lambda: api.attempts(run)[-1]["exit_code"] is not None, 30, message="the daemon to see the exit")

    attempts = api.attempts(run)
    print("attempts:", [(a["number"], a["cause"], a["start_step"], a["end_step"]) for a in attempts])
    assert final["status"] == "completed", final["last_error"]
    assert [a["cause"] for a in attempts] == ["exit code 1", "SIGKILL", "completed"]
    assert [a["exit_code"] for a in attempts] == [1, -9, 0] and attempts[1]["signal"] == "SIGKILL"
    assert attempts[1]["pid"] == pid
    assert attempts[1]["start_step"] == 5, "resumed from the step-5 checkpoint, before the crash at step 8"
    assert attempts[2]["start_step"] % 5 == 0 and 15 <= attempts[2]["start_step"] <= attempts[1]["end_step"]
    assert (final["restarts"], final["step"], final["version"], final["pid"]) == (2, 30, 30, None)
    assert_each_step_once(api, run, 30)
    assert [v["version"] for v in api.policy_versions(run)] == list(range(1, 31))
    assert api.checkpoints(run)[-1]["step"] == 30
    # one per unplanned end; whether the tiny policy's rewards ever all tie (no_signal) depends on what it samples
    assert [a["kind"] for a in api.alerts(run) if a["kind"] != "no_signal"] == ["worker", "worker"]
    for a in attempts:
        assert f"attempt {a['number']}" in Path(a["log_path"]).read_text()
    for earlier, later in zip(attempts, attempts[1:]):
        assert earlier["ended_at"] <= later["started_at"]
    assert studio.max_workers[run] == 1


def test_hung_worker_is_killed_and_restarted_within_the_heartbeat_timeout(studio):
    api, timeout = studio.api, 8
    run = api.create_run(config(20, drills={"hang_at": [6]}))["id"]  # blocks the event loop at step 6, once
    studio.start_daemon("--heartbeat-timeout", str(timeout))
    final = api.wait_run(run, timeout=START + 120)

    first, second = api.attempts(run)
    restart_after = second["started_at"] - first["heartbeat_at"]
    print(f"hang: last heartbeat -> restart {restart_after:.1f}s (timeout {timeout}s)")
    assert final["status"] == "completed", final["last_error"]
    assert (first["cause"], first["signal"]) == ("hang", "SIGKILL")
    assert first["end_step"] == 6
    assert restart_after <= timeout + 5
    assert "hang" in final["last_error"]
    assert_each_step_once(api, run, 20)


def test_daemon_killed_then_restarted_adopts_or_resumes_and_never_runs_two_workers(studio):
    api = studio.api
    run = api.create_run(config(40))["id"]
    daemon = studio.start_daemon()
    studio.wait_step(run, 5)
    worker = studio.worker_pid(run)
    daemon.kill()  # SIGKILL: no chance to clean up
    daemon.wait()
    assert worker in studio.workers(), "the worker outlives its daemon"

    daemon = studio.start_daemon()
    wait_until(lambda: any(e["kind"] == "adopted" for e in api.events(run)), 30, message="adoption")
    studio.wait_step(run, 20)
    assert api.get_run(run)["pid"] == worker and len(api.attempts(run)) == 1, "adopted, not started again"

    daemon.kill()  # and now the worker dies too while no daemon watches
    daemon.wait()
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: worker not in studio.workers(), 10, message="the worker gone")
    studio.start_daemon()
    final = api.wait_run(run, timeout=START + 60)

    attempts = api.attempts(run)
    print("attempts:", [(a["number"], a["cause"], a["start_step"], a["end_step"]) for a in attempts])
    assert final["status"] == "completed", final["last_error"]
    assert len(attempts) == 2
    assert attempts[0]["cause"].startswith("lost") and attempts[1]["cause"] == "completed"
    assert attempts[1]["start_step"] >= 15
    assert_each_step_once(api, run, 40)
    assert studio.max_workers[run] == 1


@pytest.mark.slow  # ~30 s end to end: runs in CI with the slow tests
def test_past_max_restarts_the_run_fails_with_the_last_cause(studio):
    api = studio.api
    crashing = api.create_run(config(20, drills={"crash_at": [3], "crash_repeat": True}), max_restarts=2)["id"]
    raising = api.create_run(config(20, drills={"env_error_rate": 1.0}), max_restarts=0)["id"]
    studio.start_daemon("--concurrency", "2")
    crashed, raised = api.wait_run(crashing, timeout=START + 120), api.wait_run(raising, timeout=START + 60)

    attempts = api.attempts(crashing)
    assert crashed["status"] == "failed"
    assert [a["cause"] for a in attempts] == ["exit code 1"] * 3, "max_restarts=2: three attempts"
    assert crashed["restarts"] == 2 and crashed["last_error"].startswith("exit code 1")
    assert crashed["finished_at"] and crashed["pid"] is None
    assert "used up" in api.alerts(crashing)[-1]["message"]

    (attempt,) = api.attempts(raising)
    assert raised["status"] == "failed" and attempt["outcome"] == "error"
    assert attempt["cause"].startswith("EnvFailure: ") and attempt["exit_code"] == 1
    assert "Traceback" in attempt["error"] and "drill: injected env error" in attempt["error"]
    assert raised["last_error"].startswith("EnvFailure: ")


@pytest.mark.slow  # ~30 s end to end: runs in CI with the slow tests
def test_stop_then_resume_continues_from_the_stop_checkpoint(studio):
    api = studio.api
    run = api.create_run(config(40))["id"]
    studio.start_daemon()
    studio.wait_step(run, 8)
    requested = time.time()
    assert api.stop_run(run)["status"] == "stopping"
    stopped = api.wait_run(run, timeout=60)
    stop_seconds = stopped["finished_at"] - requested
    stop_step = stopped["step"]
    print(f"stop: stopped {stop_seconds:.1f}s after the request, at step {stop_step}")
    assert stopped["status"] == "stopped" and 8 <= stop_step < 40
    assert api.attempts(run)[0]["cause"] == "stopped"
    assert api.checkpoints(run)[-1]["step"] == stop_step, "the worker checkpointed where it stopped"

    assert api.resume_run(run)["status"] == "queued"
    final = api.wait_run(run, timeout=START + 60)
    first, second = api.attempts(run)
    assert final["status"] == "completed", final["last_error"]
    assert second["start_step"] == stop_step
    assert final["restarts"] == 0 and final["step"] == 40
    assert_each_step_once(api, run, 40)
    assert any(e["kind"] == "resumed" and e["step"] == stop_step for e in api.events(run))


@pytest.mark.slow  # ~30 s end to end: runs in CI with the slow tests
def test_three_runs_in_parallel_share_the_database_without_lock_errors(studio):
    api = studio.api
    runs = [api.create_run(config(30), name=f"parallel-{i}")["id"] for i in range(3)]
    queued = api.create_run(config(30), name="waits")["id"]
    api.stop_run(queued)  # a queued run stops at once and never starts
    studio.start_daemon("--concurrency", "3")
    finals = [api.wait_run(r, timeout=START + 120) for r in runs]

    assert [f["status"] for f in finals] == ["completed"] * 3, [f["last_error"] for f in finals]
    assert studio.max_total == 3, "the three trained at the same time"
    assert "database is locked" not in logs(studio) and "database write failed" not in logs(studio)
    for r in runs:
        assert_each_step_once(api, r, 30)
        assert len(api.attempts(r)) == 1
    assert api.get_run(queued)["status"] == "stopped" and api.attempts(queued) == []


@pytest.mark.slow
def test_acceptance_a_300_steps_with_5_sigkills_completes_and_learns(studio):
    """A: the default max_digit setup, 300 steps, the worker SIGKILLed 5 times at random steps."""
    api, rng = studio.api, random.Random(int(os.environ.get("MOLT_TEST_SEED", "4")))
    kills = sorted(rng.sample(range(20, 280), 5))
    run = api.create_run({"env": "max_digit", "loop": {"steps": 300, "eval_every": 0},
                          "checkpoint": {"every": 10}})["id"]
    studio.start_daemon()
    t0 = time.time()
    for target in kills:
        studio.wait_step(run, target, timeout=600)
        os.kill(studio.worker_pid(run), signal.SIGKILL)
        wait_until(lambda: len(api.attempts(run)) > kills.index(target) + 1, 60, message="the restart")
    final = api.wait_run(run, timeout=900)

    attempts = api.attempts(run)
    rewards = [r["value"] for r in api.metrics(run, names=["reward_mean"])]
    print(f"A: kills at steps {kills}; attempts {[(a['cause'], a['start_step'], a['end_step']) for a in attempts]}; "
          f"{time.time() - t0:.0f}s; reward of the last 10 steps {sum(rewards[-10:]) / 10:.3f}")
    assert final["status"] == "completed", final["last_error"]
    assert [a["cause"] for a in attempts] == ["SIGKILL"] * 5 + ["completed"]
    assert_each_step_once(api, run, 300)
    assert sum(rewards[-10:]) / 10 >= 0.9
    assert studio.max_workers[run] == 1
