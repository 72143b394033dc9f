"""Accessibility of the five main pages (runs list, run page, samples view, launch form, compare) in Debian's Chromium,
light and dark: axe-core (axe-playwright-python) finds no serious or critical violation, and every visible piece of
text reads at >= 4.5:1 (3:1 when large) against its effective background, computed in the browser; the charts' tick
labels too (read off the canvas). The header's theme toggle is remembered and applied before the first paint."""

import httpx
import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import expect

from app_support import trained_run, web_thread
from daemon.records import Records

TOKEN = "a11y-token"
TINY = {"env": "max_digit", "warm_start": {"steps": 5}, "checkpoint": {"every": 0},
        "loop": {"steps": 4, "groups_per_step": 2, "group_size": 4, "eval_every": 2, "eval_episodes": 2}}
DARK_BG = "rgb(17, 24, 39)"

# Every element with its own visible text: its colour composited over the backgrounds behind it (up the tree), and
# the WCAG contrast ratio of the two. Disabled controls are exempt (as in WCAG); a background image ends the walk
# (the text is then not measurable this way and is reported as such).
CONTRAST = """() => {
  const rgba = (s) => { const m = s.match(/[\\d.]+/g).map(Number); return [m[0], m[1], m[2], m.length > 3 ? m[3] : 1]; };
  const over = (top, under) => top.slice(0, 3).map((c, k) => c * top[3] + under[k] * (1 - top[3])).concat(1);
  const lum = (c) => { const [r, g, b] = c.slice(0, 3).map((v) => { v /= 255;
    return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; }); return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  const ratio = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
  const failures = []; let checked = 0;
  for (const el of document.body.querySelectorAll("*")) {
    const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    if (!own || ["SCRIPT", "STYLE", "OPTION", "NOSCRIPT"].includes(el.tagName) || !el.checkVisibility({opacityProperty: true, visibilityProperty: true})) continue;
    if (el.closest(":disabled, [hidden], .u-off") || !el.getClientRects().length) continue;
    const style = getComputedStyle(el);
    let node = el, image = false;
    const layers = [];
    while (node && node.nodeType === 1) {
      const s = getComputedStyle(node);
      if (s.backgroundImage !== "none") { image = true; break; }
      layers.push(rgba(s.backgroundColor));
      node = node.parentElement;
    }
    if (image) { failures.push({text: el.textContent.trim().slice(0, 40), why: "text over a background image"}); continue; }
    let bg = [255, 255, 255, 1];  // the canvas below the root; the root's own colour is the last layer
    for (const layer of layers.reverse()) bg = over(layer, bg);
    const fg = over(rgba(style.color), bg);
    const size = parseFloat(style.fontSize), bold = Number(style.fontWeight) >= 700;
    const need = size >= 24 || (bold && size >= 18.66) ? 3 : 4.5;
    const r = ratio(fg, bg);
    checked++;
    if (r < need) failures.push({text: el.textContent.trim().slice(0, 40), tag: el.tagName, cls: el.className,
                                 color: style.color, bg: `rgb(${bg.slice(0, 3).map(Math.round)})`, ratio: +r.toFixed(2)});
  }
  return {checked, failures};
}"""

# The y axis of a chart's canvas: the pixel of its tick labels that stands out most from the chart's background.
TICKS = """(chart) => {
  const canvas = chart.querySelector("canvas");
  const lum = (r, g, b) => [r, g, b].map((v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; })
                                 .reduce((a, v, k) => a + v * [0.2126, 0.7152, 0.0722][k], 0);
  const bg = getComputedStyle(chart).backgroundColor.match(/\\d+/g).map(Number);
  const lb = lum(...bg);
  const data = canvas.getContext("2d").getImageData(0, 0, 50, canvas.height).data;
  let best = 1;
  for (let i = 0; i < data.length; i += 4) {
    if (data[i + 3] < 250) continue;
    const l = lum(data[i], data[i + 1], data[i + 2]);
    best = Math.max(best, (Math.max(l, lb) + 0.05) / (Math.min(l, lb) + 0.05));
  }
  return best;
}"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The app (no daemon) over a home with one finished run (trained in this process, with samples) and one queued."""
    home = tmp_path_factory.mktemp("home")
    records = Records(home)
    done = trained_run(records, TINY, "finished", step=4)
    queued = records.create_run(TINY, name="queued")
    with web_thread(home, TOKEN) as (base, _app):
        yield {"base": base, "done": done["id"], "queued": queued["id"]}


def pages(site) -> dict[str, str]:
    done, queued = site["done"], site["queued"]
    return {"runs list": "/", "run page": f"/runs/{done}", "samples view": f"/runs/{done}/samples",
            "samples view, advantage colours": f"/runs/{done}/samples?color=advantage", "launch form": "/runs/new",
            "compare": f"/compare?ids={done},{queued}"}


def open_page(context, site, path):
    page = context.new_page()
    page.goto(f"{site['base']}{path}")
    if "/samples" in path:
        page.wait_for_selector("#samples[data-loaded]")
    if path.startswith("/runs/") and path.count("/") == 2 and path != "/runs/new":
        page.wait_for_selector("#chart-reward_mean:not([hidden]) canvas")
    return page


@pytest.mark.parametrize("theme", ["light", "dark", "auto-dark"])
def test_axe_and_text_contrast_on_the_main_pages(site, browser, theme):
    # light: the system is light and the toggle on auto; dark: chosen in the toggle; auto-dark: the system is dark
    context = browser.new_context(viewport={"width": 1440, "height": 900},
                                  color_scheme="dark" if theme == "auto-dark" else "light")
    if theme == "dark":
        context.add_init_script("localStorage.setItem('molt-theme', 'dark')")
    context.new_page().goto(f"{site['base']}/?token={TOKEN}")
    axe, problems = Axe(), []
    for name, path in pages(site).items():
        page = open_page(context, site, path)
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert (background == DARK_BG) == (theme != "light"), (name, background)
        contrast = page.evaluate(CONTRAST)
        assert contrast["checked"] > 10, name
        problems += [f"{name}: contrast {f}" for f in contrast["failures"]]
        found = axe.run(page).response["violations"]
        problems += [f"{name}: axe {v['id']} ({v['impact']}): {[n['target'] for n in v['nodes']][:5]}"
                     for v in found if v["impact"] in ("serious", "critical")]
        if name == "run page":
            ticks = page.locator("#chart-reward_mean").evaluate(TICKS)
            if ticks < 4.5:
                problems.append(f"{name}: chart tick labels at {ticks:.2f}:1")
        page.close()
    context.close()
    print(f"\na11y ({theme}): {len(pages(site))} pages, axe and contrast: {len(problems)} problems")
    assert problems == [], "\n".join(map(str, problems))


def test_theme_toggle_is_remembered_and_set_before_the_first_paint(site, browser):
    context = browser.new_context(color_scheme="light")
    page = context.new_page()
    page.goto(f"{site['base']}/?token={TOKEN}")
    # the remembered choice is applied by a script in <head>, before any stylesheet or the body
    html = httpx.get(f"{site['base']}/runs/new", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert html.index("molt-theme") < html.index("app.css") < html.index("<body")
    page.goto(f"{site['base']}/runs/{site['done']}")
    page.wait_for_selector("#chart-reward_mean:not([hidden]) canvas")
    light_ticks = page.locator("#chart-reward_mean").evaluate(TICKS)
    page.select_option("select.theme", "dark")
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == DARK_BG
    # the charts redraw in the new theme: light tick labels on the dark chart
    page.wait_for_function("document.querySelector('#chart-reward_mean').matches(':not([hidden])')")
    dark_ticks = page.locator("#chart-reward_mean").evaluate(TICKS)
    assert light_ticks >= 4.5 and dark_ticks >= 4.5, (light_ticks, dark_ticks)
    page.goto(f"{site['base']}/runs/new")  # another page, and a reload: still dark, and the toggle says so
    page.reload()
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    assert page.locator("select.theme").input_value() == "dark"
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == DARK_BG
    page.select_option("select.theme", "auto")
    page.reload()
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(255, 255, 255)"
    context.close()
