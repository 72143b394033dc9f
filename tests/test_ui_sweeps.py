"""The sweep page in Chromium, on a finished 2x2 grid with 2 seeds whose runs' records are written into a real SQLite
file: the runs table best first and sortable, the parallel-coordinates chart, a scatter of the score per param (axe
finds no serious problem), compare for a selection, the link from a run's page."""
import random
import re
import statistics

import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import expect

from app_support import web_thread
from conftest import screenshot, watch_errors
from daemon.records import Records
from daemon.sweep_tick import tick_sweeps
from app.sweeps import scatters
from daemon.sweeps import SweepRequest
from test_sweeps import GRID, record

TOKEN = "ui-sweep-token"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    records = Records(home)
    sweep = records.queue_sweep(SweepRequest.model_validate(GRID))
    tick_sweeps(records.engine, lambda _s: 8)
    rng = random.Random(11)
    written = {}
    for r in records.get_sweep(sweep["id"])["runs"]:
        written[r["id"]] = [rng.random() for _ in range(3)]
        record(records, r["id"], written[r["id"]])
    tick_sweeps(records.engine, lambda _s: 8)
    with web_thread(home, TOKEN) as (base, _app):
        yield base, records.get_sweep(sweep["id"]), written, home


def test_the_sweep_page_lists_runs_best_first_charts_them_and_compares_a_selection(finished, page):
    base, sweep, written, _home = finished
    page.goto(f"{base}/sweeps?token={TOKEN}")
    page.get_by_role("link", name="lr-x-group").click()
    rows = page.locator("#sweep-runs tbody tr")
    expect(rows).to_have_count(8)
    for r in sweep["runs"]:  # named by their values (item 6: `lr-x-group-p0-s0` hid them), in a name column 8rem wide
        lr = {1e-3: "1e-3", 3e-3: "3e-3"}[r["params"]["algo.lr"]]
        assert r["name"] == f"lr-x-group lr={lr} group_size={r['params']['loop.group_size']} s{r['seed']}"
        expect(page.locator(f"#sweep-run-{r['id']} td.name")).to_have_text(f"#{r['id']} {r['name']}")
    widths = rows.first.locator("td").evaluate_all("(tds) => tds.slice(0, 2).map((td) => getComputedStyle(td).minWidth)")
    assert widths == ["0px", "128px"], widths  # the name column, not the checkbox column
    means = {p: statistics.fmean(max(written[r["id"]]) for r in sweep["runs"] if r["sweep_point"] == p)
             for p in {r["sweep_point"] for r in sweep["runs"]}}  # each point's mean over its seeds of their best
    best_point = max(means, key=means.get)
    best_runs = {f"sweep-run-{r['id']}" for r in sweep["runs"] if r["sweep_point"] == best_point}
    assert {rows.nth(0).get_attribute("id"), rows.nth(1).get_attribute("id")} == best_runs
    expect(page.locator("#sweep-best")).to_contain_text(f"score {means[best_point]:.4g}")
    expect(page.locator("#parallel polyline")).to_have_count(8)
    expect(page.locator("#parallel polyline[stroke='#d9480f']")).to_have_count(2)
    expect(page.locator("#parallel text", has_text="algo.lr")).to_have_count(1)
    scatters = page.locator("#scatters svg.scatter")
    expect(scatters).to_have_count(len(GRID["params"]))  # one per param, named for it, a dot per run and per point
    for i, key in enumerate(GRID["params"]):
        scatter = page.get_by_role("img", name=f"score against {key}", exact=True)
        expect(scatter).to_have_attribute("data-param", key)
        expect(scatter.locator("circle.run")).to_have_count(8)
        expect(scatter.locator("circle.point")).to_have_count(4)
        expect(scatter.locator("circle.point.best")).to_have_attribute("data-point", str(best_point))
        expect(scatter.locator("circle.run[fill='#d9480f']")).to_have_count(2)
    violations = [v["id"] for v in Axe().run(page).response["violations"] if v["impact"] in ("serious", "critical")]
    assert violations == []
    screenshot(page, "sweep-page.png")

    page.get_by_role("link", name="seed").click()  # sorted by seed: the four seed-0 runs first
    expect(rows.nth(3).locator("td").nth(4)).to_have_text(str(min(r["seed"] for r in sweep["runs"])))
    expect(rows.nth(4).locator("td").nth(4)).to_have_text(str(max(r["seed"] for r in sweep["runs"])))

    first, second = sweep["runs"][0]["id"], sweep["runs"][-1]["id"]
    page.get_by_label(f"compare run {first}", exact=True).check()
    page.get_by_label(f"compare run {second}", exact=True).check()
    page.get_by_role("button", name="Compare selected").click()
    expect(page).to_have_url(f"{base}/compare?ids={first}&ids={second}")

    page.goto(f"{base}/?tag=lr-x-group")  # the runs list says the same names
    expect(page.locator("table.runs tbody tr[data-run-id]")).to_have_count(8)
    assert sorted(page.locator("table.runs tbody tr[data-run-id]").evaluate_all("(trs) => trs.map((t) => t.dataset.name)")) \
        == sorted(r["name"] for r in sweep["runs"])
    expect(page.locator(f"tr[data-run-id='{first}'] td a").first).to_have_text(sweep["runs"][0]["name"])

    page.goto(f"{base}/runs/{first}")
    expect(page.locator("#ov-sweep a")).to_have_attribute("href", f"/sweeps/{sweep['id']}")


def column(rows, index: int) -> list[float]:
    return [float(t) for t in rows.locator(f"td:nth-child({index + 1})").all_text_contents() if t.strip()]


def test_the_score_arrows_say_the_order_and_the_chart_names_each_runs_values(finished, page):
    """Issue 67 item 6: "score ▲" stood over a best-first (descending) order of the point scores, the run scores
    in no order at all; the chart's lines said only "run #4"."""
    base, sweep, _, _home = finished
    page.goto(f"{base}/sweeps/{sweep['id']}?token={TOKEN}")
    rows = page.locator("#sweep-runs tbody tr")
    expect(page.locator("#sweep-runs th a", has_text="point score")).to_have_text("point score ▼")
    points = column(rows, 7)
    assert len(points) == 8 and points == sorted(points, reverse=True)
    page.locator("#sweep-runs th a", has_text="score").first.click()
    expect(page.locator("#sweep-runs th a").filter(has_text=re.compile("^score"))).to_have_text("score ▼")
    scores = column(rows, 6)
    assert len(scores) == 8 and scores == sorted(scores, reverse=True) and scores != column(rows, 7)
    page.locator("#sweep-runs th a").filter(has_text=re.compile("^score")).click()
    expect(page.locator("#sweep-runs th a").filter(has_text=re.compile("^score"))).to_have_text("score ▲")
    assert column(rows, 6) == sorted(scores)
    run = sweep["runs"][0]
    title = page.locator(f"#parallel polyline[data-run='{run['id']}'] title")
    expect(title).to_contain_text(f"{run['name']}: algo.lr={run['params']['algo.lr']:.3g}, loop.group_size=")
    expect(page.locator("#sweep-untrained")).to_contain_text("not the eval at step 0")


def test_a_running_sweep_page_updates_itself_and_stops_polling_once_it_ended(finished, page):
    """Issue 67 item 6: the page was static (reload to watch). It polls while the sweep runs, keeps what is checked,
    and stops once the sweep has ended."""
    base, _sweep, _, home = finished
    records = Records(home)
    live = records.queue_sweep(SweepRequest.model_validate({**GRID, "name": "live", "seeds": 1}))
    tick_sweeps(records.engine, lambda _s: 8)
    runs = [r["id"] for r in records.get_sweep(live["id"])["runs"]]
    errors = watch_errors(page)  # none either while the data arrives and the page swaps itself
    page.goto(f"{base}/sweeps/{live['id']}?token={TOKEN}")
    expect(page.locator("#sweep-live")).to_have_attribute("hx-trigger", re.compile("every"))
    page.get_by_label(f"compare run {runs[1]}", exact=True).check()
    record(records, runs[0], [0.25, 0.75], status="running")
    score = page.locator(f"#sweep-run-{runs[0]} td:nth-child(7)")
    expect(score).to_have_text("0.75", timeout=15_000)
    expect(page.locator(f"#sweep-run-{runs[0]} td:nth-child(6)")).to_have_text("running")
    expect(page.get_by_label(f"compare run {runs[1]}", exact=True)).to_be_checked()
    for run_id in runs:
        record(records, run_id, [0.5], first_step=3)
    tick_sweeps(records.engine, lambda _s: 8)
    expect(page.locator("#sweep-summary")).to_contain_text("completed", timeout=15_000)
    expect(page.locator("#sweep-live")).not_to_have_attribute("hx-trigger", re.compile("."))
    expect(page.locator("#sweep-live")).to_have_attribute("data-status", "completed")
    assert errors == [], errors


def test_a_sweep_starts_from_a_runs_config_in_the_dashboard_and_a_bad_range_is_named(finished, page):
    base, sweep, _, _home = finished
    run_id = sweep["runs"][0]["id"]
    page.goto(f"{base}/runs/{run_id}?token={TOKEN}")
    page.locator("#actions a", has_text="Sweep…").click()
    expect(page.locator("textarea[name=config]")).to_contain_text('"max_digit"')
    page.get_by_label("name", exact=True).fill("from-form")  # the config textarea's JSON says "name" too
    page.get_by_label("params").fill('{"algo.lr": {"values": [0.001, -1.0]}}')
    page.get_by_role("button", name="Start the sweep").click()
    expect(page.locator("#new-sweep .error")).to_contain_text("params.algo.lr: algo.lr=-1.0")
    page.get_by_label("params").fill('{"algo.lr": {"values": [0.001, 0.002]}}')
    page.get_by_role("button", name="Start the sweep").click()
    expect(page.locator("h1")).to_contain_text("Sweep from-form")
    expect(page.locator("#sweep-summary")).to_contain_text("running · grid")


def test_a_param_spanning_decades_is_placed_on_a_log_axis(finished):
    _base, sweep, _, _home = finished
    lrs = {0: 1e-5, 1: 1e-4, 2: 1e-3, 3: 1e-2}  # three decades: evenly spaced
    wide = {**sweep, "runs": [{**r, "params": {**r["params"], "algo.lr": lrs[r["sweep_point"]]}} for r in sweep["runs"]],
            "points": [{**p, "params": {**p["params"], "algo.lr": lrs[p["point"]]}} for p in sweep["points"]]}
    lr, group = scatters(wide, list(GRID["params"]))
    assert (lr["log"], group["log"]) == (True, False)
    x = sorted(p["xy"][0] for p in lr["points"])
    gaps = [b - a for a, b in zip(x, x[1:])]
    assert max(gaps) - min(gaps) < 0.2 and min(gaps) > 50
    assert [label for _x, label in lr["x_ticks"]] == ["1e-05", "0.01"]
