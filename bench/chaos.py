"""The chaos soak: concurrent runs under a real `molt serve`, random faults from a seeded schedule, and a verdict
computed from the database records (no lost or duplicate steps, every checkpoint loads, every fault recorded).

    python bench/chaos.py --minutes 25 --seed 1 --out summary.json

Faults injected while the storm lasts (each logged with its time and target): SIGKILL of a worker, of one rank of a
2-rank run, of the daemon, and of the whole `molt serve` process group (then served again on the same home);
SIGSTOP/SIGCONT of a worker for less and for more than the heartbeat timeout; a stop and resume through the REST
API; a second writer holding the database locked (BEGIN EXCLUSIVE); SIGKILL of an evaluation job's worker; the
tracker mirror's store taken away for a while (the single-process runs mirror to MLflow and TensorBoard: MLflow's
directory becomes a file, so every write to it fails, then it comes back). Each run is launched with drills from the
same seed: a NaN loss, a gradient spike, env errors, a full disk (ENOSPC) at a checkpoint write and at a database
write. A slot whose run ended gets a new run while the storm lasts, as does a sweep (a grid of 2 points) and an
evaluation job that ended; after it, every run, sweep and evaluation must end `completed`, each sweep with a
completed run for each of its points and seeds, each evaluation with all its episodes."""
import argparse
import json
import os
import random
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from daemon.db import lock_holder  # noqa: E402
from daemon.trackers import tracker_name  # noqa: E402

HEARTBEAT_TIMEOUT_S = 20.0
# breaker.abs_max: a spike trips even when the median rule has too little history (a solved tiny task's gradients
# are zero, which the rule does not count), so that every spike drill leaves its alert
BASE = {"loop": {"groups_per_step": 4, "group_size": 4, "eval_every": 0}, "warm_start": {"steps": 5},
        "checkpoint": {"every": 5, "keep": 3}, "breaker": {"abs_max": 100.0}}
SLOTS = {  # a single-process run, a 2-rank run, a chat run with a tool (the agent path of the engine)
    "single": {"env": "max_digit"},
    "ranks": {"env": "max_digit", "dist": {"nproc": 2, "timeout_s": 60}},
    "chat": {"env": "chat_calculator", "model": {"preset": "tiny-chat"}},
}
STORM = ("worker_kill", "rank_kill", "daemon_kill", "serve_kill", "hang_short", "hang_long", "stop_resume",
         "db_lock", "disk_full", "eval_kill", "tracker_down")
TMPFS_MB = 64  # the single-process runs' directories: room for their checkpoints, until the soak fills it
DRILLS = ("nan", "spike", "env_error", "full_disk_checkpoint", "full_disk_db")
TERMINAL = ("completed", "failed", "stopped", "tripped")


def say(text: str):
    print(f"{time.strftime('%H:%M:%S')} chaos: {text}", flush=True)


class Serve:
    """`molt serve` on the soak's home, leading its own process group (so that the group can be killed whole)."""

    def __init__(self, home: Path):
        env = {**os.environ, "MOLT_HOME": str(home), "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": str(ROOT), "MOLT_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
               "MLFLOW_ALLOW_FILE_STORE": "true"}  # the mirror's MLflow store: a directory of the soak's home
        env.pop("MOLT_TOKEN", None)
        log = open(home / "serve.log", "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--home", str(home), "--port", "0",
                                      "--concurrency", str(len(SLOTS) + 1), "--stop-grace", "60"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                                     start_new_session=True)
        self.lines: list[str] = []

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                log.write(line)
                log.flush()
        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 180
        while not (url := next((l.split("ready: ")[1].strip() for l in list(self.lines) if "ready: http" in l), None)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("molt serve printed no URL:\n" + "".join(self.lines))
            time.sleep(0.1)
        self.client = httpx.Client(base_url=url.split("/?")[0], timeout=60,
                                   headers={"Authorization": f"Bearer {url.split('token=')[1]}"})


class Soak:
    def __init__(self, home: Path, seed: int, minutes: float, steps: int):
        self.home, self.rng, self.minutes, self.steps = home, random.Random(seed), minutes, steps
        self.db = sqlite3.connect(home / "molt.db", timeout=60, check_same_thread=False)
        self.faults: list[dict] = []
        self.slot_runs: dict[str, list[int]] = defaultdict(list)
        self.stopped_by_us: set[int] = set()
        self.sweeps: list[int] = []
        self.evals: list[int] = []
        self.serve: Serve | None = None
        self.mounts: list[Path] = []
        probe = home / "tmpfs-probe"  # a real full disk where the machine lets us mount one
        probe.mkdir(exist_ok=True)
        self.tmpfs = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                                    capture_output=True).returncode == 0
        if self.tmpfs:
            subprocess.run(["umount", str(probe)], check=True)
        probe.rmdir()

    # ---- the records, read directly (the API may be down in the middle of a fault) -----------------------------

    def q(self, sql: str, *args):
        for _ in range(10):
            try:
                return self.db.execute(sql, args).fetchall()
            except sqlite3.OperationalError:  # e.g. the schema is being migrated by a starting serve
                time.sleep(1)
        return self.db.execute(sql, args).fetchall()

    def running(self) -> list[tuple[int, int, str]]:
        """(run id, worker pid, slot) of the runs whose live worker trains (it beats: its start is over)."""
        rows = self.q("SELECT r.id, a.pid, r.name FROM run r JOIN attempt a ON a.run_id = r.id WHERE r.status = "
                      "'running' AND a.ended_at IS NULL AND a.pid IS NOT NULL AND a.heartbeat_at IS NOT NULL")
        return [(run_id, pid, name.split("-")[0]) for run_id, pid, name in rows if alive(pid)]

    def step_of(self, run_id: int) -> int:
        return self.q("SELECT step FROM run WHERE id = ?", run_id)[0][0]

    # ---- runs ---------------------------------------------------------------------------------------------------

    def launch(self, slot: str):
        """A new run in the slot, with drills of this seed at steps past the breaker's warm-up."""
        steps, rng = self.steps, self.rng
        cfg = json.loads(json.dumps({**BASE, **SLOTS[slot]}))
        cfg["loop"]["steps"] = steps
        if slot == "single":  # mirrored to two trackers; "tracker_down" takes MLflow's store away for a while
            cfg["report"] = {"to": ["mlflow", "tensorboard"],
                             "mlflow": {"tracking_uri": f"file:{self.home / 'mlruns'}", "experiment": "chaos"}}
        cfg["seed"] = rng.randrange(1000)
        drills, planned = {}, []
        late = range(12, steps - 5)
        if rng.random() < 0.5:
            drills["nan_at"] = [rng.choice(late)]
            planned.append(("nan", drills["nan_at"][0]))
        if rng.random() < 0.5:
            drills["spike_at"] = [rng.choice(late)]
            planned.append(("spike", drills["spike_at"][0]))
        if rng.random() < 0.5:
            drills["env_error_rate"] = 0.03
            planned.append(("env_error", None))
        if rng.random() < 0.5:
            drills["full_disk_at"] = [rng.choice([s for s in late if s % 5 == 0])]
            planned.append(("full_disk_checkpoint", drills["full_disk_at"][0]))
        if rng.random() < 0.5:
            drills["db_full_disk_at"] = [rng.choice(late)]
            planned.append(("full_disk_db", drills["db_full_disk_at"][0]))
        cfg["drills"] = drills
        name = f"{slot}-{len(self.slot_runs[slot]) + 1}"
        if slot == "single" and self.tmpfs:  # its directory on a small filesystem of its own (the next run id)
            directory = self.home / "runs" / str(self.q("SELECT coalesce(max(id), 0) + 1 FROM run")[0][0])
            directory.mkdir(parents=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(directory)], check=True)
            self.mounts.append(directory)
        run = self.api("post", "/api/v1/runs", json={"config": cfg, "name": name, "max_restarts": 20}).json()
        self.slot_runs[slot].append(run["id"])
        for kind, step in planned:
            self.faults.append({"kind": kind, "time": time.time(), "target": {"run": run["id"], "step": step},
                                "via": "drills"})
        say(f"launched run {run['id']} ({name}), drills {drills}")

    def api(self, method: str, path: str, **kwargs) -> httpx.Response:
        for _ in range(30):  # the serve may be restarting
            try:
                response = getattr(self.serve.client, method)(path, **kwargs)
                if response.status_code < 500:
                    response.raise_for_status()
                    return response
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{method} {path}: no answer")

    def relaunch(self):
        for slot, runs in self.slot_runs.items():
            if self.q("SELECT status FROM run WHERE id = ?", runs[-1])[0][0] in TERMINAL:
                self.launch(slot)
        if not self.sweeps or self.q("SELECT status FROM sweep WHERE id = ?", self.sweeps[-1])[0][0] != "running":
            cfg = json.loads(json.dumps({**BASE, **SLOTS["single"]}))
            cfg["loop"]["steps"] = max(self.steps // 2, 20)
            sweep = self.api("post", "/api/v1/sweeps", json={
                "name": f"sweep-{len(self.sweeps) + 1}", "config": cfg, "params": {"algo.lr": {"values": [1e-3, 3e-3]}},
                "metric": "reward_mean", "max_restarts": 20}).json()
            self.sweeps.append(sweep["id"])
            say(f"launched sweep {sweep['id']} ({sweep['name']})")
        if not self.evals or self.q("SELECT status FROM evaluation WHERE id = ?", self.evals[-1])[0][0] in TERMINAL:
            # a completed run's final policy (eval_every 0: no run has a best one), else a random policy: 32 episodes
            done = self.q("SELECT id FROM run WHERE status = 'completed' AND sweep_id IS NULL ORDER BY id DESC LIMIT 1")
            source = {"run_id": done[0][0], "checkpoint": "final"} if done else \
                {"model": {"preset": "tiny-dense"}, "env": "max_digit"}
            ev = self.api("post", "/api/v1/evals", json={**source, "episodes": 32, "max_restarts": 20}).json()
            self.evals.append(ev["id"])
            say(f"launched evaluation {ev['id']} of {source}")

    # ---- faults -------------------------------------------------------------------------------------------------

    def inject(self, kind: str) -> bool:
        """One fault of `kind`; False if it has no target right now (tried again later)."""
        t, fault = time.time(), {"kind": kind, "time": time.time(), "via": "storm"}
        if kind in ("daemon_kill", "serve_kill", "db_lock"):
            if kind == "daemon_kill":
                holder = lock_holder(self.home / "daemon.lock")
                if not holder or not holder.isdigit():
                    return False
                fault["target"] = {"daemon": int(holder)}
                os.kill(int(holder), signal.SIGKILL)
            elif kind == "serve_kill":
                fault["target"] = {"serve": self.serve.proc.pid, "daemon": lock_holder(self.home / "daemon.lock")}
                os.killpg(self.serve.proc.pid, signal.SIGKILL)
                self.serve.proc.wait()
                self.serve.client.close()
                self.serve = Serve(self.home)
                fault["recovered_s"] = time.time() - t
            else:
                seconds = self.rng.uniform(3, 8)
                fault["target"] = {"database": "molt.db", "seconds": round(seconds, 1)}
                writer = sqlite3.connect(self.home / "molt.db", timeout=60)
                writer.execute("BEGIN EXCLUSIVE")
                time.sleep(seconds)
                writer.rollback()
                writer.close()
            self.faults.append(fault)
            say(f"{kind} {fault['target']}")
            return True
        if kind == "eval_kill":  # an evaluation's worker
            rows = self.q("SELECT id, pid, restarts FROM evaluation WHERE status = 'running' AND pid IS NOT NULL")
            rows = [r for r in rows if alive(r[1])]
            if not rows:
                return False
            eval_id, pid, restarts = self.rng.choice(rows)
            fault["target"] = {"evaluation": eval_id, "worker": pid, "restarts": restarts}
            kill_group(pid, signal.SIGKILL)
            self.faults.append(fault)
            say(f"{kind} {fault['target']}")
            return True
        if kind == "tracker_down":  # every write to MLflow's store fails for a while, then it is back
            store = self.home / "mlruns"
            live = [r for r, _, slot in self.running() if slot == "single"]  # the mirrored runs training now
            if not store.is_dir() or not live:
                return False
            seconds = self.rng.uniform(10, 30)
            fault["target"] = {"tracker": "mlflow", "seconds": round(seconds, 1), "runs": live}
            store.rename(self.home / "mlruns.away")
            store.write_text("the tracker is down\n")
            time.sleep(seconds)
            store.unlink()
            (self.home / "mlruns.away").rename(store)
            self.faults.append(fault)
            say(f"{kind} {fault['target']}")
            return True
        candidates = [c for c in self.running() if kind != "rank_kill" or c[2] == "ranks"]
        if kind == "disk_full":
            candidates = [c for c in candidates if self.home / "runs" / str(c[0]) in self.mounts]
        if kind == "stop_resume":
            candidates = [c for c in candidates if c[0] not in self.stopped_by_us]
        if not candidates:
            return False
        run_id, pid, _ = self.rng.choice(candidates)
        fault["target"] = {"run": run_id, "worker": pid, "step": self.step_of(run_id)}
        if kind == "worker_kill":
            kill_group(pid, signal.SIGKILL)
        elif kind == "rank_kill":
            ranks = children(pid)
            if not ranks:
                return False
            fault["target"]["rank_pid"] = rank = self.rng.choice(ranks)
            os.kill(rank, signal.SIGKILL)
        elif kind in ("hang_short", "hang_long"):
            seconds = HEARTBEAT_TIMEOUT_S * (0.3 if kind == "hang_short" else 1.6)
            fault["target"]["seconds"] = round(seconds, 1)
            stopped = [pid, *children(pid)]
            for p in stopped:
                kill_group(p, signal.SIGSTOP)
            time.sleep(seconds)
            for p in stopped:
                kill_group(p, signal.SIGCONT)
        elif kind == "disk_full":  # fill the run's filesystem until a write of it fails, then free the space
            ballast = self.home / "runs" / str(run_id) / "ballast"
            try:  # a filesystem already full (the run's checkpoints and tracker files filled it) fails the open itself
                with open(ballast, "wb") as f:
                    while True:
                        f.write(b"\0" * 2**20)
                        f.flush()
            except OSError:
                pass
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not self.q(
                    "SELECT 1 FROM attempt WHERE run_id = ? AND ended_at > ?", run_id, fault["time"]):
                time.sleep(0.5)
            ballast.unlink(missing_ok=True)
        else:  # stop_resume: through the REST API, as a user would
            self.stopped_by_us.add(run_id)
            self.api("post", f"/api/v1/runs/{run_id}/stop")
            deadline = time.monotonic() + 180
            while self.q("SELECT status FROM run WHERE id = ?", run_id)[0][0] not in TERMINAL:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            fault["target"]["stopped_as"] = self.q("SELECT status FROM run WHERE id = ?", run_id)[0][0]
            self.api("post", f"/api/v1/runs/{run_id}/resume")
        self.faults.append(fault)
        say(f"{kind} {fault['target']}")
        return True

    def storm(self):
        """Faults at seeded random gaps; every kind once per shuffled round, so that a short soak has each."""
        end = time.monotonic() + self.minutes * 60
        gap = self.minutes * 60 / max(len(STORM), self.minutes * 4)
        queue: list[str] = []
        while time.monotonic() < end:
            if not queue:
                queue = self.rng.sample(STORM, len(STORM))
            due = time.monotonic() + self.rng.uniform(0.5, 1.5) * gap
            while time.monotonic() < min(due, end):
                self.relaunch()
                time.sleep(0.5)
            if time.monotonic() < end:  # a kind with no target now waits at the back of the round
                kind = queue.pop(0)
                if not self.inject(kind):
                    queue.append(kind)

    def drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(status in TERMINAL for (status,) in self.q("SELECT status FROM run")) \
                    and not self.q("SELECT 1 FROM sweep WHERE status = 'running'") \
                    and all(self.q("SELECT status FROM evaluation WHERE id = ?", e)[0][0] in TERMINAL
                            for e in self.evals):
                return True
            time.sleep(1)
        return False


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
        except (OSError, IndexError):
            pass
    return found


def kill_group(pid: int, sig: int):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def soak_processes(home: Path) -> list[int]:
    """Live processes started with the soak's MOLT_HOME (serve, and the daemon, workers and ranks it started)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"MOLT_HOME={home}".encode() in environ and alive(int(entry)):
            found.append(int(entry))
    return found


# ---- the verdict, from the records ------------------------------------------------------------------------------

def verdict(soak: Soak, leftovers: list[int], drained: bool) -> dict:
    q = soak.q
    runs = {r[0]: dict(zip(("id", "name", "status", "step", "total_steps", "restarts", "config"), r))
            for r in q("SELECT id, name, status, step, total_steps, restarts, config FROM run")}
    per_run, lost, duplicates = {}, 0, 0
    for run_id, run in runs.items():
        last = run["total_steps"] if run["status"] == "completed" else run["step"]
        missing = {}
        for name in ("version", "reward_mean", "policy_loss"):
            steps = [s for (s,) in q("SELECT step FROM metric WHERE run_id = ? AND name = ?", run_id, name)]
            missing[name] = sorted(set(range(last)) - set(steps))
            duplicates += len(steps) - len(set(steps))
        run_lost = max(len(m) for m in missing.values())
        lost += run_lost
        attempts = q("SELECT number, pid, cause, start_step, end_step FROM attempt WHERE run_id = ? ORDER BY number",
                     run_id)
        per_run[run_id] = {"name": run["name"], "status": run["status"], "steps": last, "restarts": run["restarts"],
                           "lost_steps": run_lost, "attempts": [dict(zip(("number", "pid", "cause", "start_step",
                                                                          "end_step"), a)) for a in attempts]}
    duplicates += q("SELECT count(*) FROM (SELECT 1 FROM metric GROUP BY run_id, name, step HAVING count(*) > 1)")[0][0]
    not_done = [r for r in runs.values() if r["status"] != "completed"]  # the runs we stopped were resumed
    sweeps_incomplete = []
    for sweep_id, name, status, request in q("SELECT id, name, status, request FROM sweep"):
        request = json.loads(request) if isinstance(request, str) else request
        seeds = request.get("seeds", 1)
        want = len(json.loads(q("SELECT points FROM sweep WHERE id = ?", sweep_id)[0][0])) * \
            (seeds if isinstance(seeds, int) else len(seeds))
        have = q("SELECT count(DISTINCT sweep_point || ':' || json_extract(config, '$.seed')), count(*), "
                 "sum(status = 'completed') FROM run WHERE sweep_id = ?", sweep_id)[0]
        if status != "completed" or have != (want, want, want):
            sweeps_incomplete.append({"id": sweep_id, "name": name, "status": status, "points_x_seeds": want,
                                      "distinct_runs": have[0], "runs": have[1], "completed": have[2]})
    evals = q("SELECT id, status, json_extract(config, '$.episodes'), json_extract(metrics, '$.episodes'), "
              "restarts FROM evaluation")
    evals_incomplete = [{"id": i, "status": st, "episodes": want, "recorded": got} for i, st, want, got, _ in evals
                        if st != "completed" or want != got]
    corrupt, loaded = checkpoints(soak.home, runs)
    evidence = [recorded(q, f, soak.faults, soak.home) for f in soak.faults]
    missing_events = [{"kind": f["kind"], "target": f.get("target")} for f, e in zip(soak.faults, evidence) if not e]
    recovery = defaultdict(list)
    for f in soak.faults:
        if (s := recovery_s(q, f)) is not None:
            recovery[f["kind"]].append(s)
    causes = Counter(re.sub(r"\d+", "N", a["cause"].split(":")[0])[:60] if a["cause"] else "open"
                     for r in per_run.values() for a in r["attempts"])
    return {
        "ok": drained and not not_done and not lost and not duplicates and not corrupt and not missing_events
              and not leftovers and not sweeps_incomplete and not evals_incomplete,
        "faults": dict(Counter(f["kind"] for f in soak.faults)),
        "faults_total": len(soak.faults),
        "runs": len(runs), "runs_not_completed": [{"id": r["id"], "status": r["status"]} for r in not_done],
        "sweeps": len(q("SELECT id FROM sweep")), "sweeps_incomplete": sweeps_incomplete,
        "evals": len(evals), "evals_incomplete": evals_incomplete, "eval_restarts": sum(e[4] for e in evals),
        "restarts": sum(r["restarts"] for r in runs.values()),
        "attempt_causes": dict(causes),
        "lost_steps": lost, "duplicate_rows": duplicates,
        "checkpoints_loaded": loaded, "corrupt_checkpoints": corrupt,
        "faults_without_event": missing_events,
        "recover_s": {k: {"n": len(v), "median": round(statistics.median(v), 1), "max": round(max(v), 1)}
                      for k, v in sorted(recovery.items())},
        "processes_left": len(leftovers),
        "per_run": per_run,
        "fault_log": [{**f, "evidence": e} for f, e in zip(soak.faults, evidence)],
    }


def checkpoints(home: Path, runs: dict) -> tuple[int, int]:
    """Load every checkpoint on disk into a fresh policy of its run's config: (corrupt, loaded)."""
    import torch

    from molt_engine import checkpoint
    from molt_engine.config import RunConfig
    from molt_engine.models import load_policy
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    corrupt = loaded = 0
    for run_id, run in runs.items():
        cfg = RunConfig.model_validate(json.loads(run["config"]) if isinstance(run["config"], str) else run["config"])
        model, _ = load_policy(cfg.model, seed=0)
        for path in sorted((home / "runs" / str(run_id) / "checkpoints").glob("step-*")):
            try:
                state = checkpoint.load(path, model)
                assert state["step"] == checkpoint.step_of(path), f"state step {state['step']}"
                loaded += 1
            except Exception as e:
                corrupt += 1
                say(f"corrupt checkpoint {path}: {type(e).__name__}: {e}")
    return corrupt, loaded


def mlflow_steps(home: Path, q, run_id: int) -> set[int]:
    """The steps of a run's reward_mean in the soak's MLflow store, over every MLflow run of its name (an attempt that
    died before its first step may have opened one of its own)."""
    from mlflow.tracking import MlflowClient
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the soak's store is the workers' file store
    client = MlflowClient(tracking_uri=f"file:{home / 'mlruns'}")
    experiment = client.get_experiment_by_name("chaos")
    name = f"{q('SELECT name FROM run WHERE id = ?', run_id)[0][0]} #{run_id}"
    runs = client.search_runs([experiment.experiment_id], f"attributes.run_name = '{name}'") if experiment else []
    return {m.step for r in runs for m in client.get_metric_history(r.info.run_id, tracker_name("reward_mean"))}


def recorded(q, f: dict, faults: list[dict], home: Path | None = None) -> str | None:
    """The record that a fault left (an attempt's cause, a daemon event, an alert, an event, a metric), or None.
    `faults`: all of the soak's, so that a hang is put down to the last fault that could have caused it."""
    kind, target = f["kind"], f.get("target", {})
    run_id = target.get("run")
    if kind in ("worker_kill", "rank_kill", "hang_long", "hang_short"):
        rows = q("SELECT number, cause, ended_at FROM attempt WHERE run_id = ? AND pid = ?", run_id, target["worker"])
        if kind == "hang_short":  # below the heartbeat timeout: the worker lives on (a later long hang may end it)
            long_hangs = [g["time"] for g in faults if g["kind"] == "hang_long" and g["time"] > f["time"]
                          and g.get("target", {}).get("worker") == target["worker"]]
            soon = min([f["time"] + target["seconds"] + 2 * HEARTBEAT_TIMEOUT_S, *long_hangs])
            return None if any(c and c.startswith("hang") and e < soon for _, c, e in rows) else "no restart: kept"
        want = {"worker_kill": "SIGKILL", "rank_kill": f"pid {target.get('rank_pid')}) killed by SIGKILL",
                "hang_long": "hang"}[kind]
        hits = [f"attempt {n}: {c}" for n, c, _ in rows if c and want in c]
        if not hits and kind == "worker_kill":  # killed while adopted: not our child, so no signal is known
            hits = [f"attempt {n}: {c}" for n, c, _ in rows if c and ("adopted" in c or c.startswith("lost"))]
        # the run's checkpoint drill at this step had already failed the attempt (torchrun was ending its ranks) when
        # the kill landed: the attempt's end is that drill's, rightly, and the kill had nothing left to end
        if not hits and any(g["kind"] == "full_disk_checkpoint" and g["target"]["run"] == run_id
                            and 0 <= g["target"]["step"] - target["step"] <= 2 for g in faults):
            hits = [f"attempt {n}: already ending: {c[:120]}" for n, c, _ in rows if c and "No space left" in c]
        return hits[0] if hits else None
    if kind == "eval_kill":
        rows = q("SELECT restarts FROM evaluation WHERE id = ?", target["evaluation"])
        return f"evaluation restarted ({rows[0][0]} restarts)" if rows and rows[0][0] > target["restarts"] else None
    if kind == "tracker_down":  # each run mirrored then counted what MLflow lost (report/dropped, a tracker event)
        counted = [r for r in target["runs"] if q("SELECT 1 FROM event WHERE run_id = ? AND kind = 'tracker' AND "
                                                 "time >= ? AND message LIKE 'mlflow%'", r, f["time"])
                   or q("SELECT 1 FROM metric WHERE run_id = ? AND name = 'report/dropped' AND value > 0", r)]
        # a run still starting (loading, resuming) while the store was away wrote nothing then: MLflow holds all of
        # its steps, so there was nothing to count
        whole = [r for r in target["runs"] if home and r not in counted and mlflow_steps(home, q, r) ==
                 {s for (s,) in q("SELECT step FROM metric WHERE run_id = ? AND name = 'reward_mean'", r)}]
        return f"runs {counted} counted the records MLflow lost" + (f", runs {whole} lost none" if whole else "") \
            if sorted(counted + whole) == sorted(target["runs"]) else None
    if kind == "disk_full":
        rows = q("SELECT number, cause FROM attempt WHERE run_id = ? AND ended_at > ?", run_id, f["time"])
        return f"attempt {rows[0][0]}: {(rows[0][1] or '')[:120]}" if rows else None
    if kind == "daemon_kill":
        rows = q("SELECT message FROM daemon_event WHERE kind = 'down' AND pid = ?", target["daemon"])
        return rows[0][0] if rows else None
    if kind == "serve_kill":
        return f"served again in {f['recovered_s']:.1f}s; the daemon was adopted or restarted"
    if kind == "db_lock":
        return "absorbed by the busy timeout (no write failed)" if target["seconds"] < 30 else None
    if kind == "stop_resume":
        kinds = {k for (k,) in q("SELECT kind FROM event WHERE run_id = ? AND time >= ?", run_id, f["time"])}
        return "stop_requested, stopped, resume_requested" if {"stop_requested", "stopped", "resume_requested"} \
            <= kinds else None
    if kind in ("nan", "spike"):
        rows = q("SELECT message FROM alert WHERE run_id = ? AND kind = 'breaker' AND message LIKE ?", run_id,
                 f"step {target['step']}:%")
        return rows[0][0] if rows else None
    if kind == "env_error":
        total = q("SELECT sum(value) FROM metric WHERE run_id = ? AND name IN ('env_errors', 'agent_errors')",
                  run_id)[0][0]
        return f"{total:.0f} failed episodes counted" if total else None
    if kind == "full_disk_checkpoint":
        rows = q("SELECT number, cause FROM attempt WHERE run_id = ? AND cause LIKE '%No space left%'", run_id)
        return f"attempt {rows[0][0]}: {rows[0][1][:120]}" if rows else None
    if kind == "full_disk_db":
        rows = q("SELECT message FROM event WHERE run_id = ? AND kind = 'database_write_failed'", run_id)
        return rows[0][0] if rows else None
    return None


def recovery_s(q, f: dict) -> float | None:
    """Seconds from the fault until its run trained a step it had not trained before (a daemon: until the next
    daemon started), from the records."""
    kind, target, t = f["kind"], f.get("target", {}), f["time"]
    if kind == "serve_kill":
        return f["recovered_s"]
    if kind == "daemon_kill":
        rows = q("SELECT min(time) FROM daemon_event WHERE kind = 'started' AND time > ?", t)
        return rows[0][0] - t if rows[0][0] else None
    if kind == "full_disk_checkpoint":
        rows = q("SELECT ended_at, end_step FROM attempt WHERE run_id = ? AND cause LIKE '%No space left%'",
                 target["run"])
        if not rows:
            return None
        t, step = rows[0][0], rows[0][1]
    elif kind in ("worker_kill", "rank_kill", "hang_short", "hang_long", "stop_resume", "disk_full"):
        step = target["step"]
    else:
        return None
    rows = q("SELECT min(time) FROM metric WHERE run_id = ? AND name = 'version' AND step >= ? AND time > ?",
             target["run"], step, t)
    return rows[0][0] - t if rows[0][0] else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="how long the storm lasts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("chaos-summary.json"))
    p.add_argument("--home", type=Path, help="the soak's data directory (default: a new temporary one)")
    p.add_argument("--steps", type=int, default=60, help="trainer steps of each run")
    p.add_argument("--drain-minutes", type=float, default=20.0,
                   help="after the storm: how long the runs get to complete")
    a = p.parse_args(argv)
    home = (a.home or Path(tempfile.mkdtemp(prefix="molt-chaos-"))).resolve()
    home.mkdir(parents=True, exist_ok=True)
    say(f"home {home}, seed {a.seed}, {a.minutes:g} min of faults")
    soak = Soak(home, a.seed, a.minutes, a.steps)
    started = time.time()
    try:  # whatever happens, no process of the soak and no mount outlives it
        soak.serve = Serve(home)
        for slot in SLOTS:
            soak.launch(slot)
        while len(soak.running()) < len(SLOTS):  # the storm starts once every run trains
            time.sleep(1)
        say("all runs train: the storm starts")
        soak.storm()
        say("storm over: waiting for the runs to complete")
        drained = soak.drain(a.drain_minutes * 60)
        soak.serve.client.close()
        soak.serve.proc.send_signal(signal.SIGINT)  # Ctrl-C: stops the daemon (its runs are all over by now)
        try:
            soak.serve.proc.wait(120)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(2)  # the daemon's own exit, a moment after serve returns
        leftovers = soak_processes(home)
        for pid in leftovers:
            say(f"left running: pid {pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:200]!r}")
        summary = {"minutes": a.minutes, "seed": a.seed, "home": str(home), "wall_s": round(time.time() - started),
                   "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, "tmpfs": soak.tmpfs, "drained": drained,
                   **verdict(soak, leftovers, drained)}
    finally:
        for pid in soak_processes(home):
            kill_group(pid, signal.SIGKILL)
        for directory in soak.mounts:
            subprocess.run(["umount", "--lazy", str(directory)])
    a.out.write_text(json.dumps(summary, indent=1, default=str))
    brief = {k: v for k, v in summary.items() if k not in ("per_run", "fault_log")}
    print(json.dumps(brief, indent=1, default=str), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
