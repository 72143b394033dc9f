"""The daemon's records without training: migrations, SQLite settings, the database sink, the spool, the Python API."""
import math
import itertools
import os
import random
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from pydantic import ValidationError
from sqlalchemy import inspect, select
from sqlalchemy.dialects.sqlite import insert as insert_
from sqlmodel import Session, SQLModel

from conftest import wait_until
from daemon import models
from daemon.records import Records, Conflict, RunNotFound, extremes
from daemon.db import alembic_config, connect, sqlite_engine, upgrade
from daemon.models import Attempt, Metric
from daemon.sink import DbSink, replay_spools

FAST = {"env": "max_digit", "loop": {"steps": 30, "groups_per_step": 4, "group_size": 4, "eval_every": 0},
        "warm_start": {"steps": 5}, "checkpoint": {"every": 5}}


def schema(engine) -> dict:
    """Tables with their columns, primary keys, foreign keys, unique constraints and indexes, by name."""
    insp = inspect(engine)
    out = {}
    for table in insp.get_table_names():
        if table == "alembic_version":
            continue
        out[table] = {
            "columns": sorted((c["name"], str(c["type"]), c["nullable"]) for c in insp.get_columns(table)),
            "pk": insp.get_pk_constraint(table)["constrained_columns"],
            "fks": sorted((tuple(f["constrained_columns"]), f["referred_table"]) for f in insp.get_foreign_keys(table)),
            "unique": sorted((u["name"], tuple(u["column_names"])) for u in insp.get_unique_constraints(table)),
            "indexes": sorted((i["name"], tuple(i["column_names"]), bool(i["unique"]))
                              for i in insp.get_indexes(table)),
        }
    return out


def test_upgrade_head_gives_exactly_the_models_schema_and_downgrade_base_empties_it(tmp_path):
    (tmp_path / "a").mkdir()
    migrated = sqlite_engine(f"sqlite:///{tmp_path / 'a' / 'molt.db'}")
    upgrade(migrated, tmp_path / "a")
    created = sqlite_engine(f"sqlite:///{tmp_path / 'created.db'}")
    SQLModel.metadata.create_all(created)

    assert set(schema(migrated)) == {"run", "attempt", "metric", "metric_bucket", "policy_version", "checkpoint",
                                     "alert", "event", "daemon_event", "sample", "evaluation", "eval_result", "sweep"}
    assert schema(migrated) == schema(created)
    with migrated.connect() as conn:  # what `alembic check` does: no difference between models and database
        assert compare_metadata(MigrationContext.configure(conn), SQLModel.metadata) == []

    with migrated.begin() as conn:
        command.downgrade(alembic_config(conn), "base")
    assert inspect(migrated).get_table_names() == ["alembic_version"]
    upgrade(migrated, tmp_path / "a")  # and back up again
    assert schema(migrated) == schema(created)


def summary_from_scratch(conn, run_id: int) -> dict:
    """metric_bucket as it should be: each bucket's row count, min row, max row and first NaN row, from `metric`."""
    out = {}
    for name, step, value, t in conn.exec_driver_sql("SELECT name, step, value, time FROM metric WHERE run_id = ? "
                                                     "ORDER BY step", (run_id,)):
        for level, shift in enumerate(models.BUCKET_SHIFTS):
            b = out.setdefault((name, level, step >> shift), {"n": 0, "lo": None, "hi": None, "nan": None})
            b["n"] += 1
            if value is None:
                b["nan"] = b["nan"] or (step, t)
            else:
                b["lo"] = (step, value, t) if b["lo"] is None or value < b["lo"][1] else b["lo"]
                b["hi"] = (step, value, t) if b["hi"] is None or value > b["hi"][1] else b["hi"]
    return out


def summary_in_db(conn, run_id: int) -> dict:
    rows = conn.exec_driver_sql("SELECT name, level, bucket, n, lo_step, lo_value, lo_time, hi_step, hi_value, "
                                "hi_time, nan_step, nan_time FROM metric_bucket WHERE run_id = ?", (run_id,))
    return {(name, level, bucket): {"n": n, "lo": (ls, lv, lt) if ls is not None else None,
                                    "hi": (hs, hv, ht) if hs is not None else None,
                                    "nan": (ns, nt) if ns is not None else None}
            for name, level, bucket, n, ls, lv, lt, hs, hv, ht, ns, nt in rows}


def test_metric_buckets_stay_exact_through_inserts_replays_deletes_and_the_migration(tmp_path):
    """The summary the charts read (migration 0002's triggers): every bucket's min, max and first NaN row, at both
    levels, whoever writes `metric` and however. Ties (several rows holding the same min) are avoided: which row
    holds such a min is not specified."""
    engine = sqlite_engine(f"sqlite:///{tmp_path / 'molt.db'}")
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), "0001")   # rows recorded before the summary existed
    rng = random.Random(0)
    specials = itertools.chain([math.inf, -math.inf], (sign * (1e9 + k) for k in itertools.count()
                                                       for sign in (1, -1)))
    value = lambda: None if rng.random() < 0.05 else next(specials) if rng.random() < 0.01 else rng.random()
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO run (id, name, status, config, tags, step, total_steps, version, restarts, "
                             "retries, max_restarts, created_at) VALUES (1, 'r', 'running', '{}', '[]', 0, 0, 0, 0, "
                             "0, 3, 0)")
        insert = "INSERT INTO metric (run_id, name, step, value, time) VALUES (1, ?, ?, ?, ?)"
        conn.exec_driver_sql(insert, [(name, step, value(), float(step)) for name in "ab" for step in range(700)])
    upgrade(engine, tmp_path)
    with engine.begin() as conn:
        assert summary_in_db(conn, 1) == summary_from_scratch(conn, 1)

        conn.exec_driver_sql(insert, [(name, step, value(), float(step)) for name in "abc"
                                      for step in rng.sample(range(700, 3000), 1500)])  # out of order, with gaps
        for _ in range(300):  # replays: values rewritten in place, spikes among them removed
            conn.exec_driver_sql("UPDATE metric SET value = ?, time = time + 0.5 WHERE name = ? AND step = ?",
                                 (value(), rng.choice("abc"), rng.randrange(3000)))
        conn.exec_driver_sql("UPDATE metric SET value = 0.25 + step * 1e-9 WHERE abs(value) >= 1e9")
        conn.exec_driver_sql("DELETE FROM metric WHERE step % 97 = 3 OR (name = 'c' AND step >= 2048)")
        conn.exec_driver_sql("UPDATE metric SET step = step + 5000 WHERE name = 'b' AND step < 100")  # moved
        assert summary_in_db(conn, 1) == summary_from_scratch(conn, 1)
    with engine.begin() as conn:  # and the sink's upsert (ON CONFLICT DO UPDATE: an UPDATE to the triggers)
        rows = [{"run_id": 1, "name": "a", "step": step, "value": -5.0 if step == 150 else None, "time": 1.0}
                for step in range(100, 200)]
        stmt = insert_(Metric)
        conn.execute(stmt.on_conflict_do_update(index_elements=["run_id", "name", "step"],
                                                set_={"value": stmt.excluded.value}), rows)
        assert summary_in_db(conn, 1) == summary_from_scratch(conn, 1)
        assert summary_in_db(conn, 1)[("a", 0, 2)]["lo"] == (150, -5.0, 150.0)


def test_connections_use_wal_and_a_busy_timeout(tmp_path):
    engine = connect(tmp_path)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    assert (tmp_path / "molt.db").exists()


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    return Records(tmp_path_factory.mktemp("home"))


def new_attempt(api, run_id, number=1) -> int:
    with Session(api.engine) as s:
        attempt = Attempt(run_id=run_id, number=number)
        s.add(attempt)
        s.commit()
        return attempt.id


def test_sink_writes_every_kind_of_record_and_a_replayed_step_never_duplicates(api, tmp_path):
    run = api.create_run(FAST, name="sink", tags=["unit"])
    first = DbSink(api.engine, run["id"], new_attempt(api, run["id"]), spool_dir=tmp_path, flush_every=0.05)
    for step in range(10):
        first.metrics(step, {"reward_mean": step / 10, "version": step + 1, "staleness_mean": 0.0,
                             "staleness_max": 0.0, "policy_loss": math.nan if step == 7 else 0.5,
                             "grad_norm": math.inf if step == 8 else 1.0})
    first.checkpoint(5, str(tmp_path / "step-000005"), size_bytes=123, version=5)
    first.alert("breaker", "grad norm spike", step=8, norm=math.inf)
    first.event("warm_start", "done", steps=5)
    first.close()
    assert first.failures == 0 and not list(tmp_path.glob("spool-*")), "a clean close leaves no spool"

    # The next attempt resumes from the step-5 checkpoint and sends steps 5..9 again (different values).
    second = DbSink(api.engine, run["id"], new_attempt(api, run["id"], 2), spool_dir=tmp_path, flush_every=0.05)
    for step in range(5, 10):
        second.metrics(step, {"reward_mean": 1.0, "version": step + 1})
    second.close()

    rows = api.metrics(run["id"], names=["reward_mean"])
    assert [r["step"] for r in rows] == list(range(10))
    assert [r["value"] for r in rows] == [0.0, 0.1, 0.2, 0.3, 0.4, 1.0, 1.0, 1.0, 1.0, 1.0]
    with Session(api.engine) as s:
        names_steps = s.execute(select(Metric.name, Metric.step).where(Metric.run_id == run["id"])).all()
    assert len(names_steps) == len(set(names_steps)) == 6 * 10  # 6 names x 10 steps
    loss = {r["step"]: r["value"] for r in api.metrics(run["id"], names=["policy_loss", "grad_norm"])
            if r["name"] == "policy_loss"}
    assert math.isnan(loss[7]) and loss[6] == 0.5, "NaN is stored (as NULL) and read back as NaN"
    assert api.metrics(run["id"], names=["grad_norm"], after_step=7)[0]["value"] == math.inf
    assert [v["version"] for v in api.policy_versions(run["id"])] == list(range(1, 11))
    refused = DbSink(api.engine, run["id"], new_attempt(api, run["id"], 3), flush_every=0.05)
    refused.metrics(10, {"reward_mean": 0.0, "version": 10, "breaker_tripped": 1.0})  # no new version published
    refused.close()
    last = api.policy_versions(run["id"])[-1]
    assert (last["version"], last["step"], last["reward_mean"]) == (10, 9, 1.0), "version 10 came from step 9"
    cp = api.checkpoints(run["id"])[0]
    assert (cp["step"], cp["size_bytes"], cp["version"], cp["exists"]) == (5, 123, 5, False)
    assert [(a["kind"], a["step"]) for a in api.alerts(run["id"])] == [("breaker", 8)]
    assert any(e["kind"] == "warm_start" for e in api.events(run["id"]))
    got = api.get_run(run["id"])
    assert (got["step"], got["version"], got["reward"], got["alerts_open"]) == (11, 10, 0.0, 1)
    assert [a["start_step"] for a in api.attempts(run["id"])] == [0, 5, 10]


def test_heartbeat_written_time_stops_when_the_engine_stops_beating(api, tmp_path):
    run = api.create_run(FAST)
    attempt_id = new_attempt(api, run["id"])
    sink = DbSink(api.engine, run["id"], attempt_id, flush_every=0.05)

    def beat():
        return api.attempts(run["id"])[0]["heartbeat_at"]
    before = wait_until(beat, 10, message="the writer's own startup heartbeat")
    sink.heartbeat()  # the engine's first beat; from now on only the engine's calls count
    engine_beat = sink._engine_beat
    wait_until(lambda: beat() == engine_beat, 10, message="the engine's beat written")
    passes = sink.passes
    wait_until(lambda: sink.passes >= passes + 30, 10, message="more writer passes")  # ~1.5 s of a hung event loop
    assert before <= engine_beat == beat(), "a live writer thread must not hide a hung event loop"
    sink.close()


def test_a_killed_worker_loses_nothing_its_spool_is_replayed_idempotently(api, tmp_path):
    run = api.create_run(FAST)
    attempt_id = new_attempt(api, run["id"])
    script = textwrap.dedent(f"""
        import os, signal
        from daemon.db import connect
        from daemon.sink import DbSink
        sink = DbSink(connect({str(api.home)!r}, migrate=False), {run['id']}, {attempt_id},
                      spool_dir={str(tmp_path)!r}, flush_every=3600)  # it never gets to flush
        for step in range(50):
            sink.metrics(step, {{"reward_mean": 0.5, "version": step + 1}})
        sink.alert("staleness", "too stale", step=49)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == -9
    assert api.metrics(run["id"]) == []
    spools = list(tmp_path.glob("spool-*.jsonl"))
    assert spools
    copies = tmp_path / "copies"
    copies.mkdir()
    for p in spools:
        shutil.copy(p, copies / p.name)

    assert replay_spools(api.engine, run["id"], tmp_path) == 51
    assert not list(tmp_path.glob("spool-*.jsonl"))
    assert replay_spools(api.engine, run["id"], copies) == 51  # a second replay changes nothing
    assert [r["step"] for r in api.metrics(run["id"], names=["reward_mean"])] == list(range(50))
    assert len(api.alerts(run["id"])) == 1
    assert api.get_run(run["id"])["step"] == 50


def test_api_validates_and_applies_requests_by_status(api):
    with pytest.raises(ValidationError) as e:
        api.create_run({"env": "nope", "loop": {"steps": 0}}, tags=["ok", ""], max_restarts=-1)
    assert {err["loc"] for err in e.value.errors()} == {("config", "env"), ("config", "loop", "steps"), ("tags", 1),
                                                         ("max_restarts",)}
    with pytest.raises(ValidationError) as e:
        api.create_run(FAST, tags=[f"t{i}" for i in range(51)])  # the REST API's limit too: one rule set
    assert [err["loc"] for err in e.value.errors()] == [("tags",)]
    with pytest.raises(RunNotFound):
        api.get_run(10_000)

    run = api.create_run(FAST, name="queued one", tags=["a", "b"])
    assert (run["status"], run["total_steps"], run["config"]["loop"]["group_size"]) == ("queued", 30, 4)
    assert run["config"]["algo"]["estimator"] == "grpo", "defaults are frozen into the stored config"
    assert run["id"] in [r["id"] for r in api.list_runs(tag="b")]
    assert run["id"] not in [r["id"] for r in api.list_runs(tag="c")]
    assert run["id"] in [r["id"] for r in api.list_runs(status=["queued"])]

    assert api.stop_run(run["id"])["status"] == "stopped", "a queued run stops at once"
    assert api.stop_run(run["id"])["status"] == "stopped", "idempotent"
    assert api.resume_run(run["id"])["status"] == "queued"
    assert api.resume_run(run["id"])["status"] == "queued", "idempotent"
    with Session(api.engine) as s:
        s.get(models.Run, run["id"]).status = "completed"
        s.commit()
    with pytest.raises(Conflict):
        api.resume_run(run["id"])
    with pytest.raises(Conflict):
        api.stop_run(run["id"])
    assert api.wait_run(run["id"], timeout=1)["status"] == "completed"


def test_alerts_can_be_acknowledged(api):
    run = api.create_run(FAST)
    sink = DbSink(api.engine, run["id"], new_attempt(api, run["id"]), flush_every=0.05)
    sink.alert("mismatch", "KL too high", step=3)
    sink.close()
    alert = api.alerts(run["id"])[0]
    assert api.get_run(run["id"])["alerts_open"] == 1
    assert api.acknowledge_alert(run["id"], alert["id"])["acknowledged"] is True
    assert api.alerts(run["id"], unacknowledged=True) == []
    assert api.get_run(run["id"])["alerts_open"] == 0
    with pytest.raises(RunNotFound):
        api.acknowledge_alert(run["id"] + 1, alert["id"])


def test_downsample_keeps_min_max_and_the_first_nan_per_bucket():
    values = np.zeros(100)
    values[37], values[62], values[80], values[81] = 50.0, -9.0, math.nan, math.nan
    kept = extremes(values, 21)
    assert len(kept) <= 21 and list(kept) == sorted(kept)
    assert {37, 62, 80} <= set(kept) and 81 not in kept  # 80 and 81 share a bucket: its first NaN stands for both
    assert list(extremes(values[:5], 20)) == [0, 1, 2, 3, 4]


def test_api_metrics_downsample_each_name_by_the_same_rule(api):
    run = api.create_run(FAST)
    with Session(api.engine) as s:
        s.add_all([Metric(run_id=run["id"], name=name, step=i, value=None if (name, i) == ("loss", 80) else
                          50.0 if i == 37 else 0.0) for name in ("loss", "reward") for i in range(100)])
        s.add_all([Metric(run_id=run["id"], name="short", step=i, value=1.0) for i in range(5)])
        s.commit()
    rows = api.metrics(run["id"], max_points=21)
    steps = {name: [r["step"] for r in rows if r["name"] == name] for name in ("loss", "reward", "short")}
    assert {37, 80} <= set(steps["loss"]) and len(steps["loss"]) <= 21 and 37 in steps["reward"]
    assert steps["short"] == [0, 1, 2, 3, 4]
    assert [(r["step"], r["name"]) for r in rows] == sorted((r["step"], r["name"]) for r in rows)


def test_one_daemon_per_data_directory(tmp_path):
    from daemon.db import hold_lock
    from daemon.supervisor import DaemonRunning, Supervisor
    api = Records(tmp_path)
    assert api.daemon_status()["running"] is False
    lock = hold_lock(tmp_path / "daemon.lock", "4242")  # as a running daemon holds it
    status = api.daemon_status()
    assert (status["running"], status["alive"], status["pid"]) == (True, True, 4242)
    with pytest.raises(DaemonRunning, match="4242"):
        Supervisor(tmp_path).run()
    lock.close()
    assert api.daemon_status()["running"] is False


def test_resume_rewinds_to_a_checkpoint_whose_steps_are_all_recorded(api, tmp_path):
    """Metrics lost after their checkpoint was written (a lost spool) must not leave a hole: resume rewinds."""
    from daemon.worker import rewind_to_recorded
    run = api.create_run(FAST)["id"]
    root = tmp_path / "checkpoints"
    for step in (5, 10):
        (root / f"step-{step:06d}").mkdir(parents=True)
        (root / f"step-{step:06d}" / "state.pt").write_bytes(b"")
    (root / "latest").write_text("step-000010")
    sink = DbSink(api.engine, run, new_attempt(api, run), flush_every=0.05)
    for step in range(9):  # steps 0..8 recorded; step 9's metrics were lost with the process
        sink.metrics(step, {"reward_mean": 0.0, "version": step + 1})
    sink.close()

    rewind_to_recorded(api.engine, run, root)
    assert (root / "latest").read_text() == "step-000005"

    sink = DbSink(api.engine, run, new_attempt(api, run, 2), flush_every=0.05)
    sink.metrics(9, {"reward_mean": 0.0, "version": 10})
    sink.close()
    (root / "latest").write_text("step-000010")
    rewind_to_recorded(api.engine, run, root)
    assert (root / "latest").read_text() == "step-000010", "all of 0..9 recorded: resume from step 10"


def test_list_runs_sorts_filters_searches_and_hides_archived_runs_on_request(tmp_path):
    api = Records(tmp_path)
    a = api.create_run(FAST, name="alpha_1", tags=["sweep"])["id"]
    b = api.create_run({**FAST, "env": "guess_number"}, name="beta", tags=["50%-lr"])["id"]
    c = api.create_run(FAST, name="gamma")["id"]
    api.update_run(c, notes="Diverged at step 40", archived=True)
    with Session(api.engine) as s:
        for run_id, step in ((a, 3), (b, 1), (c, 2)):
            s.get(models.Run, run_id).step = step
        s.add(Metric(run_id=b, name="eval_reward", step=0, value=0.7))
        s.add(Metric(run_id=b, name="eval_reward", step=1, value=None))  # a NaN eval: never the best
        s.commit()
    ids = lambda **kw: [r["id"] for r in api.list_runs(**kw)]  # noqa: E731
    assert ids() == [c, b, a] and ids(archived=False) == [b, a] and ids(archived=True) == [c]
    assert ids(sort="steps") == [a, c, b] and ids(sort="steps", descending=False) == [b, c, a]
    assert ids(sort="best_eval")[0] == b and api.list_runs(env="guess_number")[0]["best_eval"] == 0.7
    assert ids(env="guess_number") == [b] and api.run_envs() == ["guess_number", "max_digit"]
    assert ids(q="DIVERGED") == [c] and ids(q="sweep") == [a] and ids(q="50%") == [b]
    assert ids(q="a_1") == [a] and ids(q="%") == [b] and ids(q="_") == [a]  # LIKE's wildcards are plain characters
    assert ids(limit=1, offset=1) == [b]
    with pytest.raises(ValueError, match="sort must be one of"):
        api.list_runs(sort="name; DROP TABLE run")
    with pytest.raises(ValueError, match="name must not be blank"):
        api.update_run(a, name=" ")
    with pytest.raises(Conflict, match="is queued: stop it before deleting"):
        api.delete_run(a)
    assert api.get_run(a)["name"] == "alpha_1"
