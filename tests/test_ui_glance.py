"""The last of issue 67 in Chromium, over a real SQLite file: every recorded metric findable by its name, the
trainer's rss_gb in one chart (the worker's sampled system/rss_gb where the run has one, its own chart where not), the
system charts on wall time and unsmoothed, and the new-sweep form's labels in line with their fields at 1440 and 390 px."""
import time

import pytest
from playwright.sync_api import expect
from sqlmodel import Session

from app_support import web_thread
from daemon.models import Metric
from daemon.records import Records
from test_ui_trust import settle_run_page, write_run

TOKEN = "ui-glance-token"
STEPS = range(12)


def sample(records: Records, run_id: int, t0: float, steps) -> list[float]:
    """The worker's system samples, as daemon/system.py records them: every few seconds, at the run's current step
    (their times are not the steps': the chart must place them by time). Returns their times."""
    times = [t0 + 0.5 + 3 * step for step in steps]
    with Session(records.engine) as s:
        for step, t in zip(steps, times):
            s.add(Metric(run_id=run_id, name="system/rss_gb", step=step, value=1.5 + step / 50, time=t))
            s.add(Metric(run_id=run_id, name="system/cpu_percent", step=step, value=90.0 + step % 4, time=t))
        s.commit()
    return times


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    records = Records(home)
    now = time.time()
    rss = {"rss_gb": {s: 1.0 + s / 100 for s in STEPS}}
    runs = {"sampled": write_run(records, "sampled", "completed", 12, [(now - 100, now - 50)], extra=rss),
            "unsampled": write_run(records, "unsampled", "completed", 12, [(now - 100, now - 50)], extra=rss),
            "live": write_run(records, "live", "running", 12, [(now - 60, None)], extra=rss)}
    times = sample(records, runs["sampled"], now - 100, range(1, 13))
    with web_thread(home, TOKEN) as (base, _app):
        yield {"base": base, "runs": runs, "records": records, "times": times, "now": now}


def plot(page, chart: str, expression: str):
    return page.evaluate(f"(() => {{ const u = document.getElementById('chart-{chart}').plot; return {expression}; }})()")


def test_rss_gb_is_one_chart_and_the_system_charts_are_on_wall_time_unsmoothed(site, page):
    """Item 10: rss_gb was charted twice (the trainer's in Memory, the worker's sample in System); the system charts
    were drawn per step (a slow step's samples stacked on one x) and smoothed like the training metrics."""
    base, runs = site["base"], site["runs"]
    page.goto(f"{base}/runs/{runs['sampled']}?token={TOKEN}")
    settle_run_page(page)
    memory = page.locator("#charts .chart[data-metrics~='rss_gb']")
    expect(memory).to_have_count(1)
    expect(memory).to_have_attribute("data-metrics", "system/rss_gb rss_gb")
    expect(page.locator("#section-system [id='chart-system/rss_gb']")).to_be_visible()
    expect(page.locator("#chart-rss_gb")).to_have_count(0)
    # wall time on x: the samples where they were taken, the trainer's line beside them; raw by default
    assert plot(page, "system/rss_gb", "[u.axes[0].label, u.scales.x.time]") == ["wall time", True]
    xs, sampled = plot(page, "system/rss_gb", "[u.data[0], u.data[1]]")
    assert [x for x, v in zip(xs, sampled) if v is not None] == pytest.approx(site["times"])
    assert plot(page, "system/rss_gb", "u.series.slice(1).map((s) => s.smooth)") == [False, False]
    assert plot(page, "system/cpu_percent", "[u.axes[0].label, u.series[1].smooth]") == ["wall time", False]
    expect(page.locator("[id='chart-system/cpu_percent'] input[name=smooth]")).to_have_value("0")
    # the training metrics keep the page's view (step, smoothed), and a cursor of their own
    assert plot(page, "reward_mean", "[u.axes[0].label, u.series[1].smooth]") == ["step", True]
    keys = [plot(page, c, "u.cursor.sync.key") for c in ("reward_mean", "system/rss_gb")]
    assert keys[0] != keys[1], keys
    page.select_option("#view select[name=x]", "elapsed")  # another time axis: the system charts follow the page
    page.wait_for_function("document.getElementById('chart-system/rss_gb').plot.axes[0].label === 'elapsed (min)'")

    page.goto(f"{base}/runs/{runs['unsampled']}")  # no system metrics: rss_gb keeps its own chart, in Memory
    settle_run_page(page)
    expect(page.locator("#section-memory #chart-rss_gb")).to_be_visible()
    assert plot(page, "rss_gb", "u.axes[1].label") == "rss_gb (GB)"
    expect(page.locator("#section-system")).to_be_hidden()


def test_rss_gb_joins_the_system_chart_when_the_first_sample_arrives(site, page):
    """A running run's page made rss_gb's own chart before the worker's first system sample: that chart gives way."""
    run_id = site["runs"]["live"]
    page.goto(f"{site['base']}/runs/{run_id}?token={TOKEN}")
    settle_run_page(page)
    expect(page.locator("#section-memory #chart-rss_gb")).to_be_visible()
    sample(site["records"], run_id, site["now"] - 60, range(12, 14))
    expect(page.locator("#section-system [id='chart-system/rss_gb']")).to_be_visible(timeout=10_000)
    expect(page.locator("#chart-rss_gb")).to_have_count(0)
    expect(page.locator("[id='chart-system/rss_gb']")).to_have_attribute("data-metrics", "system/rss_gb rss_gb")
    expect(page.locator("#section-memory")).to_be_hidden()


FINDABLE = """(name) => [...document.querySelectorAll('#charts .chart')].some((c) => c.checkVisibility() &&
  c.innerText.includes(name)) || document.getElementById('folded').innerText.includes(name)"""


def test_every_recorded_metric_is_findable_by_its_name(site, page):
    """Item 10: 6 of the 40 metrics a max_digit run records were nowhere on its page, not even by name (the counters
    that stayed 0, and the breaker's two joined into grad_norm)."""
    steps = range(12)
    extra = {**{n: {s: 0.0 for s in steps} for n in ("tool_call_rate", "tool_errors")},
             **{n: {10: 0.0} for n in ("eval_tool_call_rate", "eval_tool_errors")},
             "breaker_threshold": {s: 50.0 + s for s in steps}, "breaker_tripped": {s: 0.0 for s in steps},
             "rss_gb": {s: 1.0 + s / 100 for s in steps}, "system/rss_gb": {s: 1.1 + s / 100 for s in range(1, 13)}}
    now = time.time()
    run_id = write_run(site["records"], "every-name", "completed", 12, [(now - 100, now - 50)], extra=extra)
    names = sorted({m["name"] for m in site["records"].metrics(run_id)})
    assert {"tool_errors", "eval_tool_call_rate", "breaker_tripped", "rss_gb", "entropy"} <= set(names)
    page.goto(f"{site['base']}/runs/{run_id}?token={TOKEN}")
    settle_run_page(page)
    missing = [n for n in names if not page.evaluate(FINDABLE, n)]
    assert missing == [], missing
    expect(page.locator("#folded")).to_contain_text("tool_errors = 0")
    for name in ("tool_call_rate", "breaker_threshold", "rss_gb"):  # and by the filter
        page.locator("input[name=q]").fill(name)
        page.wait_for_function(FINDABLE, arg=name)


# each short field of the new-sweep form: its label's box, its text's box, its control's box
FIELDS = """() => [...document.querySelectorAll('#new-sweep .controls label')].map((label) => {
  const control = label.querySelector('input, select'), text = document.createRange();
  text.selectNodeContents(label); text.setEndBefore(control);
  const box = (r) => ({x: r.x, y: r.y, right: r.right, bottom: r.bottom, height: r.height});
  return {name: control.name, label: box(label.getBoundingClientRect()), text: box(text.getBoundingClientRect()),
          control: box(control.getBoundingClientRect())};
})"""


@pytest.mark.parametrize("width", [1440, 390])
def test_the_new_sweep_forms_labels_line_up_with_their_fields(site, browser, width):
    """Item 6: the form's labels were misaligned: each label ran inline into its field, so that the fields started
    wherever their label ended (a ragged column at 390 px), selects 2 px shorter than inputs, a wrapping row."""
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    page.goto(f"{site['base']}/sweeps/new?run_id={site['runs']['sampled']}&token={TOKEN}")
    fields = page.evaluate(FIELDS)
    assert [f["name"] for f in fields] == ["name", "method", "runs", "seeds", "metric", "goal"]
    params = page.locator("textarea[name=params]").bounding_box()
    rows = {}
    for f in fields:
        label, text, control = f["label"], f["text"], f["control"]
        assert abs(text["x"] - control["x"]) < 1 and abs(label["x"] - control["x"]) < 1, f  # one left edge
        assert abs(label["right"] - control["right"]) < 1, f  # the field as wide as its label
        assert text["bottom"] <= control["y"] + 1, f  # the label's text above its field, not beside it
        rows.setdefault(round(control["y"]), []).append(f)
    heights = {round(f["control"]["height"]) for f in fields}
    assert len(heights) == 1, heights  # inputs and selects alike
    for row in rows.values():  # a row's fields and their labels' text on one line, starting at the page's edge
        assert len({round(f["text"]["y"]) for f in row}) == 1, row
        assert abs(row[0]["control"]["x"] - params["x"]) < 1, (row[0], params)
        assert row[-1]["control"]["right"] <= params["x"] + params["width"] + 1, (row[-1], params)
    columns = [round(f["control"]["x"]) for f in rows[min(rows)]]
    for row in rows.values():  # and one grid: every row's fields start at the first row's columns
        assert [round(f["control"]["x"]) for f in row] == columns[:len(row)], (row, columns)
    assert len(rows) == (1 if width == 1440 else 3), sorted(rows)
    assert page.evaluate("document.scrollingElement.scrollWidth") <= width
    context.close()
