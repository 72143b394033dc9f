"""The dashboard at a glance (issue 67), in Chromium over a real SQLite file with runs written as their workers would
write them: no console error on any page, one duration everywhere, axes that show the data and one meaning of step,
a run page and compare that do not jump."""
import time

import httpx
import pytest
from playwright.sync_api import expect
from sqlmodel import Session

from app_support import web_thread
from daemon.db import set_run
from daemon.eval_records import EvalRequest, queue_eval
from daemon.models import Alert, Attempt, Event, Metric
from daemon.records import Records
from daemon.sweep_tick import tick_sweeps
from daemon.sweeps import SweepRequest
from test_sweeps import GRID, record

TOKEN = "ui-trust-token"
CONFIG = {"env": "max_digit", "warm_start": {"steps": 5}, "checkpoint": {"every": 0},
          "loop": {"steps": 40, "groups_per_step": 2, "group_size": 4, "eval_every": 10, "eval_episodes": 2}}


def write_run(records: Records, name: str, status: str, steps: int, attempts: list[tuple[float, float | None]],
              extra: dict[str, dict[int, float]] | None = None, config: dict = CONFIG, tags=None) -> int:
    """A run as its worker would have recorded it: train metrics at steps 0..steps-1, an eval every 10 steps done,
    its attempts (start, end), then its status."""
    run_id = records.create_run(config, name=name, tags=tags)["id"]
    with Session(records.engine) as s:
        for i, (start, end) in enumerate(attempts):
            s.add(Attempt(run_id=run_id, number=i + 1, started_at=start, ended_at=end))
        t0 = attempts[0][0] if attempts else time.time()
        series = {"reward_mean": {step: 0.1 + step / 100 for step in range(steps)},
                  "grad_norm": {step: 1.0 + step % 3 for step in range(steps)},
                  "loss": {step: 1 / (1 + step) for step in range(steps)},
                  "eval_reward": {step: 0.2 + step / 100 for step in range(10, steps + 1, 10)}}
        for name, values in (extra or {}).items():
            series[name] = {**series.get(name, {}), **values}
        for name, values in series.items():
            for step, v in values.items():
                s.add(Metric(run_id=run_id, name=name, step=step, value=v, time=t0 + step))
        set_run(s, run_id, None, status=status, step=steps,
                started_at=attempts[0][0] if attempts else None,
                finished_at=attempts[-1][1] if attempts and status not in ("running", "queued") else None)
        s.commit()
    return run_id


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    records = Records(home)
    now = time.time()
    runs = {
        "queued": write_run(records, "queued-one", "queued", 0, []),
        "running": write_run(records, "running-one", "running", 12, [(now - 60, None)]),
        "stopped": write_run(records, "stopped-one", "stopped", 20, [(now - 900, now - 800)]),
        # two attempts of 100 s each, an hour apart: 200 s of training, 3,800 s of wall clock
        "completed": write_run(records, "completed-one", "completed", 40,
                               [(now - 4000, now - 3900), (now - 300, now - 200)], tags=["spike", "ux"]),
        "tripped": write_run(records, "tripped-one", "tripped", 31, [(now - 500, now - 400)],
                             extra={"breaker_threshold": {s: 1.1e9 for s in range(31)},
                                    "breaker_tripped": {s: float(s == 30) for s in range(31)},
                                    "grad_norm": {30: 1000.0}}),
    }
    with Session(records.engine) as s:
        s.add(Alert(run_id=runs["tripped"], step=30, kind="breaker", message="grad_norm 1000 above 1.1e9 at step 30"))
        s.add(Event(run_id=runs["running"], kind="started", source="daemon", message="attempt 1 started"))
        s.commit()
    sweep = records.queue_sweep(SweepRequest.model_validate(GRID))
    tick_sweeps(records.engine, lambda _s: 8)
    for r in records.get_sweep(sweep["id"])["runs"]:
        record(records, r["id"], [0.1, 0.3, 0.2])
    tick_sweeps(records.engine, lambda _s: 8)
    evaluation = queue_eval(records.engine, home, EvalRequest.model_validate(
        {"model": {"preset": "tiny-dense"}, "env": "max_digit", "episodes": 2}))
    with web_thread(home, TOKEN) as (base, app):
        yield {"base": base, "runs": runs, "sweep": sweep["id"], "eval": evaluation["id"], "records": records,
               "app": app}


def watch_errors(page) -> list[str]:
    errors = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
    return errors


def settle_run_page(page):
    """The backfill handled and the overview strip redrawn after it (it redraws every second)."""
    page.wait_for_function("window.__molt && window.__molt.messages >= 5")
    page.wait_for_function("(n) => window.__molt.overviews > n", arg=page.evaluate("window.__molt.overviews || 0") + 1)


def test_no_console_error_on_any_page(site, page):
    """Item 1: the websocket backfill's status once had no attempts; the page copied that over its own and every run
    page threw in clock(); ELAPSED and BEST EVAL stayed blank."""
    errors = watch_errors(page)
    page.goto(f"{site['base']}/?token={TOKEN}")
    expect(page.locator("table.runs tbody tr").first).to_be_visible()
    runs = site["runs"]
    for status, run_id in runs.items():
        page.goto(f"{site['base']}/runs/{run_id}")
        settle_run_page(page)
        assert errors == [], (status, errors)
        if status != "queued":
            assert page.locator("#ov-elapsed").text_content() != "—", status
            expect(page.locator("#ov-best")).to_contain_text("at step")
    ids = ",".join(map(str, runs.values()))
    for path in [f"/compare?ids={ids}", f"/compare?ids={ids}&group=tag", "/evals", f"/evals/{site['eval']}/samples",
                 f"/runs/{runs['completed']}/samples", "/sweeps", f"/sweeps/{site['sweep']}", "/runs/new",
                 f"/sweeps/new?run_id={runs['completed']}"]:
        page.goto(f"{site['base']}{path}")
        page.wait_for_load_state("networkidle")
        assert errors == [], (path, errors)


def test_one_duration_on_every_page_and_in_the_api(site, page):
    """Item 2: the runs list showed wall clock (end - start: 1:03:20 here), the run page and compare training time."""
    run_id = site["runs"]["completed"]
    client_run = site["records"].get_run(run_id)
    assert client_run["duration_s"] == pytest.approx(200)
    page.goto(f"{site['base']}/?token={TOKEN}")
    expect(page.locator(f"tr[data-run-id='{run_id}'] td.duration")).to_have_text("0:03:20")
    page.goto(f"{site['base']}/compare?ids={run_id}")
    expect(page.locator("td.duration").first).to_have_text("0:03:20")
    page.goto(f"{site['base']}/runs/{run_id}")
    settle_run_page(page)
    expect(page.locator("#ov-elapsed")).to_have_text("3m 20s")
    # the API says the same, and sorting by duration follows it: 100 s (stopped) < 200 s (completed) < ...
    api = httpx.get(f"{site['base']}/api/v1/runs/{run_id}", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert api["duration_s"] == pytest.approx(200)
    page.goto(f"{site['base']}/?sort=duration&order=asc")
    names = page.locator("table.runs tbody tr td.duration").all_text_contents()
    seconds = [sum(int(x) * m for x, m in zip(t.split(":"), (3600, 60, 1))) for t in names if t != "—"]
    assert seconds == sorted(seconds) and 200 in seconds, names
