"""The runs list in Chromium (Playwright) against the app under uvicorn over a real SQLite, without a daemon: rows
update in place and keep the ticked boxes and the focus; sorting, filters and search live in the URL; rename, notes,
archive and delete from the page; a notice for new alerts; a 390 px screen; a one-run compare."""
import re

import pytest
from playwright.sync_api import expect
from sqlmodel import Session

from app_support import FAST, TOKEN, hook, logged_in, new_run, web  # noqa: F401 (hook, web: fixtures)
from conftest import screenshot
from daemon.models import Alert, Run


def set_run(web, run_id: int, **values):
    """Change a run's record as the daemon and its workers do."""
    with Session(web["records"].engine) as s:
        run = s.get(Run, run_id)
        for k, v in values.items():
            setattr(run, k, v)
        s.add(run)
        s.commit()


def polls(page) -> int:
    return int(page.locator("#runs-rows").get_attribute("data-polls") or 0)


def wait_polls(page, n: int = 2):
    """Until the page has polled the list `n` more times (runs.js bumps data-polls after each poll)."""
    target = polls(page) + n
    page.wait_for_function(f"Number(document.getElementById('runs-rows').dataset.polls || 0) >= {target}",
                           timeout=20_000)


def row(page, run_id: int):
    return page.locator(f"#runs-rows tr[data-run-id='{run_id}']")


def shown(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'data-run-id="(\d+)"', html)]


@pytest.fixture
def runs_page(web, page):
    page.goto(f"{web['base']}/?token={TOKEN}")
    expect(page.locator("h1")).to_have_text("Runs")
    return page


def test_the_list_updates_only_changed_rows_and_keeps_ticked_boxes_and_focus(web, runs_page):
    page = runs_page
    a, b, c = (new_run(web, name=f"keep-{x}")["id"] for x in "abc")
    for quiet in (a, c):  # not queued: a queued row changes (its place in line) when b starts
        set_run(web, quiet, status="stopped")
    wait_polls(page, 1)  # the runs created after the page loaded arrive by a poll
    row(page, a).locator("input[name=ids]").check()
    row(page, b).locator("input[name=ids]").check()
    row(page, c).locator("button[data-action=edit]").focus()
    page.evaluate("document.querySelectorAll('#runs-rows tr').forEach((r) => { r.__same = true; })")

    set_run(web, b, step=7, status="running")
    wait_polls(page, 2)
    expect(row(page, b)).to_contain_text("7/30")
    expect(row(page, b).locator(".status")).to_have_text("running")
    same = page.evaluate("Object.fromEntries([...document.querySelectorAll('#runs-rows tr')]"
                         ".map((r) => [r.dataset.runId, r.__same === true]))")
    assert same[str(b)] is False and same[str(a)] is True and same[str(c)] is True  # only b's row was swapped
    assert row(page, a).locator("input[name=ids]").is_checked() and row(page, b).locator("input[name=ids]").is_checked()
    assert page.evaluate("document.activeElement.getAttribute('aria-label')") == f"edit run {c}"

    # focus inside the row that changes: the new row takes it
    row(page, b).locator("button[data-action=archive]").focus()
    set_run(web, b, step=8)
    wait_polls(page, 2)
    expect(row(page, b)).to_contain_text("8/30")
    assert page.evaluate("document.activeElement.getAttribute('aria-label')") == f"archive run {b}"
    assert row(page, b).locator("input[name=ids]").is_checked()

    # the ticked runs go to the compare page
    page.click("text=Compare selected")
    expect(page).to_have_url(re.compile(rf"/compare\?ids={b}&ids={a}$|/compare\?ids={a}&ids={b}$"))
    expect(page.locator("table.diff")).to_be_visible()
    expect(page.locator(".compare-note")).to_have_count(0)


def test_sorting_filters_and_search_live_in_the_url(web, runs_page):
    page = runs_page
    ids = [new_run(web, name=f"sorted-{i}", config={**FAST, "env": env})["id"]
           for i, env in enumerate(["max_digit", "guess_number", "max_digit"])]
    for run_id, step in zip(ids, [5, 9, 1]):
        set_run(web, run_id, step=step)
    set_run(web, ids[2], notes="the needle is in the notes")
    web["client"].patch(f"/api/v1/runs/{ids[1]}", json={"name": "sorted-needle-name"})
    browser, _ = logged_in(web)

    by_steps = shown(browser.get("/partials/runs", params={"sort": "steps", "order": "asc"}).text)
    steps = {r["id"]: r["step"] for r in web["records"].list_runs()}
    assert [steps[i] for i in by_steps] == sorted(steps[i] for i in by_steps)
    assert by_steps.index(ids[2]) < by_steps.index(ids[0]) < by_steps.index(ids[1])
    assert shown(browser.get("/partials/runs", params={"env": "guess_number"}).text) == [ids[1]]
    assert set(shown(browser.get("/partials/runs", params={"q": "NEEDLE"}).text)) == {ids[1], ids[2]}
    assert shown(browser.get("/partials/runs", params={"q": "100%"}).text) == []  # % is a character, no wildcard
    for key in ("created", "status", "env", "model", "duration", "best_eval"):  # every sortable column answers
        assert set(ids) <= set(shown(browser.get("/partials/runs", params={"sort": key}).text)), key

    # in the browser: a header click sorts, the search box filters, and a reload keeps both
    page.goto(f"{web['base']}/")
    page.click("th a:text('progress')")
    expect(page).to_have_url(re.compile(r"sort=steps&order=desc"))
    expect(page.locator("th[aria-sort=descending]")).to_contain_text("progress")
    page.fill("input[name=q]", "needle")
    page.press("input[name=q]", "Enter")
    expect(page).to_have_url(re.compile(r"q=needle"))
    expect(page.locator("#runs-rows tr[data-run-id]")).to_have_count(2)
    page.reload()
    expect(page.locator("input[name=q]")).to_have_value("needle")
    expect(page.locator("#runs-rows tr[data-run-id]")).to_have_count(2)
    order = [int(x) for x in page.locator("#runs-rows tr[data-run-id]").evaluate_all(
        "rows => rows.map((r) => r.dataset.runId)")]
    assert order == [ids[1], ids[2]]  # steps 9 then 1: sorted descending
    page.select_option("select[name=env]", "guess_number")
    expect(page).to_have_url(re.compile(r"env=guess_number"))
    expect(page.locator("#runs-rows tr[data-run-id]")).to_have_count(1)
    wait_polls(page, 1)  # the poll asks for the same filtered list
    expect(page.locator("#runs-rows tr[data-run-id]")).to_have_count(1)


def test_rename_notes_archive_and_delete_from_the_page(web, runs_page):
    page = runs_page
    run, active = new_run(web, name="to-edit")["id"], new_run(web, name="still-queued")["id"]
    page.reload()
    row(page, run).locator("button[data-action=edit]").click()
    dialog = page.locator("#run-edit")
    expect(dialog).to_be_visible()
    dialog.locator("input[name=name]").fill("renamed-run")
    dialog.locator("textarea[name=notes]").fill("lr too high?")
    dialog.locator("button[value=save]").click()
    expect(dialog).to_be_hidden()
    expect(row(page, run)).to_contain_text("renamed-run")
    expect(row(page, run).locator(".notes")).to_have_text("lr too high?")
    got = web["client"].get(f"/api/v1/runs/{run}").json()
    assert (got["name"], got["notes"]) == ("renamed-run", "lr too high?")

    # archived runs are hidden unless asked for
    row(page, run).locator("button[data-action=archive]").click()
    expect(row(page, run)).to_have_count(0)
    page.check("input[name=archived]")
    expect(page).to_have_url(re.compile(r"archived=true"))
    expect(row(page, run).locator(".tag")).to_have_text("archived")
    row(page, run).locator("button[data-action=archive]").click()  # unarchive
    expect(row(page, run).locator("button[data-action=archive]")).to_have_text("archive")
    assert web["client"].get(f"/api/v1/runs/{run}").json()["archived"] is False

    # delete asks first; a queued run is not offered it (the API refuses it); an ended one goes with its files
    messages = []
    page.on("dialog", lambda d: (messages.append(d.message), d.accept()))
    expect(row(page, active).locator("button[data-action=delete]")).to_have_count(0)
    expect(row(page, active)).to_have_count(1)
    set_run(web, run, status="completed")
    files = web["records"].run_dir(run) / "checkpoints"
    files.mkdir(parents=True)
    (files / "step-5.pt").write_bytes(b"weights")
    row(page, run).locator("button[data-action=delete]").click()
    expect(row(page, run)).to_have_count(0)
    assert any("renamed-run" in m and "cannot be undone" in m for m in messages)
    assert web["client"].get(f"/api/v1/runs/{run}").status_code == 404
    assert not web["records"].run_dir(run).exists()


def test_new_alerts_of_listed_runs_show_as_a_dismissible_notice(web, runs_page):
    page = runs_page
    run = new_run(web, name="alerting")["id"]
    wait_polls(page, 1)
    expect(row(page, run)).to_have_count(1)
    with Session(web["records"].engine) as s:
        s.add(Alert(run_id=run, kind="breaker", message="loss spike", step=3))
        s.commit()
    notice = page.locator("#toasts .toast", has_text=f"Run #{run} alerting: 1 new alert")
    expect(notice).to_be_visible(timeout=10_000)
    assert notice.locator("a").get_attribute("href") == f"/runs/{run}"
    expect(row(page, run).locator(".badge")).to_have_text("1")
    notice.locator("button.close").click()
    expect(notice).to_have_count(0)
    wait_polls(page, 2)  # the same alert is not announced twice
    expect(page.locator("#toasts .toast", has_text=f"Run #{run} alerting")).to_have_count(0)


def test_a_phone_screen_scrolls_the_tables_and_cuts_nothing_off(web, page):
    only = new_run(web, name="phone-run-with-a-long-name")["id"]
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(f"{web['base']}/?token={TOKEN}")
    scroller = page.locator(".table-scroll").filter(has=page.locator("table.runs"))
    assert scroller.evaluate("(el) => el.scrollWidth <= el.clientWidth")  # a desktop sees every column at once
    page.set_viewport_size({"width": 390, "height": 844})
    page.reload()
    fits = "document.documentElement.scrollWidth <= window.innerWidth"
    assert page.evaluate(fits)
    assert scroller.evaluate("(el) => getComputedStyle(el).overflowX") == "auto"
    assert scroller.evaluate("(el) => el.scrollWidth > el.clientWidth")  # the table scrolls inside it
    name = row(page, only).locator("a").first
    box = name.bounding_box()
    assert box and box["x"] >= 0 and box["x"] + box["width"] <= 390
    compare = page.locator("button:text('Compare selected')")
    compare.scroll_into_view_if_needed()  # below the rows (a queued run's reason is a line of its own): reachable, not cut
    expect(compare).to_be_in_viewport(ratio=1)
    assert screenshot(page, "runs-list-390.png").stat().st_size > 5_000

    # a compare of one run says so, and fits the screen too
    page.goto(f"{web['base']}/compare?ids={only}")
    expect(page.locator(".compare-note")).to_contain_text("Only one run")
    assert page.evaluate(fits)
    expect(page.locator(".table-scroll table.diff")).to_be_attached()
