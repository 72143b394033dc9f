"""The run page in Chromium on one finished small run (`molt serve`, real training, evals and a breaker trip): every
recorded metric charted in its section, a filter box, readable charts (axis titles, x name in the legend, one legend
entry per line, sparse series with points, per-chart log scale and smoothing, flat ranges, synced hover, elapsed x,
the trip marker), two eval suites charted apart in their own section, and the overview strip with alerts and recent
events above the charts."""
import re

import pytest
from playwright.sync_api import expect

from app_support import FAST, serve
from conftest import screenshot, wait_until

# evals every 4 steps, with two eval suites; one gradient spike (step 7, over abs_max) trips the breaker once, which
# neither rolls back nor ends the run
SUITES = [{"name": "digits", "env": "max_digit", "episodes": 4}, {"name": "calc", "env": "calculator", "episodes": 4}]
RUN = {**FAST, "loop": {**FAST["loop"], "steps": 12, "eval_every": 4}, "drills": {"spike_at": [7]},
       "breaker": {"min_history": 3, "abs_max": 100}, "eval": {"suites": SUITES, "best": "digits/eval_reward"}}
# names a text run on a CPU records as 0 (chat counters, a suite's too) or never (GPU memory): no chart for them


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("home")) as served:
        run = served.create(RUN, name="charts")
        assert served.wait(run["id"], timeout=300)["status"] == "completed"
        series = served.client.get(f"/api/v1/runs/{run['id']}/metrics").json()["series"]
        yield served, run["id"], series


def open_run(page, finished, query=""):
    served, run_id, series = finished
    page.goto(served.url)
    page.goto(served.base + f"/runs/{run_id}{query}")
    expect(page.locator("#conn")).to_have_attribute("data-state", "live")
    # the backfill has arrived once the reward chart holds every step
    wait_until(lambda: page.locator("#chart-reward_mean").get_attribute("data-points") == "12", 30,
               message="12 reward points")


def visible_metrics(page) -> set[str]:
    return set(page.evaluate("""[...document.querySelectorAll('.chart')].filter((c) => c.offsetParent !== null)
                                .flatMap((c) => (c.dataset.metrics || '').split(' ').filter(Boolean))"""))


def constant_metrics(page) -> set[str]:
    """The metrics folded into the "constant" line (one value at every step) instead of a flat chart."""
    return set(page.evaluate("""[...document.querySelectorAll('.folded-constant button')]
                                .flatMap((b) => document.getElementById(`chart-${b.dataset.chart}`).dataset.metrics.split(' '))"""))


def test_every_recorded_metric_is_charted_in_its_section_and_the_filter_hides_the_rest(finished, page):
    _, _, series = finished
    open_run(page, finished)
    charted = set(series)  # a chat or GPU counter that stayed 0 has no chart, but a place in the constant line
    assert len(charted) >= 30, sorted(series)
    wait_until(lambda: visible_metrics(page) | constant_metrics(page) == charted, 10,
               message="a visible chart, or a place in the constant line, for each recorded metric")
    constants = constant_metrics(page)
    assert constants and not constants & visible_metrics(page)
    for name in constants:  # a constant metric is listed with its one value
        assert len(set(series[name]["value"])) == 1 and len(series[name]["value"]) >= 3
    # those that were only in the CSV/JSON before, each in a chart of its own (or the constant line)
    for name in ("pass_rate", "reward_std", "clip_ratio", "kl_ref", "lr", "eval_pass_rate", "stale_episodes_dropped",
                 "trainer_idle_ratio", "sampler_idle_ratio", "trained_fraction"):
        if name not in constants:
            expect(page.locator(f"#chart-{name}")).to_be_visible()
    # no chat chart on a text run, no GPU chart on a CPU run, no MoE section for a dense policy
    assert series["tool_errors"]["value"] and not any(series["tool_errors"]["value"])
    expect(page.locator("#chart-tool_errors")).to_be_hidden()
    assert not [n for n in visible_metrics(page) if n.startswith("gpu_")]
    expect(page.locator("#section-moe")).to_be_hidden()
    # sections by name
    for section, name in [("reward", "reward_mean"), ("reward", "eval_reward"), ("loss", "policy_loss"),
                          ("loss", "grad_norm"), ("staleness", "staleness_mean"), ("throughput", "samples_per_s"),
                          ("env", "response_length")]:
        chart = page.locator(f"#section-{section} #chart-{name}")
        expect(chart).to_have_count(1)
        if name not in constants:
            expect(chart).to_be_visible()
    # the trainer's rss_gb in one chart: the worker's system/rss_gb where the daemon sampled it, else its own in Memory
    memory = page.locator(".chart[data-metrics~='rss_gb']")
    expect(memory).to_have_count(1)
    section, names = ("system", "system/rss_gb rss_gb") if "system/rss_gb" in series else ("memory", "rss_gb")
    expect(page.locator(f"#section-{section} .chart[data-metrics~='rss_gb']")).to_have_attribute("data-metrics", names)

    page.fill("#view input[name=q]", "loss")
    shown = page.locator(".chart:visible")
    expect(page.locator("#chart-policy_loss")).to_be_visible()
    expect(page.locator("#chart-reward_mean")).to_be_hidden()
    expect(page.locator("#section-reward")).to_be_hidden()
    assert shown.count() >= 1 and all("loss" in (shown.nth(i).get_attribute("data-metrics") or "")
                                      for i in range(shown.count()))
    assert "q=loss" in page.url
    page.fill("#view input[name=q]", "")
    expect(page.locator("#chart-reward_mean")).to_be_visible()
    screenshot(page, "run-page-all-metrics.png")


def plot(page, name: str, expression: str):
    return page.evaluate(f"(() => {{ const u = document.getElementById('chart-{name}').plot; return {expression}; }})()")


def test_two_eval_suites_chart_separately_in_their_own_section(finished, page):
    _, _, series = finished
    open_run(page, finished)
    section = page.locator("#section-suites")
    expect(section.locator("h2")).to_have_text("Eval suites")
    for metric in ("eval_reward", "eval_pass_rate"):
        for suite in ("digits", "calc"):
            chart = section.locator(f'[id="chart-{suite}/{metric}"]')
            expect(chart).to_be_visible()
            assert chart.get_attribute("data-metrics") == f"{suite}/{metric}"  # one suite per chart
            assert series[f"{suite}/{metric}"]["step"] == [0, 4, 8, 12] == series[metric]["step"]  # at every eval
            expect(chart).to_have_attribute("data-points", "4")
    # every charted suite metric in this section, none of the training env's
    in_section = set(page.evaluate("""[...document.querySelectorAll('#section-suites .chart')]
                                      .filter((c) => c.offsetParent !== null)
                                      .flatMap((c) => (c.dataset.metrics || '').split(' ').filter(Boolean))"""))
    suites = {n for n in visible_metrics(page) if "/" in n and not n.startswith("system/")}  # system/: the worker's
    assert in_section == suites >= {"digits/eval_reward", "calc/eval_reward"}
    expect(page.locator('#section-reward [id="chart-eval_reward"]')).to_be_visible()
    # the suites' section comes right after the reward section
    assert page.evaluate("document.getElementById('section-reward').nextElementSibling.id") == "section-suites"


def test_charts_have_axis_titles_one_legend_entry_per_line_points_for_sparse_series_and_synced_hover(finished, page):
    _, _, series = finished
    open_run(page, finished)
    reward = page.locator("#chart-reward_mean")
    # the legend's x entry names the x axis; one entry per metric (raw and smoothed together), no "(raw)" rows
    expect(reward.locator(".u-legend .u-series").first.locator(".u-label")).to_have_text("step")
    expect(reward.locator(".u-legend .u-series")).to_have_count(2)
    assert plot(page, "reward_mean", "[u.axes[0].label, u.axes[1].label]") == ["step", "reward_mean"]
    # a title longer than the plot is high is its unit alone (the chart's heading names the metrics)
    assert plot(page, "samples_per_s", "[u.axes[1].label, u.axes[2].label]") == ["samples/s", "tokens/s"]
    memory = page.locator(".chart[data-metrics~='rss_gb']").get_attribute("id").removeprefix("chart-")
    assert plot(page, memory, "u.axes[1].label") == f"{memory} (GB)"  # rss_gb's own, or system/rss_gb's

    # hover: values, raw with smoothed, no "--"; the other charts' cursors follow (uPlot cursor sync)
    over = reward.locator(".u-over")
    over.scroll_into_view_if_needed()
    box = over.bounding_box()
    assert box["width"] > 400  # the chart fills its column (it was laid out before it was drawn)
    over.hover(position={"x": box["width"] * 0.6, "y": box["height"] / 2})
    value = reward.locator(".u-legend .u-series").nth(1).locator(".u-value")
    expect(value).to_contain_text("smoothed")
    assert "--" not in reward.locator(".u-legend").inner_text()
    idx = plot(page, "reward_mean", "u.cursor.idx")
    assert idx is not None and plot(page, "policy_loss", "u.cursor.idx") == idx

    # evals are sparse: drawn raw with point markers; so is the breaker's trip series
    assert plot(page, "eval_reward", "[u.series[1].smooth, u.series[1].points.show(u, 1)]") == [False, True]
    assert plot(page, "reward_mean", "[u.series[1].smooth, u.series[1].points.show(u, 1)]") == [True, False]
    # the breaker: threshold and trips in grad_norm's chart, the trip a solid marker, listed under the chart
    assert set(page.locator("#chart-grad_norm").get_attribute("data-metrics").split()) >= {
        "grad_norm", "breaker_threshold", "breaker_tripped"}
    tripped = [s for s, v in zip(series["breaker_tripped"]["step"], series["breaker_tripped"]["value"]) if v >= 1]
    assert tripped, "the drill's spike tripped the breaker"
    # charted and labelled at the step it is recorded at, as its alert says (docs/dashboard.md: one meaning of step)
    expect(page.locator("#chart-grad_norm .markers")).to_contain_text(f"trip@{tripped[0]}")
    assert plot(page, "grad_norm", "u.series.map((s) => s.label)") == ["step", "grad_norm", "breaker threshold"]
    assert plot(page, "grad_norm", "u.series[2].dash") == [6, 4]
    assert plot(page, "grad_norm", "[u.series[1].smooth, u.series[1].points.show(u, 1)]") == [False, True]
    expect(page.locator("#chart-breaker_tripped")).to_have_count(0)
    expect(page.locator("#chart-breaker_threshold")).to_have_count(0)

    # a flat series (folded into the constant line: a click shows its chart) gets a small range around its value
    flat = next(n for n in ("stale_episodes_dropped", "env_errors", "staleness_max")
                if len(set(series[n]["value"])) == 1)
    page.locator(f".folded-constant button[data-chart={flat}]").click()
    expect(page.locator(f"#chart-{flat}")).to_be_visible()
    lo, hi = plot(page, flat, "[u.scales.y.min, u.scales.y.max]")
    value = series[flat]["value"][0]
    assert lo < value < hi and hi - lo <= 2 * max(1, abs(value))

    # log scale and smoothing per chart: grad_norm goes log, reward_mean goes raw; the others keep the page's view
    page.locator("#chart-grad_norm input[name=log]").check()
    page.locator("#chart-reward_mean input[name=smooth]").fill("0")
    wait_until(lambda: plot(page, "grad_norm", "u.scales.y.distr") == 3, 5, message="grad_norm on a log scale")
    assert plot(page, "policy_loss", "u.scales.y.distr") == 1
    assert plot(page, "reward_mean", "u.series[1].smooth") is False
    assert plot(page, "policy_loss", "u.series[1].smooth") is True

    # elapsed time as the x axis: minutes since the run started, named in the legend and on the axis
    page.select_option("#view select[name=x]", "elapsed")
    expect(reward.locator(".u-legend .u-series").first.locator(".u-label")).to_have_text("elapsed (min)")
    xs = plot(page, "reward_mean", "u.data[0]")
    assert 0 <= xs[0] <= xs[-1] < 30 and "x=elapsed" in page.url
    # the legend entry toggles the line, raw and smoothed together
    entry = page.locator("#chart-policy_loss .u-legend .u-series").nth(1)
    entry.click()
    assert plot(page, "policy_loss", "u.series[1].show") is False
    entry.click()
    assert plot(page, "policy_loss", "u.series[1].show") is True
    screenshot(page, "run-page-charts.png")


def test_the_overview_strip_alerts_and_recent_events_come_before_the_charts(finished, page):
    served, run_id, series = finished
    open_run(page, finished)
    overview = page.locator("#overview")
    expect(overview.locator("#ov-env")).to_have_text("max_digit")
    expect(overview.locator("#ov-model")).to_have_text("tiny-dense")
    expect(overview.locator("#ov-elapsed")).to_have_text(re.compile(r"^\d+(m \d+)?s$|^\d+m \d+s$"))
    expect(overview.locator("#ov-eta")).to_have_text("done")
    evals = series["digits/eval_reward"]  # eval.best: the overview's best eval is that of OUT/best
    best = max(range(len(evals["value"])), key=lambda i: evals["value"][i])
    expect(overview.locator("#ov-best")).to_contain_text(f"at step {evals['step'][best]}")
    expect(overview.locator("#ov-paths")).to_contain_text(f"runs/{run_id}/final")
    expect(overview.locator("#ov-where")).to_contain_text("1 rank")
    expect(overview.locator("#ov-where")).to_contain_text("CPU")

    # the breaker's alert and the latest events sit above the charts
    alert = page.locator("#alerts-panel .alert", has_text="breaker")
    expect(alert.first).to_be_visible()
    expect(page.locator("#recent-events li").first).to_be_visible()
    above = page.evaluate("""document.getElementById('alerts-panel').compareDocumentPosition(
                             document.getElementById('charts')) & Node.DOCUMENT_POSITION_FOLLOWING""")
    assert above
    # the header's alert count links to them
    page.click("#alerts-link")
    assert page.url.endswith("#alerts-panel")
    expect(page.locator("#run-alerts")).not_to_have_text("0")
    screenshot(page, "run-page-overview.png")


def test_at_390_px_the_charts_stack_in_one_column_and_nothing_is_cut_off(finished, page):
    page.set_viewport_size({"width": 390, "height": 844})
    open_run(page, finished)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    boxes = [c.bounding_box() for c in page.locator(".chart:not([hidden])").all()[:4]]
    assert len(boxes) == 4 and all(b and b["x"] >= 0 and b["x"] + b["width"] <= 390 for b in boxes)
    assert len({round(b["x"]) for b in boxes}) == 1  # one column
    canvas = page.locator(".chart:not([hidden]) canvas").first.bounding_box()
    assert canvas and canvas["x"] + canvas["width"] <= 390
