"""The whole server as a state machine: seeded random sequences of what users do (create, stop, resume, clone,
delete, evaluate, sweep, register and report an external run, restart the daemon gracefully or with SIGKILL) against
a real `molt serve`, and after every step the invariants checked against the API and the SQLite file itself.

A failure names its seed; replay it alone with MOLT_STATEFUL_SEED=N python -m pytest tests/test_stateful.py -k short.
The long version (slow suite): MOLT_STATEFUL_SEQUENCES (default 6) sequences of MOLT_STATEFUL_STEPS (default 20)."""
import os
import random
import signal
import sqlite3
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.auth import Auth
from app_support import child_env, molt, serve
from conftest import wait_until
from daemon.db import lock_holder
from daemon.models import EVAL_STATUSES, STATUSES, SWEEP_STATUSES, TERMINAL

TINY = {"env": "max_digit", "model": {"preset": "tiny-dense"}, "seed": 0,
        "loop": {"steps": 6, "groups_per_step": 2, "group_size": 2, "eval_every": 0},
        "warm_start": {"steps": 1}, "checkpoint": {"every": 2}}
EVAL_ENDED = ("completed", "failed", "stopped")
ACTIONS = {  # name: weight
    "create": 4, "stop": 3, "resume": 3, "clone": 2, "delete": 3, "evaluate": 2, "stop_eval": 1, "sweep": 2,
    "stop_sweep": 1, "resume_sweep": 1, "delete_sweep": 1, "register": 3, "register_again": 1,
    "register_concurrently": 1, "register_with_a_sweep_runs_key": 1, "report": 4, "end_external": 1,
    "kill_daemon": 1, "restart_daemon": 1,
}


class Violation(AssertionError):
    pass


class Sequence:
    """One seeded sequence against one fresh `molt serve`: the actions, and the model of what the server may do."""

    def __init__(self, served, seed: int):
        self.s, self.rng, self.home = served, random.Random(seed), served.home
        # the report token `molt token --report` prints, derived here (a subprocess per sequence cost ~2 s)
        self.report = httpx.Client(base_url=served.base, timeout=60,
                                   headers={"Authorization": "Bearer " + Auth(served.token).report})
        self.anonymous = httpx.Client(base_url=served.base, timeout=60)
        self.ingest: dict[int, str] = {}          # external run -> its ingest token
        self.reported: dict[int, int] = {}        # external run -> next step it reports
        self.external_keys: dict[str, int] = {}   # Idempotency-Key -> the run it registered
        self.may_revive: set[int] = set()         # ended runs a resume (the user's, a sweep's, a daemon's) reopens
        self.user_resumed: set[int] = set()       # runs the user resumed himself
        self.deleted: dict[str, set[int]] = {"run": set(), "sweep": set(), "eval": set()}
        self.created_at: dict[tuple[str, int], float] = {}
        self.last: dict | None = None              # the previous step's snapshot
        self.log: list[str] = []

    # ---- requests -----------------------------------------------------------------------------------------------

    def call(self, method: str, path: str, allowed: tuple[int, ...], client=None, **kwargs) -> httpx.Response:
        response = (client or self.s.client).request(method, path, **kwargs)
        self.log.append(f"  {method} {path} -> {response.status_code}")
        if response.status_code >= 500 or response.status_code not in allowed:
            raise Violation(f"{method} {path}: {response.status_code} (allowed {allowed}): {response.text[:500]}")
        return response

    def pick(self, ids) -> int | None:
        ids = sorted(ids)
        return self.rng.choice(ids) if ids else None

    # ---- the actions --------------------------------------------------------------------------------------------

    def step(self, action: str):
        runs, rng = self.last["runs"], self.rng
        daemon_runs = [i for i, r in runs.items() if r["host"] is None]
        external = [i for i in self.ingest if i in runs]
        if action == "create":
            config = {**TINY, "seed": rng.randrange(100)}
            self.call("POST", "/api/v1/runs", (201,), json={"config": config, "name": f"run-{rng.randrange(999)}"})
        elif action in ("stop", "resume", "delete") and (run := self.pick(runs)) is not None:
            if action == "delete":
                if self.call("DELETE", f"/api/v1/runs/{run}", (204, 409)).status_code == 204:
                    self.deleted["run"].add(run)
            elif self.call("POST", f"/api/v1/runs/{run}/{action}", (202, 409)).status_code == 202 \
                    and action == "resume":
                self.may_revive.add(run)
                self.user_resumed.add(run)
        elif action == "clone" and (run := self.pick(daemon_runs)) is not None:
            original = self.call("GET", f"/api/v1/runs/{run}", (200,)).json()
            self.call("POST", "/api/v1/runs", (201,), json={"config": original["config"],
                                                            "name": original["name"] + " (clone)"})
        elif action == "evaluate":
            run = self.pick(daemon_runs)
            body = {"run_id": run, "checkpoint": "latest"} if run and rng.random() < 0.5 else \
                {"model": {"preset": "tiny-dense"}, "env": "max_digit"}
            # a run with no checkpoint yet (or deleted meanwhile) is refused, naming it
            self.call("POST", "/api/v1/evals", (201, 404, 422) if "run_id" in body else (201,),
                      json={**body, "episodes": 4, "seed": rng.randrange(100)})
        elif action == "stop_eval" and (ev := self.pick(self.last["evals"])) is not None:
            self.call("POST", f"/api/v1/evals/{ev}/stop", (202, 409))
        elif action == "sweep":
            self.call("POST", "/api/v1/sweeps", (201,), json={
                "name": f"sw{rng.randrange(10**6)}", "config": TINY, "metric": "reward_mean",
                "params": {"algo.lr": {"values": [1e-3, 3e-3][:rng.choice([1, 2])]}}, "seeds": rng.choice([1, 2])})
        elif action in ("stop_sweep", "resume_sweep", "delete_sweep") and \
                (sweep := self.pick(self.last["sweeps"])) is not None:
            if action == "delete_sweep":
                if self.call("DELETE", f"/api/v1/sweeps/{sweep}", (204, 409)).status_code == 204:
                    self.deleted["sweep"].add(sweep)
            elif self.call("POST", f"/api/v1/sweeps/{sweep}/{action.split('_')[0]}", (202, 409)).status_code == 202 \
                    and action == "resume_sweep":
                self.may_revive |= {i for i, r in runs.items() if r["sweep_id"] == sweep}
        elif action == "register":
            self.register(f"ext-{rng.randrange(10**9)}")
        elif action == "register_again" and self.external_keys:
            key = self.rng.choice(sorted(self.external_keys))
            if self.register(key) != self.external_keys[key]:
                raise Violation(f"the Idempotency-Key {key} registered run {self.external_keys[key]} and now another")
        elif action == "register_concurrently":
            key = f"ext-{rng.randrange(10**9)}"
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda _: self.report.post("/api/v1/external-runs", json=self.external_body(),
                                                                   headers={"Idempotency-Key": key}), range(2)))
            self.log.append(f"  2 x POST /api/v1/external-runs {key} -> {[a.status_code for a in answers]}")
            if [a.status_code for a in answers] != [201, 201] or len({a.json()["run"]["id"] for a in answers}) != 1:
                raise Violation(f"two registrations with one key: {[(a.status_code, a.text[:200]) for a in answers]}")
            # which of the two tokens the server gave last is a race: the sender's next try holds the one that writes
            if self.register(key) != answers[0].json()["run"]["id"]:
                raise Violation(f"the Idempotency-Key {key} registered run {answers[0].json()['run']['id']} and now another")
        elif action == "register_with_a_sweep_runs_key" and \
                (run := self.pick(i for i, r in runs.items() if r["sweep_id"] is not None)) is not None:
            key = self.db("SELECT idempotency_key FROM run WHERE id = ?", run)
            key = key[0][0] if key else f"sweep:0:0:{run}"
            answer = self.call("POST", "/api/v1/external-runs", (201, 409, 422), client=self.report,
                               json=self.external_body(), headers={"Idempotency-Key": key})
            if answer.status_code == 201:
                if answer.json()["run"]["id"] == run or answer.json()["run"]["host"] is None:
                    raise Violation(f"the report token, with the key {key} of sweep run {run}, got run "
                                    f"{answer.json()['run']['id']} (host {answer.json()['run']['host']}) and an "
                                    "ingest token for it: it reaches a run it did not register")
                self.remember(key, answer.json())
        elif action == "report" and (run := self.pick(external)) is not None:
            self.report_run(run)
        elif action == "end_external" and (run := self.pick(external)) is not None:
            self.call("POST", f"/api/v1/runs/{run}/end", (200, 409), json={"status": rng.choice(["stopped", "failed"])})
        elif action == "kill_daemon":
            pid = lock_holder(self.home / "daemon.lock")
            if pid and pid.isdigit():
                os.kill(int(pid), signal.SIGKILL)
                self.log.append(f"  SIGKILL daemon {pid}")
                # `molt serve` starts another within its backoff (a daemon stopped on request stays stopped)
                wait_until(lambda: (now := lock_holder(self.home / "daemon.lock")) and now != pid, 60,
                           message="molt serve to start a new daemon")
        elif action == "restart_daemon":
            self.may_revive |= {i for i, r in runs.items() if r["status"] not in TERMINAL and r["host"] is None}
            for command in (("stop", "--grace", "60"), ("start", "--timeout", "90")):
                done = subprocess.run(molt("daemon", *command, "--home", str(self.home)), capture_output=True,
                                      text=True, env=child_env(self.home), timeout=180)
                self.log.append(f"  molt daemon {command[0]} -> {done.returncode}")
                if done.returncode != 0:
                    raise Violation(f"molt daemon {command[0]}: exit {done.returncode}: {done.stderr[-500:]}")

    def external_body(self) -> dict:
        return {"config": {**TINY, "seed": self.rng.randrange(100)}, "host": "elsewhere", "pid": 4242}

    def register(self, key: str) -> int:
        answer = self.call("POST", "/api/v1/external-runs", (201,), client=self.report, json=self.external_body(),
                           headers={"Idempotency-Key": key})
        return self.remember(key, answer.json())

    def remember(self, key: str, answer: dict) -> int:
        run = answer["run"]["id"]
        self.external_keys[key] = run
        self.ingest[run] = answer["ingest_token"]   # a new token replaces the run's earlier one
        self.reported.setdefault(run, 0)
        return run

    def report_run(self, run: int):
        step, ended = self.reported[run], self.last["runs"][run]["status"] in TERMINAL
        records = [{"t": "metrics", "time": time.time(), "step": step, "values": {"reward_mean": 0.5}}]
        if self.rng.random() < 0.3:
            records.append({"t": "end", "time": time.time(), "status": "completed"})
        answer = self.call("POST", f"/api/v1/runs/{run}/ingest", (409,) if ended else (200, 409),
                           json={"records": records}, headers={"Authorization": f"Bearer {self.ingest[run]}"})
        if answer.status_code == 200:
            self.reported[run] = step + 1

    # ---- the invariants -----------------------------------------------------------------------------------------

    def db(self, sql: str, *args) -> list:
        with sqlite3.connect(f"file:{self.home / 'molt.db'}?mode=ro", uri=True, timeout=30) as conn:
            return conn.execute(sql, args).fetchall()

    def snapshot_db(self) -> dict:
        runs = {i: {"status": st, "step": step if st in TERMINAL else None}
                for i, st, step in self.db("SELECT id, status, step FROM run")}
        return {"runs": runs, "sweeps": dict(self.db("SELECT id, status FROM sweep")),
                "evals": dict(self.db("SELECT id, status FROM evaluation"))}

    def snapshot_api(self) -> dict:
        runs = {r["id"]: r for r in self.call("GET", "/api/v1/runs", (200,)).json()}
        return {"runs": runs, "sweeps": {w["id"]: w for w in self.call("GET", "/api/v1/sweeps", (200,)).json()},
                "evals": {e["id"]: e for e in self.call("GET", "/api/v1/evals", (200,)).json()}}

    def observe(self) -> dict:
        """The API's view, once it equals the database file's (read before and after it: objects move meanwhile)."""
        for _ in range(20):
            before, api, after = self.snapshot_db(), self.snapshot_api(), self.snapshot_db()
            seen = {"runs": {i: {"status": r["status"], "step": r["step"] if r["status"] in TERMINAL else None}
                             for i, r in api["runs"].items()},
                    "sweeps": {i: w["status"] for i, w in api["sweeps"].items()},
                    "evals": {i: e["status"] for i, e in api["evals"].items()}}
            if seen in (before, after):
                return api
        raise Violation(f"the API and molt.db disagree:\napi {seen}\ndb  {after}")

    def check(self):
        now_ = self.observe()
        previous = self.last or {"runs": {}, "sweeps": {}, "evals": {}}
        for kind, table, statuses in (("run", "runs", STATUSES), ("sweep", "sweeps", SWEEP_STATUSES),
                                      ("eval", "evals", EVAL_STATUSES)):
            for i, obj in now_[table].items():
                if obj["status"] not in statuses:
                    raise Violation(f"{kind} {i} is {obj['status']!r}: neither live nor ended")
                first = self.created_at.setdefault((kind, i), obj["created_at"])
                if i in self.deleted[kind] or first != obj["created_at"]:
                    raise Violation(f"{kind} id {i} was given again (deleted before, or created at another time)")
            for i in set(previous[table]) - set(now_[table]):
                gone_with = previous[table][i].get("sweep_id") in self.deleted["sweep"] or \
                    previous[table][i].get("run_id") in self.deleted["run"]  # an evaluation goes with its run
                if i not in self.deleted[kind] and not gone_with:
                    raise Violation(f"{kind} {i} vanished without a delete")
                self.deleted[kind].add(i)
        for i, r in now_["runs"].items():
            was = previous["runs"].get(i, {}).get("status")
            if was in TERMINAL and r["status"] not in TERMINAL:
                if i not in self.may_revive:
                    raise Violation(f"run {i} ended {was}, then became {r['status']} with no resume")
                self.may_revive.discard(i)
        for i, e in now_["evals"].items():
            was = previous["evals"].get(i, {}).get("status")
            if was in EVAL_ENDED and e["status"] != was:
                raise Violation(f"evaluation {i} ended {was}, then became {e['status']}")
        for sweep_id, point, seed, n in self.db(
                "SELECT sweep_id, sweep_point, json_extract(config, '$.seed'), count(*) FROM run WHERE sweep_id IS "
                "NOT NULL GROUP BY sweep_id, sweep_point, json_extract(config, '$.seed') HAVING count(*) > 1"):
            raise Violation(f"sweep {sweep_id} point {point} has {n} runs of seed {seed}")
        for i, w in now_["sweeps"].items():
            live = [r for r, run in now_["runs"].items() if run["sweep_id"] == i and run["status"] not in TERMINAL
                    and r not in self.user_resumed]
            if w["status"] == "completed" and live:
                raise Violation(f"sweep {i} is completed while its runs {live} are live (not resumed by the user)")
        self.last = now_
        self.check_tokens()

    def check_tokens(self):
        """No token: nothing; the report token: registering only; an ingest token: writing its own run only."""
        runs, rng = sorted(self.last["runs"]), self.rng
        some = rng.choice(runs) if runs else 1
        refused = [("GET", "/api/v1/runs", {}), ("POST", "/api/v1/runs", {"json": {"config": TINY}}),
                   ("POST", f"/api/v1/runs/{some}/stop", {}), ("DELETE", f"/api/v1/runs/{some}", {}),
                   ("GET", "/api/v1/sweeps", {}), ("POST", "/api/v1/evals", {"json": {"model": TINY["model"]}}),
                   ("POST", f"/api/v1/runs/{some}/ingest", {"json": {"records": []}})]
        for method, path, kwargs in rng.sample(refused, 3):
            self.call(method, path, (401,), client=self.anonymous, **kwargs)
            self.call(method, path, (401,), client=self.report, **kwargs)
        self.call("POST", "/api/v1/external-runs", (401,), client=self.anonymous, json=self.external_body())
        if tokens := sorted(set(self.ingest) & set(runs)):  # a deleted run's token is unknown (401), not another's
            own = rng.choice(tokens)
            bearer = {"Authorization": f"Bearer {self.ingest[own]}"}
            for method, path, kwargs in rng.sample(refused[:6], 2):
                self.call(method, path, (401,), headers=bearer, client=self.anonymous, **kwargs)
            if other := [r for r in runs if r != own]:
                self.call("POST", f"/api/v1/runs/{rng.choice(other)}/ingest", (403,), client=self.anonymous,
                          headers=bearer, json={"records": [{"t": "metrics", "time": time.time(), "step": 0,
                                                             "values": {"x": 1.0}}]})

    def play(self, steps: int):
        self.check()
        names, weights = zip(*ACTIONS.items())
        for number in range(steps):
            action = self.rng.choices(names, weights)[0]
            self.log.append(f"step {number}: {action}")
            self.step(action)
            self.check()


def play(tmp_path, seed: int, steps: int):
    with serve(tmp_path / f"home-{seed}", "--concurrency", "2") as served:
        sequence = Sequence(served, seed)
        try:
            sequence.play(steps)
        except Exception as e:  # any failure (a timeout too) names the seed that replays it
            raise Violation(f"seed {seed}: {type(e).__name__}: {e}\nreplay: MOLT_STATEFUL_SEED={seed} "
                            f"MOLT_STATEFUL_STEPS={steps} python -m pytest tests/test_stateful.py -k short\n"
                            + "\n".join(sequence.log[-40:])) from None
        finally:
            sequence.report.close()
            sequence.anonymous.close()


SHORT = [int(os.environ["MOLT_STATEFUL_SEED"])] if os.environ.get("MOLT_STATEFUL_SEED") else [0, 1, 2]


@pytest.mark.parametrize("seed", SHORT)
def test_short_sequences_keep_the_invariants(tmp_path, seed):
    play(tmp_path, seed, int(os.environ.get("MOLT_STATEFUL_STEPS", 6)))


@pytest.mark.slow
@pytest.mark.timeout(0)
def test_long_sequences_keep_the_invariants(tmp_path):
    count, steps = int(os.environ.get("MOLT_STATEFUL_SEQUENCES", 6)), int(os.environ.get("MOLT_STATEFUL_STEPS", 20))
    failures = []
    for seed in range(1000, 1000 + count):
        try:
            play(tmp_path, seed, steps)
        except Violation as e:
            failures.append(str(e).split("\n")[0])
            print(e)
    assert not failures, "\n".join(failures)
