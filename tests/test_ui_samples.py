"""The Samples view in Debian's Chromium driven by Playwright. On a finished `molt serve` run (max_staleness 2):
every colouring's per-token values match the REST payload, the staleness colouring shows an episode whose action
tokens carry several versions, filters and one prompt across steps work; newest step first with a total, search hits
marked, a keyboard-reachable token tooltip, one meaning per colour scale, a legend for all-zero values, the step kept
in the URL, "no samples yet" for a queued run. A policy taught to write <script> and an
onerror attribute: its text shows as characters, no dialog opens, no script runs. Screenshots go to test-artifacts/."""
import re

import pytest
from playwright.sync_api import expect

from app_support import serve, trained_run, web_thread
from conftest import screenshot
from daemon.records import Records
from molt_engine import Env, Observation, Result
from molt_engine.envs import ENVS, register

STALE = {"env": "guess_number", "warm_start": {"steps": 10}, "checkpoint": {"every": 0},
         "loop": {"steps": 12, "groups_per_step": 3, "group_size": 3, "max_staleness": 2, "eval_every": 6,
                  "eval_episodes": 4}}
PAYLOAD = "<script>window.__ran=1;alert(1)</script><img src=x onerror=alert(2)>"


def action_values(page, sample_id: int) -> list[float | None]:
    values = page.locator(f"article[data-id='{sample_id}'] .tok.act").evaluate_all("s => s.map(e => e.dataset.value)")
    return [None if v == "" else float(v) for v in values]


def expected(sample: dict, coloring: str) -> list[float | None]:
    t = sample["tokens"]
    out = []
    for i, action in enumerate(t["action"]):
        if not action:
            continue
        out.append({"logprob": t["logprob"][i], "entropy": t["entropy"][i], "advantage": sample["advantage"],
                    "staleness": sample["version"] - t["version"][i],
                    "mismatch": None if t["trainer_logprob"][i] is None else t["logprob"][i] - t["trainer_logprob"][i],
                    }[coloring])
    return out


def shown_ids(page) -> list[int]:
    return page.locator("#samples article.episode").evaluate_all("a => a.map(e => Number(e.dataset.id))")


def loaded(page):
    """Wait until the list shows what the API returned."""
    expect(page.locator("#samples")).to_have_attribute("data-loaded", re.compile(r"\d+"))


def test_colourings_match_the_api_and_staleness_shows_mixed_versions(tmp_path_factory, page):
    with serve(tmp_path_factory.mktemp("home")) as served:
        run = served.create(STALE, name="samples")
        assert served.wait(run["id"], timeout=300)["status"] == "completed"
        api = f"/api/v1/runs/{run['id']}/samples"
        newest = served.client.get(api, params={"order": "newest"}).json()
        first_page = newest["samples"]
        rows = served.client.get(api, params={"limit": 500}).json()["samples"]

        page.goto(served.url)
        page.goto(f"{served.base}/runs/{run['id']}")
        page.click(f"nav.tabs a[href='/runs/{run['id']}/samples']")  # the run page's Samples tab
        loaded(page)
        assert page.locator("#samples article.episode").count() == len(first_page)
        # newest step first, with how many there are in all
        steps_shown = page.locator("#samples article.episode").evaluate_all("a => a.map(e => Number(e.dataset.step))")
        assert steps_shown == sorted(steps_shown, reverse=True) and steps_shown[0] == max(s["step"] for s in rows)
        expect(page.locator("#samples-count")).to_have_text(
            f"{len(first_page)} of {newest['total']} episodes, newest step first")
        assert newest["total"] == len(rows) > len(first_page)

        # 1. a trained episode with the trainer's numbers: each colouring's values are the API's, token by token
        sample = next(s for s in first_page if s["kind"] == "train" and s["advantage"]
                      and any(v is not None for v in s["tokens"]["trainer_logprob"]))
        article = page.locator(f"article[data-id='{sample['id']}']")
        assert article.locator(".turn.user .role").first.inner_text() == "user"
        assert article.locator(".turn.assistant").count() == sample["turns"]
        assert article.locator(".tok").count() == len(sample["tokens"]["id"])
        for coloring in ("logprob", "entropy", "advantage", "staleness", "mismatch"):
            page.select_option("#sample-filters select[name=color]", coloring)
            expect(page.locator("#legend")).to_have_attribute("data-coloring", coloring)
            assert action_values(page, sample["id"]) == expected(sample, coloring), coloring
            assert f"color={coloring}" in page.url
        print(f"\nsamples: episode {sample['id']}: {len(expected(sample, 'logprob'))} action tokens, 5 colourings "
              "equal to the API's values")
        # one colour meaning per scale: advantage is orange above zero and blue below, never red
        page.select_option("#sample-filters select[name=color]", "advantage")
        colour = article.locator(".tok.act").first.evaluate("e => e.style.backgroundColor.match(/\\d+/g).map(Number)")
        assert (colour[0] > colour[2]) == (sample["advantage"] > 0), colour

        # the tooltip by keyboard: the episode's one tab stop, then the arrow keys to its first action token
        i = sample["tokens"]["action"].index(True)
        article.locator(".tok").first.focus()
        for _ in range(i):
            page.keyboard.press("ArrowRight")
        tip = page.locator("#tok-tip")
        expect(tip).to_be_visible()
        assert f"token id {sample['tokens']['id'][i]}" in tip.inner_text()
        assert f"version {sample['tokens']['version'][i]}" in tip.inner_text()
        assert page.evaluate("document.activeElement.getAttribute('aria-describedby')") == "tok-tip"
        assert article.locator(".tok[tabindex='0']").count() == 1  # roving: still one tab stop per episode
        page.keyboard.press("Escape")
        expect(tip).to_be_hidden()

        # 2. max_staleness 2: an episode whose action tokens carry at least 2 versions, seen in the staleness colours
        mixed = [s for s in rows if s["kind"] == "train"
                 and len({v for v, a in zip(s["tokens"]["version"], s["tokens"]["action"]) if a}) >= 2]
        print(f"\nsamples: {len(rows)} recorded, {len(mixed)} train episodes spanning >= 2 versions")
        assert mixed
        shown = mixed[0]
        page.goto(f"{served.base}/runs/{run['id']}/samples?step={shown['step']}&kind=train&color=staleness")
        loaded(page)
        assert f"step={shown['step']}" in page.url  # the address keeps its step
        assert page.locator("#sample-filters select[name=step]").input_value() == str(shown["step"])
        staleness = action_values(page, shown["id"])
        assert staleness == expected(shown, "staleness") and len(set(staleness)) >= 2
        colours = page.locator(f"article[data-id='{shown['id']}'] .tok.act").evaluate_all(
            "s => s.map(e => e.style.backgroundColor)")
        assert len(set(colours)) >= 2
        print(f"samples: episode {shown['id']} (step {shown['step']}): action-token staleness {sorted(set(staleness))}")
        screenshot(page, "samples-staleness.png")

        # filters: failed episodes only, then a search
        page.goto(f"{served.base}/runs/{run['id']}/samples")
        loaded(page)
        page.select_option("#sample-filters select[name=passed]", "false")
        loaded(page)
        failed = served.client.get(api, params={"passed": False, "order": "newest"}).json()["samples"]
        assert shown_ids(page) == [s["id"] for s in failed] and page.locator("#samples article.pass").count() == 0
        page.fill("#sample-filters input[name=q]", "lower")
        page.press("#sample-filters input[name=q]", "Enter")
        loaded(page)
        found = served.client.get(api, params={"passed": False, "q": "lower", "order": "newest"}).json()["samples"]
        assert shown_ids(page) == [s["id"] for s in found]
        assert all("lower" in t for t in page.locator("#samples article.episode").all_inner_texts())
        hits = page.locator("#samples article.episode").evaluate_all(
            "a => a.map(e => [...e.querySelectorAll('.tok.hit')].map(t => t.textContent).join(''))")
        assert found and all("lower" in h.lower() for h in hits), hits  # each episode's hits spell the search
        assert "passed=false" in page.url and "q=lower" in page.url

        # every value 0 (an eval samples with the trainer's own version): the legend says so, its range reads 0 to 1
        page.goto(f"{served.base}/runs/{run['id']}/samples?kind=eval&color=staleness")
        loaded(page)
        expect(page.locator("#legend .note")).to_have_text("every token on this page: 0")
        assert page.locator("#legend .lo").inner_text() == "0" and page.locator("#legend .hi").inner_text() == "1"
        page.select_option("#sample-filters select[name=color]", "advantage")  # eval episodes have no advantage
        expect(page.locator("#legend .note")).to_have_text("no token on this page has a value")

        # one prompt across steps: an eval prompt, side by side at every eval step
        page.goto(f"{served.base}/runs/{run['id']}/samples?kind=eval")
        loaded(page)
        page.locator("#samples article.episode button").first.click()
        loaded(page)
        steps = page.locator("#samples .step-column").evaluate_all("c => c.map(e => Number(e.dataset.step))")
        assert steps == sorted({s["step"] for s in rows if s["kind"] == "eval"}) and len(steps) >= 2
        expect(page.locator("#prompt-filter")).to_be_visible()
        assert "prompt=" in page.url


@pytest.fixture
def html_env():
    @register
    class HtmlEcho(Env):
        """Says the HTML payload it is taught (the prompt is HTML too)."""
        name = "html_echo"
        max_tokens = 80

        async def reset(self, seed):
            return Observation("<b>say</b><img src=y onerror=alert(3)>:")

        async def step(self, action):
            return Result(reward=float(action == PAYLOAD), terminated=True)

        def demonstration(self, seed):
            return [PAYLOAD]
    yield HtmlEcho.name
    del ENVS[HtmlEcho.name]


def test_model_text_that_is_html_shows_as_text_and_nothing_runs(tmp_path, page, html_env):
    # a policy taught by its warm start to write the payload, trained in this process into a real database
    config = {"env": html_env, "warm_start": {"steps": 150, "batch_size": 4},
              "loop": {"steps": 1, "groups_per_step": 1, "group_size": 2, "eval_every": 1, "eval_episodes": 1}}
    records = Records(tmp_path)
    run = trained_run(records, config, "html")
    queued = records.create_run(config, name="queued")  # no daemon here: it stays queued
    emitted = [s for s in records.samples(run["id"], limit=100) if PAYLOAD in s["text"].removeprefix(s["prompt"])]
    assert emitted, "the policy did not learn to write the payload"

    with web_thread(tmp_path, "html-token") as (base, _app):
        dialogs = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(f"{base}/?token=html-token")
        page.goto(f"{base}/runs/{run['id']}/samples")
        loaded(page)
        article = page.locator(f"article[data-id='{emitted[0]['id']}']")
        assert PAYLOAD in article.locator(".turn.assistant .body").inner_text()
        assert "<img src=y onerror=alert(3)>" in article.locator(".turn.user .body").first.inner_text()
        page.select_option("#sample-filters select[name=color]", "logprob")  # repainting adds nothing either
        assert page.locator("#samples script, #samples .turn img, #samples .turn b").count() == 0
        assert page.evaluate("window.__ran") is None
        assert dialogs == []
        screenshot(page, "samples-html-as-text.png")

        # a queued run: no samples yet, said so; the address keeps the step it was given
        page.goto(f"{base}/runs/{queued['id']}/samples?step=3")
        loaded(page)
        expect(page.locator("#samples .empty")).to_have_text(
            "No samples yet: the run is queued. Each step records some of its episodes here once it has trained.")
        assert page.url.endswith("?step=3") and page.locator("#samples-count").inner_text() == ""
