"""The launch form in Debian's Chromium driven by Playwright (the app under uvicorn, no daemon: a launched run stays
queued): no overlap at 1440 px, no horizontal overflow at 390 px, the chosen env's description, the README's recipes
as one-click presets, and every error at once, under the input that holds the bad value, marked and focused."""
import json
import re

import pytest
from app_support import web_thread
from conftest import screenshot
from playwright.sync_api import expect

from molt_engine.envs import ENVS

TOKEN = "launch-token"
# Every box of the form, and whether one box's input sticks out of it or into another
LAYOUT = """() => {
  const box = e => e.getBoundingClientRect();
  const sets = [...document.querySelectorAll('#launch-form fieldset')].map(box);
  const overlaps = [];
  sets.forEach((a, i) => sets.slice(i + 1).forEach((b, j) => {
    if (a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1)
      overlaps.push([i, i + 1 + j]);
  }));
  const outside = [...document.querySelectorAll('#launch-form fieldset :is(input, select, textarea)')]
    .filter(e => e.type !== 'hidden' && box(e).right > box(e.closest('fieldset')).right + 1).map(e => e.name);
  return {overlaps, outside, scroll: document.documentElement.scrollWidth, width: window.innerWidth};
}"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    with web_thread(tmp_path_factory.mktemp("home"), TOKEN) as (base, app):
        yield base, app


def open_form(browser, base, width, height, path="/runs/new"):
    page = browser.new_page(viewport={"width": width, "height": height})
    page.goto(f"{base}/?token={TOKEN}")
    page.goto(base + path)
    return page


@pytest.mark.parametrize("width,height", [(1440, 900), (390, 844)])
def test_the_form_fits_without_overlap_shows_the_env_and_fills_from_a_recipe(site, browser, width, height):
    base, app = site
    page = open_form(browser, base, width, height)
    layout = page.evaluate(LAYOUT)
    assert layout["overlaps"] == [] and layout["outside"] == [], layout
    assert layout["scroll"] <= layout["width"], layout  # no horizontal scrolling, phone included
    screenshot(page, f"launch-form-{width}.png")

    # the chosen env's description, from its class docstring, follows the selection
    description = page.locator("#env-description")
    expect(description).to_have_text(ENVS["max_digit"].__doc__.strip().splitlines()[0])
    page.select_option("#launch-form select[name=env]", "calculator")
    expect(description).to_have_text(ENVS["calculator"].__doc__.strip().splitlines()[0])

    # the README's recipes fill the form in one click; launching one queues exactly its config
    page.click("#recipes >> text=vision")
    form = page.locator("#launch-form")
    expect(form.locator("select[name=env]")).to_have_value("shapes")
    expect(form.locator("select[name=preset]")).to_have_value("tiny-vlm")
    expect(form.locator("input[name=steps]")).to_have_value("800")
    expect(description).to_have_text(ENVS["shapes"].__doc__.strip().splitlines()[0])
    assert json.loads(form.locator("textarea[name=advanced]").input_value())["algo"]["kl_coef"] == 0.1
    page.click("#recipes >> text=dataset")
    expect(form.locator("select[name=env]")).to_have_value("dataset")
    expect(form.locator("input[name=dataset_reward]")).to_have_value("gsm8k")
    expect(form.locator("input[name=dataset_path]")).to_have_value("train.jsonl")
    page.click("#recipes >> text=calculator")
    expect(form.locator("input[name=warm_start]")).to_have_value("100")
    assert page.evaluate(LAYOUT)["scroll"] <= width
    page.click("#launch-form button[type=submit]")
    page.wait_for_url(re.compile(r"/runs/\d+$"))
    run = app.state.records.get_run(int(page.url.rsplit("/", 1)[1]))
    assert run["config"]["env"] == "calculator" and run["config"]["warm_start"] == {
        **run["config"]["warm_start"], "steps": 100, "lr": 1e-3}
    page.close()


def test_every_error_at_once_under_the_input_that_holds_the_value_marked_and_focused(site, browser):
    base, app = site
    before = len(app.state.records.list_runs())
    page = open_form(browser, base, 1440, 900)
    form = page.locator("#launch-form")
    form.locator("input[name=steps]").fill("abc")         # not a number: caught before the config is checked
    form.locator("input[name=group_size]").fill("0")      # a number the config refuses: in the same pass
    form.locator("input[name=lr]").fill("0.001")          # fine here; the advanced JSON overrides it with a bad one
    form.locator("textarea[name=advanced]").fill(json.dumps({"algo": {"lr": -1}, "loop": {"stepz": 5}}))
    page.click("#launch-form button[type=submit]")
    errors = lambda field: form.locator(f".field-error[data-field={field}]")
    expect(errors("steps")).to_have_text("must be a whole number")
    expect(errors("group_size")).to_contain_text("loop.group_size")
    advanced = errors("advanced")
    expect(advanced).to_have_count(2)
    expect(advanced.filter(has_text="algo.lr")).to_have_count(1)
    expect(advanced.filter(has_text="loop.stepz")).to_contain_text("did you mean `loop.steps`?")
    expect(errors("lr")).to_have_count(0)  # the lr input holds 0.001, not the -1 that was refused
    bad = page.evaluate("""() => {  // the palette's --bad as a computed colour
        const probe = document.body.appendChild(document.createElement("i"));
        probe.style.color = "var(--bad)";
        const color = getComputedStyle(probe).color;
        probe.remove();
        return color;
    }""")
    for name, invalid in [("input[name=steps]", True), ("input[name=group_size]", True),
                          ("textarea[name=advanced]", True), ("input[name=lr]", False), ("input[name=name]", False)]:
        field = form.locator(name)
        if invalid:
            expect(field).to_have_attribute("aria-invalid", "true")
            assert field.evaluate("e => getComputedStyle(e).borderTopColor") == bad
            described = field.get_attribute("aria-describedby")
            assert described and page.locator(f"#{described.split()[0]}").count() == 1
        else:
            expect(field).not_to_have_attribute("aria-invalid", "true")
    expect(form.locator("input[name=steps]")).to_be_focused()  # the first error in the form's order
    expect(form.locator("input[name=lr]")).to_have_value("0.001")  # what was typed is kept
    page.select_option("#launch-form select[name=env]", "guess_number")  # the swapped-in form still follows the env
    expect(page.locator("#env-description")).to_have_text(ENVS["guess_number"].__doc__.strip().splitlines()[0])
    # a top-level key that belongs in a section gets its path suggested
    form.locator("input[name=steps]").fill("5")
    form.locator("input[name=group_size]").fill("")
    form.locator("textarea[name=advanced]").fill('{"max_staleness": 2}')
    page.click("#launch-form button[type=submit]")
    expect(errors("advanced")).to_have_count(1)
    expect(errors("advanced")).to_contain_text("did you mean `loop.max_staleness`?")
    expect(form.locator("textarea[name=advanced]")).to_be_focused()
    assert len(app.state.records.list_runs()) == before  # nothing was queued
    page.close()
