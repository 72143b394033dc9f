"""A and F. The dashboard in Debian's Chromium driven by Playwright, against `molt serve` (real daemon, real
training): log in, launch from the form, live charts, reconnect, completion; a breaker drill's alert as a toast
within a second, acknowledged, and posted to a webhook. Screenshots go to test-artifacts/."""
import os
import re
import signal
import subprocess

import pytest
from playwright.sync_api import expect

from app_support import ROOT, TRIPS, child_env, hook, molt, serve  # noqa: F401 (hook is a fixture)
from conftest import screenshot, wait_until


@pytest.fixture(scope="module")
def served(tmp_path_factory, hook):
    with serve(tmp_path_factory.mktemp("home"), "--webhook-url", hook.url) as s:
        yield s


def test_login_launch_from_the_form_and_watch_the_run_live_until_completed(served, page, browser):
    # the URL `molt serve` printed logs the browser in and leaves the address bar without the token
    page.goto(served.url)
    expect(page.locator("h1")).to_have_text("Runs")
    assert "token=" not in page.url
    cookie = {c["name"]: c for c in page.context.cookies()}["molt_session"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"

    # and the login page, for a browser without that URL
    other = browser.new_page()
    other.goto(served.base + "/runs/new")
    expect(other).to_have_url(re.compile(r"/login\?next=%2Fruns%2Fnew$"))
    other.fill("input[name=token]", "not-the-token")
    other.click("button[type=submit]")
    expect(other.locator("p.error")).to_have_text("wrong token")
    other.fill("input[name=token]", served.token)
    other.click("button[type=submit]")
    expect(other.locator("h1")).to_have_text("Launch a run")
    other.close()

    page.click("text=Launch a run")
    form = page.locator("#launch-form")
    form.locator("input[name=name]").fill("ui-run")
    for field, value in [("steps", "-3"), ("groups_per_step", "4"), ("group_size", "4"), ("warm_start", "5"),
                         ("eval_every", "0"), ("checkpoint_every", "5")]:
        form.locator(f"input[name={field}]").fill(value)
    page.click("#launch-form button[type=submit]")
    # inline validation: the error sits under the field and names it; the page did not change
    error = page.locator(".field-error[data-field=steps]")
    expect(error).to_contain_text("loop.steps")
    assert page.url.endswith("/runs/new")
    page.locator("#launch-form input[name=steps]").fill("30")
    page.click("#launch-form button[type=submit]")
    expect(page).to_have_url(re.compile(r"/runs/\d+$"))
    run_id = int(page.url.rsplit("/", 1)[1])
    assert served.client.get(f"/api/v1/runs/{run_id}").json()["config"]["loop"]["groups_per_step"] == 4

    page.evaluate("window.__sameDocument = true")  # a reload would lose it
    # the chart appears with the run's first reward
    points = lambda: int(page.evaluate("document.getElementById('chart-reward_mean')?.dataset.points ?? 0"))  # noqa: E731
    expect(page.locator("#conn")).to_have_attribute("data-state", "live")
    wait_until(lambda: points() >= 3, 120, interval=0.2, message="the reward chart to gain 3 points")
    first = points()
    assert page.locator("#chart-reward_mean canvas").count() >= 1

    # drop the connection: the page says so, reconnects by itself and backfills what it missed
    page.evaluate("window.__molt.reconnectNow()")
    wait_until(lambda: page.evaluate("window.__molt.connects") == 2, 30, message="a reconnect")
    expect(page.locator("#run-status")).to_have_text("completed", timeout=120_000)
    wait_until(lambda: points() == 30, 10, message="all 30 reward points, none twice")
    assert points() > first and page.evaluate("window.__sameDocument") is True
    expect(page.locator("#conn")).to_have_attribute("data-state", "live")
    expect(page.locator("#run-step")).to_have_text("30")
    expect(page.locator("#records")).to_contain_text("completed")           # the attempt's cause
    expect(page.locator("#actions")).to_contain_text("Clone")
    assert screenshot(page, "run-page.png").stat().st_size > 10_000

    # the view is addressable: the URL carries the x axis, smoothing and log scale
    page.select_option("#view select[name=x]", "time")
    page.check("#view input[name=log]")
    assert "x=time" in page.url and "log=1" in page.url
    page.reload()
    expect(page.locator("#view select[name=x]")).to_have_value("time")
    expect(page.locator("#view input[name=log]")).to_be_checked()

    # the runs list shows it, and the compare page overlays it with a config diff
    page.goto(served.base + "/")
    row = page.locator(f"tr[data-run-id='{run_id}']")
    expect(row).to_contain_text("completed")
    expect(row).to_contain_text("30/30")
    page.goto(served.base + f"/compare?ids={run_id}")
    wait_until(lambda: int(page.locator("#chart-reward_mean").get_attribute("data-points")) == 30, 20)
    # the OpenAPI docs render from the vendored Swagger UI (this browser reaches no CDN)
    page.goto(served.base + "/docs")
    expect(page.locator(".swagger-ui .title")).to_contain_text("Molt Studio")


def test_breaker_drill_alert_toasts_within_a_second_acknowledges_and_reaches_the_webhook(served, page, hook):
    run = served.create(TRIPS, name="breaker drill")
    page.goto(served.url)
    page.goto(served.base + f"/runs/{run['id']}")
    expect(page.locator("#conn")).to_have_attribute("data-state", "live")
    toast = page.locator(".toast", has_text="breaker")
    expect(toast.first).to_be_visible(timeout=150_000)

    received = page.evaluate("window.__molt.alerts")[0]
    # alert.time: when the engine reported it (the sink call); receivedAt: the page's clock, same machine
    delay = received["receivedAt"] / 1000 - received["time"]
    print(f"\nbreaker alert: recorded -> on the open run page in {delay * 1000:.0f} ms")
    assert received["kind"] == "breaker" and delay <= 1.0
    expect(page.locator("#run-alerts")).not_to_have_text("0")
    expect(page.locator("#alerts .alert.open").first).to_be_visible()

    post = wait_until(lambda: [p for p in hook.received if p["body"]["alert"]["run_id"] == run["id"]], 20)[0]
    assert "breaker" in post["body"]["text"] and "breaker drill" in post["body"]["text"]
    print(f"webhook: POST {post['time'] - received['time']:.2f} s after the alert was recorded")

    expect(page.locator("#run-status")).to_have_text("tripped", timeout=120_000)
    expect(page.locator("#run-error")).to_be_visible()
    # acknowledge every open alert: the badge clears
    buttons = page.locator("#alerts button", has_text="acknowledge")
    open_alerts = served.client.get(f"/api/v1/runs/{run['id']}").json()["alerts_open"]
    expect(buttons).to_have_count(open_alerts)
    for left in range(open_alerts - 1, -1, -1):
        buttons.first.click()
        expect(buttons).to_have_count(left)
    expect(page.locator("#run-alerts")).to_have_text("0")
    assert served.client.get(f"/api/v1/runs/{run['id']}").json()["alerts_open"] == 0
    screenshot(page, "breaker-drill.png")

    # the buttons: resume queues it again, stop stops it, clone opens the form with its config
    page.locator("#actions button", has_text="Resume").click()
    expect(page.locator("#run-status")).to_have_text(re.compile("queued|running"))
    asked = []  # Stop asks first
    page.once("dialog", lambda d: (asked.append(d.message), d.accept()))
    page.locator("#actions button", has_text="Stop").click()
    expect(page.locator("#run-status")).to_have_text(re.compile("stopped|tripped"), timeout=60_000)
    assert asked and asked[0].startswith(f"Stop run #{run['id']}")
    page.locator("#actions a", has_text="Clone").click()
    expect(page.locator("#launch-form input[name=name]")).to_have_value("breaker drill (clone)")
    expect(page.locator("#launch-form textarea[name=advanced]")).to_contain_text("spike_at")
    expect(page.locator("#launch-form input[name=steps]")).to_have_value("30")


def test_a_script_in_a_run_name_is_shown_as_text_and_never_runs(served, page):
    evil = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    run = served.create(TRIPS, name=evil)
    served.client.post(f"/api/v1/runs/{run['id']}/stop")
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(served.url)
    expect(page.locator(f"tr[data-run-id='{run['id']}'] a").first).to_have_text(evil)
    page.goto(served.base + f"/runs/{run['id']}")
    expect(page.locator("h1")).to_contain_text(evil)
    page.goto(served.base + f"/compare?ids={run['id']}")
    page.wait_for_load_state("networkidle")  # every image (onerror) and script has had its chance to run
    assert dialogs == []



def launch_from_the_form(served, page, env: str, preset: str) -> int:
    """A short run of `preset` on `env` launched from the form; returns its id once its page shows it completed."""
    page.goto(served.url)
    page.goto(served.base + "/runs/new")
    form = page.locator("#launch-form")
    form.locator("select[name=env]").select_option(env)
    form.locator("select[name=preset]").select_option(preset)
    form.locator("input[name=name]").fill(f"{preset} from the form")
    for field, value in [("steps", "6"), ("groups_per_step", "2"), ("group_size", "4"), ("warm_start", "5"),
                         ("eval_every", "0")]:
        form.locator(f"input[name={field}]").fill(value)
    page.click("#launch-form button[type=submit]")
    expect(page).to_have_url(re.compile(r"/runs/\d+$"))
    run_id = int(page.url.rsplit("/", 1)[1])
    config = served.client.get(f"/api/v1/runs/{run_id}").json()["config"]
    assert (config["env"], config["model"]["preset"]) == (env, preset)
    expect(page.locator("#run-status")).to_have_text("completed", timeout=120_000)
    return run_id


def test_a_moe_run_from_the_form_shows_expert_load_per_layer(served, page):
    launch_from_the_form(served, page, "max_digit", "tiny-moe")
    # one expert-load chart per layer (4), each with a curve per expert (8), and the router chart
    expect(page.locator("[id^=chart-experts-l]")).to_have_count(4)
    for layer in range(4):
        chart = page.locator(f"#chart-experts-l{layer}")
        expect(chart).to_be_visible()
        wait_until(lambda: chart.get_attribute("data-points") == "6", 20, message=f"6 points in layer {layer}")
        assert chart.locator(".u-legend .u-series").count() >= 8
    expect(page.locator("#chart-moe_balance_entropy")).to_be_visible()
    screenshot(page, "run-page-tiny-moe.png")


def test_a_vision_language_run_from_the_form_trains_on_images(served, page):
    launch_from_the_form(served, page, "shapes", "tiny-vlm")
    wait_until(lambda: page.locator("#chart-reward_mean").get_attribute("data-points") == "6", 20, message="6 rewards")
    expect(page.locator("[id^=chart-experts-l]")).to_have_count(0)  # a dense policy has no expert load
    screenshot(page, "run-page-tiny-vlm.png")


def test_an_agent_run_from_the_form_charts_its_requests_and_segments(served, page):
    """The calculator agent (the OpenAI SDK against the run's loopback server) from the form, through the daemon."""
    page.goto(served.url)
    page.goto(served.base + "/runs/new")
    expect(page.locator("select[name=env] option[value=calculator_agent]")).to_have_text(
        "calculator_agent (agent, tools: calculator)")
    run_id = launch_from_the_form(served, page, "calculator_agent", "tiny-chat")
    chart = page.locator("#chart-agent_requests_per_episode")
    wait_until(lambda: chart.get_attribute("data-points") == "6", 20, message="6 points of agent metrics")
    folded = page.locator(".folded-constant button[data-chart=agent_requests_per_episode]")
    if folded.count():  # the same number of requests in every episode: listed as a constant; a click charts it
        folded.click()
    expect(chart).to_be_visible()
    series = served.client.get(f"/api/v1/runs/{run_id}/metrics",
                               params={"names": "segments_per_episode,agent_requests_per_episode"}).json()["series"]
    assert series["segments_per_episode"]["value"] == [1.0] * 6  # the agent sends its history back as it got it
    assert min(series["agent_requests_per_episode"]["value"]) >= 1.0
    screenshot(page, "run-page-agent.png")


def test_the_daemon_banner_appears_on_every_page_while_the_daemon_is_down_and_goes_when_it_is_back(tmp_path, page):
    with serve(tmp_path) as served:
        daemon = lambda: served.client.get("/api/v1/health").json()["daemon"]  # noqa: E731
        banner = page.locator("#daemon-banner")
        page.goto(served.url)
        for where in ("/", "/runs/new"):  # the runs list, then another page: the banner is on every page
            page.goto(served.base + where)
            pid = wait_until(lambda: (d := daemon())["alive"] and d["pid"], 60, message="a live daemon")
            expect(banner).to_be_hidden()
            os.kill(pid, signal.SIGKILL)
            expect(banner).to_be_visible(timeout=10_000)
            expect(banner).to_contain_text("SIGKILL")
            screenshot(page, f"daemon-banner{where.replace('/', '-')}.png")
            expect(banner).to_be_hidden(timeout=60_000)
            assert daemon()["alive"] and daemon()["pid"] != pid
            expect(page.locator(".toast.info", has_text="The daemon is back").last).to_be_visible()

        # stopped on request, it stays stopped: the banner says so and its Start button brings it back
        pid = daemon()["pid"]
        stop = subprocess.run(molt("daemon", "stop", "--home", str(tmp_path)), capture_output=True, text=True,
                              timeout=120, env=child_env(tmp_path), cwd=ROOT)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        expect(banner).to_contain_text("The daemon is stopped", timeout=10_000)
        expect(banner.locator("#daemon-start")).to_be_visible()
        screenshot(page, "daemon-stopped.png")
        assert served.client.get("/api/v1/health").json()["status"] == "stopped" and not daemon()["running"]
        page.click("#daemon-start")
        expect(banner).to_be_hidden(timeout=60_000)
        assert daemon()["alive"] and daemon()["pid"] != pid and daemon()["restarts"] == 2
        expect(page.locator(".toast.info", has_text="The daemon is back").last).to_be_visible()
