"""The REST API, auth and websockets against a real uvicorn and a real SQLite, without training (records are
written through the daemon's own sink, as a worker writes them)."""
import asyncio
import json
import math

import fastapi.routing
import httpx
import pytest
import websockets
from fastapi.routing import APIRoute
from starlette.routing import WebSocketRoute

from app.auth import SESSION_COOKIE, load_or_create_token
from app.series import bucket_extremes
from app_support import FAST, TOKEN, hook, logged_in, new_run, sink_for, web  # noqa: F401 (hook, web: fixtures)
from conftest import wait_until
from sqlmodel import Session, select

from daemon import models


def test_a_new_token_is_saved_private_reused_and_never_reads_as_a_cli_flag(tmp_path, monkeypatch):
    monkeypatch.delenv("MOLT_TOKEN", raising=False)
    tokens = [load_or_create_token(tmp_path / f"home{i}") for i in range(200)]
    assert not [t for t in tokens if t.startswith("-")] and len(set(tokens)) == 200
    assert (tmp_path / "home0" / "token").stat().st_mode & 0o777 == 0o600
    assert load_or_create_token(tmp_path / "home0") == tokens[0]
    monkeypatch.setenv("MOLT_TOKEN", "from-env")
    assert load_or_create_token(tmp_path / "home0") == "from-env"


# ---- C. security ------------------------------------------------------------------------------------------------------

def test_every_api_and_ws_route_rejects_a_missing_or_wrong_token(web):
    run = new_run(web)
    app, base = web["app"], web["base"]
    routes = list(all_routes(app))
    api_routes = [(path, methods) for path, methods, kind in routes
                  if path.startswith("/api") and path != "/api/v1/health"]
    ws_routes = [path for path, _, kind in routes if issubclass(kind, WebSocketRoute)]
    # the enumeration itself must see the contract, or this test would pass vacuously
    paths = {path for path, _ in api_routes}
    assert {"/api/v1/runs", "/api/v1/runs/{run_id}", "/api/v1/runs/{run_id}/metrics", "/api/v1/envs",
            "/api/v1/runs/{run_id}/stop", "/api/v1/runs/{run_id}/wait"} <= paths
    assert ws_routes == ["/ws/daemon", "/ws/runs/{run_id}"]
    assert all(issubclass(kind, (APIRoute, WebSocketRoute)) for path, _, kind in routes
               if path.startswith(("/api", "/ws"))), "a route kind this test does not check"

    wrong = [{}, {"headers": {"Authorization": "Bearer wrong"}}, {"params": {"token": "wrong"}},
             {"headers": {"Cookie": f"{SESSION_COOKIE}=forged"}}, {"headers": {"Authorization": f"Basic {TOKEN}"}}]
    checked = 0
    with httpx.Client(base_url=base, timeout=10) as anonymous:
        for route_path, methods in api_routes:
            path = route_path.replace("{run_id}", str(run["id"])).replace("{alert_id}", "1")
            for method in methods:
                for auth in wrong:
                    response = anonymous.request(method, path, **auth)
                    assert response.status_code == 401, (method, path, auth, response.status_code)
                    checked += 1
        for auth in wrong:  # /metrics: protected like the API (unless --metrics-public)
            assert anonymous.get("/metrics", **auth).status_code == 401
            checked += 1
        assert anonymous.get("/api/v1/health").status_code == 503  # the one exception (no daemon: degraded)

    async def ws_rejected(url, **kw):
        with pytest.raises(websockets.exceptions.InvalidStatus) as e:
            async with websockets.connect(url, **kw):
                pass
        return e.value.response.status_code

    ws_base = base.replace("http", "ws")
    for route_path in ws_routes:
        path = route_path.replace("{run_id}", str(run["id"]))
        for kw in [{}, {"additional_headers": {"Authorization": "Bearer wrong"}},
                   {"additional_headers": {"Cookie": f"{SESSION_COOKIE}=forged"}}]:
            assert asyncio.run(ws_rejected(ws_base + path, **kw)) == 403
        assert asyncio.run(ws_rejected(ws_base + path + "?token=wrong")) == 403
        # and the right token gets in (so the rejections above are about the token)
        first = asyncio.run(ws_first(ws_base + path + f"?token={TOKEN}"))
        assert first["type"] == ("daemon" if path == "/ws/daemon" else "status")
    assert checked >= 5 * 14


def all_routes(app):
    """(path, methods, route class) of every route, included routers flattened (FastAPI >= 0.16 keeps them
    nested as _IncludedRouter entries of app.routes)."""
    iterate = getattr(fastapi.routing, "iter_route_contexts", None)
    for context in (iterate(app.routes) if iterate else app.routes):
        route = getattr(context, "route", context)
        yield context.path, set(getattr(context, "methods", None) or ()), type(route)


async def ws_first(url, **kw):
    async with websockets.connect(url, **kw) as ws:
        return json.loads(await ws.recv())


# ---- D. bad input -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    ({"config": {"env": "max_digit", "loop": {"steps": 0}}}, ["body", "config", "loop", "steps"]),
    ({"config": {"env": "no_such_env"}}, ["body", "config", "env"]),
    ({"config": {"env": "max_digit", "model": {"preset": "huge"}}}, ["body", "config", "model", "preset"]),
    ({"config": {"env": "max_digit", "lop": {}}}, ["body", "config", "lop"]),
    ({"config": {"env": "max_digit", "algo": {"lr": False}}}, ["body", "config", "algo", "lr"]),
    ({"config": {"env": "max_digit"}, "tags": [""]}, ["body", "tags", 0]),
    ({"config": {"env": "max_digit"}, "tags": [f"t{i}" for i in range(51)]}, ["body", "tags"]),
    ({"config": {"env": "max_digit"}, "max_restarts": -1}, ["body", "max_restarts"]),
    ({"config": {"env": "max_digit"}, "nmae": "x"}, ["body", "nmae"]),
    ({}, ["body", "config", "env"]),  # a body without "config" is a bare config: the env it lacks is named
])
def test_invalid_input_is_a_422_naming_the_field(web, body, field):
    response = web["client"].post("/api/v1/runs", json=body)
    assert response.status_code == 422, response.text
    assert field in [e["loc"] for e in response.json()["detail"]], response.json()


def test_malformed_json_is_a_400_and_unknown_ids_are_404(web):
    response = web["client"].post("/api/v1/runs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    for path in ["", "/metrics", "/metrics.csv", "/alerts", "/events", "/attempts", "/checkpoints", "/log",
                 "/wait?timeout=0"]:
        assert web["client"].get(f"/api/v1/runs/999999{path}").status_code == 404, path
    for action in ["stop", "resume", "alerts/1/ack"]:
        assert web["client"].post(f"/api/v1/runs/999999/{action}").status_code == 404, action
    assert web["client"].get("/api/v1/runs", params={"status": "bogus"}).status_code == 422
    assert web["client"].get("/api/v1/runs/abc").status_code == 422


def test_a_dataset_run_is_checked_on_its_first_row_without_loading_the_file_into_the_web(web, tmp_path):
    from molt_engine.data import Dataset, _load
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n" + "not json\n" * 50_000)
    config = {"env": "dataset", "model": {"preset": "tiny-chat"}, "env_args": {"path": str(path)}}
    _load.cache_clear()
    response = web["client"].post("/api/v1/runs", json={"config": config})
    assert response.status_code == 201, response.text
    assert _load.cache_info().currsize == 0, "the web process read the whole file"
    with pytest.raises(ValueError, match=r"big.jsonl:2: not JSON"):  # the worker's env reads it all
        Dataset(path=str(path))
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "2+2?"}) + "\n")
    # what test_chat_app.py does not already ask of the first-row check
    for env_args, error in [({"path": str(path), "eval_path": str(tmp_path / "q.jsonl")}, "no 'prompt' column"),
                            ({"path": str(path), "max_tokens": 0}, "max_tokens must be >= 1")]:
        response = web["client"].post("/api/v1/runs", json={"config": {**config, "env_args": env_args}})
        assert response.status_code == 422 and error in response.text, (env_args, response.text)
    assert _load.cache_info().currsize == 0


def test_stop_and_resume_answer_202_and_409_when_the_status_forbids(web):
    run = new_run(web)
    response = web["client"].post(f"/api/v1/runs/{run['id']}/stop")
    assert response.status_code == 202 and response.json()["status"] == "stopped"  # queued: stops at once
    response = web["client"].post(f"/api/v1/runs/{run['id']}/resume")
    assert response.status_code == 202 and response.json()["status"] == "queued"
    web["client"].post(f"/api/v1/runs/{run['id']}/stop")
    with Session(web["records"].engine) as s:  # a completed run cannot be resumed
        from daemon.db import set_run
        set_run(s, run["id"], None, status="completed")
        s.commit()
    assert web["client"].post(f"/api/v1/runs/{run['id']}/resume").status_code == 409
    assert web["client"].get(f"/api/v1/runs/{run['id']}/wait", params={"timeout": 20}).json()["status"] == "completed"


# ---- metrics: downsampling that keeps spikes, NaN and infinity ------------------------------------------------------

def test_metrics_downsampling_keeps_spikes_nan_and_inf_and_the_csv_has_everything(web):
    run = new_run(web)
    sink = sink_for(web, run["id"])
    n = 5000
    for step in range(n):
        value = 1.0 + (step % 7) * 0.01
        value = {1234: 500.0, 2345: math.nan, 3456: math.inf, 4567: -math.inf}.get(step, value)
        sink.metrics(step, {"grad_norm": value, "reward_mean": step / n})
    sink.close()
    client = web["client"]
    full = client.get(f"/api/v1/runs/{run['id']}/metrics", params={"names": "grad_norm"}).json()
    assert len(full["series"]["grad_norm"]["step"]) == n and not full["downsampled"]
    assert set(full["names"]) == {"grad_norm", "reward_mean"}

    small = client.get(f"/api/v1/runs/{run['id']}/metrics", params={"max_points": 100}).json()
    assert small["downsampled"]
    g = small["series"]["grad_norm"]
    assert len(g["step"]) <= 100 and g["step"] == sorted(g["step"])
    values = dict(zip(g["step"], g["value"]))
    assert values[1234] == 500.0 and values[2345] == "NaN" and values[3456] == "Infinity"
    assert values[4567] == "-Infinity"
    assert min(v for v in g["value"] if isinstance(v, float)) == 1.0
    r = small["series"]["reward_mean"]
    assert r["step"][0] == 0 and r["step"][-1] == n - 1  # the ends of the range are kept

    later = client.get(f"/api/v1/runs/{run['id']}/metrics", params={"after_step": n - 11, "names": "reward_mean"})
    assert later.json()["series"]["reward_mean"]["step"] == list(range(n - 10, n))

    csv = client.get(f"/api/v1/runs/{run['id']}/metrics.csv")
    assert csv.headers["content-type"].startswith("text/csv")
    lines = csv.text.splitlines()
    assert lines[0] == "step,name,value,time" and len(lines) == 1 + 2 * n
    assert any(line.startswith("2345,grad_norm,nan,") for line in lines)
    assert any(line.startswith("3456,grad_norm,inf,") for line in lines)


def test_a_long_series_is_downsampled_from_its_summary_keeping_spikes_nan_and_inf(web):
    """Long enough for the summary path (app/series.py bucket_extremes); the same guarantees as the full path."""
    run = new_run(web)
    n, special = 40_000, {12_345: 500.0, 23_456: None, 34_567: math.inf, 35_678: -math.inf, 39_999: -7.0}
    with web["records"].engine.begin() as c:   # None: SQLite's NULL, which is NaN
        c.exec_driver_sql("INSERT INTO metric (run_id, name, step, value, time) VALUES (?, 'grad_norm', ?, ?, ?)",
                          [(run["id"], i, special.get(i, 1.0 + (i % 7) * 0.01), 1e9 + i) for i in range(n)])
    with web["records"].engine.connect() as c:
        assert bucket_extremes(c, run["id"], "grad_norm", 0, enough=300) is not None  # the path under test
    url = f"/api/v1/runs/{run['id']}/metrics"
    for after_step, kept in [(None, special), (12_345 - 3, special), (12_345, {k: v for k, v in special.items()
                                                                               if k > 12_345})]:
        body = web["client"].get(url, params={"names": "grad_norm", "max_points": 300,
                                              **({"after_step": after_step} if after_step is not None else {})})
        g = body.json()["series"]["grad_norm"]
        assert body.json()["downsampled"] and len(g["step"]) <= 300
        assert g["step"] == sorted(set(g["step"])) and g["step"][0] > (after_step if after_step is not None else -1)
        values = dict(zip(g["step"], g["value"]))
        expected = {k: {None: "NaN", math.inf: "Infinity", -math.inf: "-Infinity"}.get(v, v) for k, v in kept.items()}
        assert {k: values.get(k) for k in kept} == expected
        assert all(values[s] == 1.0 + (s % 7) * 0.01 for s in values if s not in special)  # real rows only
        assert g["time"] == [1e9 + s for s in g["step"]]


# ---- websocket: backfill, then push ---------------------------------------------------------------------------------

def test_websocket_backfills_then_pushes_metrics_alerts_and_status(web):
    run = new_run(web)
    sink = sink_for(web, run["id"])
    for step in range(5):
        sink.metrics(step, {"reward_mean": step / 10, "version": float(step)})
    sink.close()
    wait_until(lambda: len(web["records"].metrics(run["id"], names=["reward_mean"])) == 5, 10)
    url = web["base"].replace("http", "ws") + f"/ws/runs/{run['id']}?after_step=1"

    async def scenario():
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
            got = []
            while not got or got[-1]["type"] != "backfilled":
                got.append(json.loads(await ws.recv()))
            backfill = {m["type"]: m for m in got}
            assert backfill["status"]["run"]["id"] == run["id"]
            assert backfill["metrics"]["series"]["reward_mean"]["step"] == [2, 3, 4]  # after_step=1
            live = sink_for(web, run["id"])
            live.metrics(5, {"reward_mean": 0.5, "version": 5.0})
            live.alert("breaker", "step 5: grad norm 1e3 above threshold 10", step=5)
            # rows committed just before the subscription may come again live (clients merge by step): wait for
            # the new ones
            wanted = {"metrics": lambda m: 5 in m["series"]["reward_mean"]["step"],
                      "alert": lambda m: m["alert"]["kind"] == "breaker",
                      "status": lambda m: m["run"]["step"] == 6 and m["run"]["alerts_open"] == 1}
            seen = set()
            while seen != set(wanted):  # how fast they come: bench/app_latency.py
                message = json.loads(await asyncio.wait_for(ws.recv(), 10))
                if message["type"] in wanted and wanted[message["type"]](message):
                    seen.add(message["type"])
            live.close()

    asyncio.run(scenario())


def test_unknown_run_closes_the_websocket_with_4404(web):
    async def scenario():
        url = web["base"].replace("http", "ws") + f"/ws/runs/999999?token={TOKEN}"
        async with websockets.connect(url) as ws:
            message = json.loads(await ws.recv())
            with pytest.raises(websockets.exceptions.ConnectionClosed) as e:
                await ws.recv()
            return message, e.value.rcvd.code
    message, code = asyncio.run(scenario())
    assert message["type"] == "error" and code == 4404


# ---- alerts: acknowledge, webhook -----------------------------------------------------------------------------------

def test_alert_webhook_posts_slack_compatible_json_and_acknowledging_clears_the_count(web, hook):
    run = new_run(web, name="hooked")
    sink = sink_for(web, run["id"])
    sink.alert("staleness", "step 7: staleness_max 5 above 4", step=7)
    sink.close()
    post = wait_until(lambda: [p for p in hook.received if p["body"]["alert"]["run_id"] == run["id"]], 10)[0]
    assert post["content_type"] == "application/json"
    assert "staleness" in post["body"]["text"] and "hooked" in post["body"]["text"]
    assert f"http://molt.example/runs/{run['id']}" in post["body"]["text"]
    client = web["client"]
    assert client.get(f"/api/v1/runs/{run['id']}").json()["alerts_open"] == 1
    alert = client.get(f"/api/v1/runs/{run['id']}/alerts").json()[0]
    assert client.post(f"/api/v1/runs/{run['id']}/alerts/{alert['id']}/ack").json()["acknowledged"] is True
    assert client.get(f"/api/v1/runs/{run['id']}").json()["alerts_open"] == 0
    assert client.get(f"/api/v1/runs/{run['id']}/alerts", params={"unacknowledged": True}).json() == []


def test_health_needs_no_token_and_envs_lists_the_builtins(web):
    response = httpx.get(web["base"] + "/api/v1/health")
    health = response.json()
    assert response.status_code == 503 and health["status"] == "degraded" and health["daemon"]["running"] is False
    names = [e["name"] for e in web["client"].get("/api/v1/envs").json()]
    assert {"max_digit", "calculator", "guess_number"} <= set(names)
    assert web["client"].get("/openapi.json").json()["paths"]["/api/v1/runs/{run_id}/metrics"]


def test_the_start_button_asks_a_molt_serve_and_without_one_says_what_to_run(web):
    home = web["records"].home
    response = web["client"].post("/api/v1/daemon/start")
    assert response.status_code == 409 and f"molt daemon start --home {home}" in response.json()["detail"]
    assert [e for e in web["records"].daemon_events() if e["kind"] == "start_requested"] == []


def test_a_resumed_run_rewriting_its_steps_pushes_the_new_values(web):
    """After a resume the engine records again the steps after its checkpoint: the rows change in place (same ids),
    which a viewer must still see, and the REST series must show the new values too."""
    run = new_run(web)
    first = sink_for(web, run["id"])
    for step in range(10):
        first.metrics(step, {"reward_mean": 0.0, "version": float(step)})
    first.close()
    before = web["client"].get(f"/api/v1/runs/{run['id']}/metrics", params={"names": "reward_mean"}).json()
    assert before["series"]["reward_mean"]["value"] == [0.0] * 10  # and now cached by the app
    url = web["base"].replace("http", "ws") + f"/ws/runs/{run['id']}?token={TOKEN}&after_step=9"

    async def scenario():
        async with websockets.connect(url) as ws:
            while json.loads(await ws.recv())["type"] != "backfilled":
                pass
            second = sink_for(web, run["id"])
            second.event("resumed", "resumed from step-000005: step 5", step=5)
            for step in range(5, 10):
                second.metrics(step, {"reward_mean": 1.0, "version": float(step)})
            second.close()
            rewritten = {}
            while len(rewritten) < 5:
                message = json.loads(await asyncio.wait_for(ws.recv(), 10))
                if message["type"] == "metrics" and "reward_mean" in message["series"]:
                    s = message["series"]["reward_mean"]
                    rewritten.update({st: v for st, v in zip(s["step"], s["value"]) if v == 1.0})
            return rewritten

    assert asyncio.run(scenario()) == {step: 1.0 for step in range(5, 10)}
    after = web["client"].get(f"/api/v1/runs/{run['id']}/metrics", params={"names": "reward_mean"}).json()
    assert after["series"]["reward_mean"]["value"] == [0.0] * 5 + [1.0] * 5


# ---- the runs list's edits: rename, notes, archive, delete ------------------------------------------------------------

def test_patch_renames_annotates_and_archives_and_delete_removes_an_ended_run_with_its_files(web):
    client, records = web["client"], web["records"]
    run = new_run(web, name="before")["id"]
    changed = client.patch(f"/api/v1/runs/{run}", json={"name": "after", "notes": "baseline", "archived": True})
    assert changed.status_code == 200, changed.text
    assert {k: changed.json()[k] for k in ("name", "notes", "archived")} == \
        {"name": "after", "notes": "baseline", "archived": True}
    assert client.patch(f"/api/v1/runs/{run}", json={"archived": False}).json()["name"] == "after"  # the rest stays
    for bad, field in [({"name": "  "}, "name"), ({"archived": "yes"}, "archived"), ({"colour": "red"}, "colour")]:
        answer = client.patch(f"/api/v1/runs/{run}", json=bad)
        assert answer.status_code == 422 and answer.json()["detail"][0]["loc"][-1] == field, answer.text
    assert client.patch("/api/v1/runs/999999", json={"notes": "x"}).status_code == 404

    # a queued or active run is refused, with the reason; an ended one goes with its records and files
    for status in ("queued", "running", "stopping"):
        with Session(records.engine) as s:
            s.get(models.Run, run).status = status
            s.commit()
        refused = client.delete(f"/api/v1/runs/{run}")
        assert refused.status_code == 409 and f"is {status}: stop it before deleting" in refused.json()["detail"]
    sink = sink_for(web, run)
    sink.metrics(0, {"reward_mean": 0.5, "eval_reward": 0.25})
    sink.alert("breaker", "spike", step=0)
    sink.close()
    assert client.get(f"/api/v1/runs/{run}").json()["best_eval"] == 0.25
    assert client.get(f"/api/v1/runs/{run}/metrics").json()["series"]["reward_mean"]["value"] == [0.5]  # cached
    with Session(records.engine) as s:
        s.get(models.Run, run).status = "completed"
        s.commit()
    (records.run_dir(run) / "final").mkdir(parents=True)
    (records.run_dir(run) / "final" / "model.safetensors").write_bytes(b"weights")
    assert client.delete(f"/api/v1/runs/{run}").status_code == 204
    assert client.get(f"/api/v1/runs/{run}").status_code == 404
    assert client.delete(f"/api/v1/runs/{run}").status_code == 404
    assert not records.run_dir(run).exists()
    with Session(records.engine) as s:
        for model in (models.Metric, models.MetricBucket, models.Alert, models.Event, models.Attempt):
            assert s.exec(select(model).where(model.run_id == run)).first() is None, model.__name__
    # its id is never given again (AUTOINCREMENT): a link to it never opens another run, nor its cached series
    assert new_run(web)["id"] > run
    assert client.get(f"/api/v1/runs/{run}/metrics").status_code == 404

    spec = client.get("/openapi.json").json()
    operations = spec["paths"]["/api/v1/runs/{run_id}"]
    assert {"get", "patch", "delete"} <= set(operations)
    assert operations["patch"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("RunPatch")
    assert "409" in operations["delete"]["responses"]
    assert {"notes", "archived", "best_eval"} <= set(spec["components"]["schemas"]["RunOut"]["properties"])


# ---- wide CSV, a bare config as the POST body, the HTML 404 page --------------------------------------------------

def test_the_wide_csv_has_one_row_per_step_and_one_column_per_metric(web):
    run = new_run(web)
    sink = sink_for(web, run["id"])
    n = 3400  # 3 names x 3400 steps: a step's rows straddle the endpoint's 10,000-row chunks
    for step in range(n):
        sink.metrics(step, {"a": float(step), "c": -math.inf if step == 7 else 0.5,
                            **({} if step == 3333 else {"b": math.nan if step == 2 else step / 2})})
    sink.close()
    response = web["client"].get(f"/api/v1/runs/{run['id']}/metrics.csv", params={"format": "wide"})
    assert response.headers["content-type"].startswith("text/csv")
    assert f"run-{run['id']}-metrics-wide.csv" in response.headers["content-disposition"]
    lines = response.text.splitlines()
    assert lines[0] == "step,a,b,c" and len(lines) == 1 + n
    assert lines[1:4] == ["0,0.0,0.0,0.5", "1,1.0,0.5,0.5", "2,2.0,nan,0.5"] and lines[8] == "7,7.0,3.5,-inf"
    assert lines[1 + 3333] == "3333,3333.0,,0.5" and lines[-1] == f"{n - 1},{n - 1.0},{(n - 1) / 2},0.5"
    long = web["client"].get(f"/api/v1/runs/{run['id']}/metrics.csv").text.splitlines()
    assert long[0] == "step,name,value,time" and len(long) == 1 + 3 * n - 1  # the default stays long
    assert web["client"].get(f"/api/v1/runs/{run['id']}/metrics.csv", params={"format": "tall"}).status_code == 422


def test_post_runs_takes_a_bare_config_as_the_whole_body(web):
    client = web["client"]
    bare = client.post("/api/v1/runs", json={"env": "max_digit", "loop": {"steps": 7}})
    assert bare.status_code == 201, bare.text
    run = bare.json()
    assert run["config"]["env"] == "max_digit" and run["total_steps"] == 7 and run["max_restarts"] == 3
    bad = client.post("/api/v1/runs", json={"env": "max_digit", "loop": {"steps": -5}})
    assert bad.status_code == 422 and [e["loc"] for e in bad.json()["detail"]] == [["body", "config", "loop", "steps"]]
    wrapped = client.post("/api/v1/runs", json={"config": {"env": "max_digit"}, "name": "wrapped"})
    assert wrapped.status_code == 201 and wrapped.json()["name"] == "wrapped"
    body = client.get("/openapi.json").json()["components"]["schemas"]["RunBody"]
    assert {"$ref": "#/components/schemas/RunConfig"} in body["anyOf"] and {"env": "max_digit"} in body["examples"]


def test_a_missing_page_is_an_html_page_while_the_api_keeps_json_404s(web):
    browser, _ = logged_in(web)
    for path, says in [("/no/such/page", "There is no page at /no/such/page"), ("/runs/999999", "no run 999999")]:
        page = browser.get(path)
        assert page.status_code == 404 and page.headers["content-type"].startswith("text/html")
        assert "Page not found" in page.text and says in page.text and 'href="/runs/new"' in page.text
        assert '<link rel="icon" type="image/png" href="/static/vendor/favicon.png">' in page.text
    assert 'rel="icon"' in browser.get("/").text and 'rel="icon"' in browser.get("/runs/new").text
    icon = browser.get("/static/vendor/favicon.png")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/png"
    for path in ["/api/v1/runs/999999", "/api/v1/no-such-route", "/static/no-such-file.css"]:
        response = web["client"].get(path)
        assert response.status_code == 404 and response.headers["content-type"] == "application/json", path
    stranger = httpx.get(web["base"] + "/no/such/page")  # not signed in: the page says so, with no log out
    assert stranger.status_code == 404 and "Page not found" in stranger.text and "log out" not in stranger.text
