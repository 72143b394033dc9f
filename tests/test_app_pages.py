"""The HTML pages against a real uvicorn and a real SQLite: login and its cookie, CSRF, the launch form's inline
errors, paging, escaping, the thread pool, vendored assets only, a run's GPUs."""
import re
from html import unescape
from urllib.parse import quote, urlencode

import fastapi.routing
import httpx
import pytest
from fastapi.routing import APIRoute
from sqlalchemy import update
from sqlmodel import Session

from app.pages import guarded, machine_gpus
from app_support import FAST, TOKEN, hook, logged_in, new_run, sink_for, web  # noqa: F401 (hook, web: fixtures)
from daemon.models import Run


def test_pages_redirect_to_login_and_the_login_sets_a_strict_httponly_cookie(web):
    run = new_run(web)
    with httpx.Client(base_url=web["base"], timeout=10) as browser:
        for path in ["/", "/runs/new", f"/runs/{run['id']}", "/compare", f"/runs/{run['id']}/panels/alerts"]:
            response = browser.get(path)
            assert response.status_code == 303 and response.headers["location"].startswith("/login"), path
        assert browser.post("/login", data={"token": "wrong"}).status_code == 401
        response = browser.post("/login", data={"token": TOKEN, "next": "//evil.example/x"})
        assert response.status_code == 303 and response.headers["location"] == "/"  # no open redirect
        cookie = response.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and TOKEN.lower() not in cookie
        assert browser.get("/").status_code == 200
        # the printed URL: ?token= swaps itself for the cookie and leaves the address bar
        fresh = httpx.Client(base_url=web["base"], timeout=10)
        response = fresh.get(f"/runs/{run['id']}?x=time&token={TOKEN}")
        assert response.status_code == 303 and response.headers["location"] == f"/runs/{run['id']}?x=time"
        assert fresh.get(response.headers["location"]).status_code == 200


def test_a_cross_site_form_post_is_rejected(web):
    browser, csrf = logged_in(web)
    form = {"env": "max_digit", "preset": "tiny-dense", "steps": "7", "name": "csrf-probe"}
    before = len(web["records"].list_runs())
    # another site's page posting our form: the browser would send its Origin and (with SameSite=Lax) the cookie
    assert browser.post("/runs/new", data={**form, "csrf_token": csrf},
                        headers={"Origin": "https://evil.example"}).status_code == 403
    assert browser.post("/runs/new", data=form).status_code == 403                       # no CSRF token
    assert browser.post("/runs/new", data={**form, "csrf_token": "0" * 64}).status_code == 403
    assert browser.post("/api/v1/runs", json={"config": FAST}).status_code == 403        # cookie alone, JSON API
    assert browser.post("/login", data={"token": TOKEN}, headers={"Origin": "https://evil.example"}).status_code == 403
    assert len(web["records"].list_runs()) == before
    # the same form from our own page goes through
    response = browser.post("/runs/new", data={**form, "csrf_token": csrf}, headers={"Origin": web["base"]})
    assert response.status_code == 303, response.text
    assert web["records"].list_runs()[0]["name"] == "csrf-probe"


def test_the_launch_form_shows_each_error_at_its_input_by_the_rules_of_the_api(web):
    browser, csrf = logged_in(web)
    form = {"env": "max_digit", "preset": "tiny-dense", "steps": "0", "max_restarts": "101", "csrf_token": csrf,
            "tags": ", ".join(f"t{i}" for i in range(51)), "advanced": '{"algo": {"lr": false}}'}
    before = len(web["records"].list_runs())
    response = browser.post("/runs/new", data=form)
    assert response.status_code == 422
    errors = dict(re.findall(r'data-field="(\w+)">([^<]*)<', response.text))
    assert errors["steps"].startswith("loop.steps: ") and errors["advanced"].startswith("algo.lr: ")
    assert "lr" not in errors  # the bad lr came from the advanced JSON: its error is under that box
    assert errors["tags"].startswith("tags: ") and errors["max_restarts"].startswith("max_restarts: ")
    assert 'value="101"' in response.text, "what the user typed is kept"
    assert len(web["records"].list_runs()) == before


def test_the_launch_form_offers_rewards_judges_a_teacher_and_reasoning_gym_as_recipes(web):
    browser, csrf = logged_in(web)
    page = browser.get("/runs/new").text
    for recipe in ["reasoning-gym task", "reward model", "LLM judge (group)", "distillation teacher"]:
        assert f'href="/runs/new?recipe={quote(recipe)}"' in page
    for recipe, wanted in [("reward model", '"model": "/models/my-reward-model"'),
                           ("LLM judge (group)", '"mode": "group"'), ("distillation teacher", '"teacher": {')]:
        advanced = unescape(re.search(r'<textarea name="advanced"[^>]*>([^<]*)<', browser.get(
            "/runs/new", params={"recipe": recipe}).text).group(1))
        assert '"rewards": {' in advanced and wanted in advanced
    html = browser.get("/runs/new", params={"recipe": "reasoning-gym task"}).text
    assert re.search(r'<option value="reasoning_gym" data-description="A reasoning-gym task by name[^>]*selected>', html)
    advanced = unescape(re.search(r'<textarea name="advanced"[^>]*>([^<]*)<', html).group(1))
    response = browser.post("/runs/new", data={"env": "reasoning_gym", "preset": "tiny-chat", "advanced": advanced,
                                               "csrf_token": csrf})
    assert response.status_code == 303, response.text  # it launches as the recipe fills it
    queued = web["records"].get_run(int(response.headers["location"].rsplit("/", 1)[1]))["config"]
    assert queued["env"] == "reasoning_gym" and queued["env_args"]["task"] == "leg_counting"
    refused = web["client"].post("/api/v1/runs", json={"config": {"env": "reasoning_gym", "model": {
        "preset": "tiny-chat"}, "env_args": {"task": "leg_countin"}}})  # an unknown task, refused at submit
    assert refused.status_code == 422 and "close names: leg_counting" in refused.text


def test_the_runs_page_pages_through_every_run(web):
    ids = [new_run(web, name=f"paged-{i}")["id"] for i in range(105)]
    browser, _ = logged_in(web)
    shown, url = [], "/"
    while url:
        html = browser.get(url.replace("&amp;", "&")).text
        shown += [int(i) for i in re.findall(r'data-run-id="(\d+)"', html)]
        url = (re.findall(r'<a href="([^"]+)">older runs', html) or [None])[0]
    assert set(ids) <= set(shown) and len(shown) == len(set(shown)) == len(web["records"].list_runs())
    assert shown == sorted(shown, reverse=True)
    page = web["client"].get("/api/v1/runs", params={"limit": 3, "before": ids[-1]}).json()
    assert [r["id"] for r in page] == ids[-4:-1][::-1]


# What the tests below fill into the pages' path parameters (a new parameter must be added here to be tested)
PATH_PARAMS = {"panel": "records", "action": "stop", "alert_id": "1"}


def page_routes(web) -> list[tuple[str, str]]:
    """(method, URL) of every HTML page of the real app behind the login, as FastAPI routes requests to them."""
    run = new_run(web)
    evaluation = web["client"].post("/api/v1/evals", json={"model": {"preset": "tiny-dense"}, "env": "max_digit"})
    sweep = web["client"].post("/api/v1/sweeps", json={"name": "pages", "config": {"env": "max_digit"},
                                                       "params": {"algo.lr": {"values": [1e-3]}}})
    values = {**PATH_PARAMS, "run_id": str(run["id"]), "eval_id": str(evaluation.json()["id"]),
              "sweep_id": str(sweep.json()["id"])}
    found = []
    for context in fastapi.routing.iter_route_contexts(web["app"].routes):  # included routers' routes too
        path = context.path
        if not isinstance(context.route, APIRoute) or path.startswith(("/api/", "/docs", "/openapi")) \
                or path in ("/login", "/logout", "/metrics"):
            continue
        for method in sorted(context.methods):
            found.append((method, re.sub(r"{(\w+)}", lambda m: values[m.group(1)], path)))
    return found


def test_every_page_sends_a_visitor_without_a_session_to_the_login(web):
    routes = page_routes(web)
    assert len(routes) >= 10 and [url for method, url in routes if url.endswith("/samples")]
    with httpx.Client(base_url=web["base"], timeout=10) as browser:
        for method, url in routes:
            response = browser.request(method, url)
            assert response.status_code == 303, (method, url, response.status_code, response.text[:300])
            assert response.headers["location"] == "/login?" + urlencode({"next": url}), (method, url)
            response = browser.request(method, url, headers={"HX-Request": "true"})  # htmx: a full-page redirect
            assert (response.status_code, response.headers.get("hx-redirect")) == (401, "/login"), (method, url)


def test_every_page_opens_from_the_ready_to_click_url(web):
    for method, url in page_routes(web):
        if method != "GET":
            continue
        with httpx.Client(base_url=web["base"], timeout=10) as fresh:  # a browser without a session
            response = fresh.get(url, params={"token": TOKEN})
            assert response.status_code == 303 and response.headers["location"] == url, (url, response.text[:300])
            assert "molt_session=" in response.headers["set-cookie"], url
            page = fresh.get(response.headers["location"])
            kind = "text/csv" if url.endswith(".csv") else "text/html"
            assert page.status_code == 200 and page.headers["content-type"].startswith(kind), (url, page.text)


def test_a_page_handler_cannot_be_async():
    """Pages read SQLite synchronously, so they run in FastAPI's thread pool, never on the event loop that the
    websockets share; an async handler under the synchronous login gate would also return an unawaited redirect."""
    async def page(request):
        return None

    with pytest.raises(TypeError, match="plain def"):
        guarded(page)


def test_openapi_documents_an_alert_id_as_an_alert_id(web):
    ack = web["client"].get("/openapi.json").json()["paths"]["/api/v1/runs/{run_id}/alerts/{alert_id}/ack"]["post"]
    described = {p["name"]: p["description"] for p in ack["parameters"]}
    assert described == {"run_id": "the run's id", "alert_id": "the alert's id"}


def test_a_script_in_a_run_name_renders_escaped(web):
    evil = "<script>alert(1)</script>"
    run = new_run(web, name=evil)
    sink = sink_for(web, run["id"])
    sink.alert("breaker", evil, step=1)
    sink.close()
    browser, _ = logged_in(web)
    for path in ["/", f"/runs/{run['id']}", f"/compare?ids={run['id']}", f"/runs/{run['id']}/panels/alerts",
                 f"/runs/new?clone={run['id']}", "/partials/runs"]:
        html = browser.get(path).text
        assert evil not in html, path
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in browser.get(f"/runs/{run['id']}").text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in browser.get(f"/runs/{run['id']}/panels/alerts").text


def test_pages_load_nothing_from_other_hosts(web):
    """Static assets are vendored: no page may pull a script, style or image from a CDN."""
    run = new_run(web)
    browser, _ = logged_in(web)
    for path in ["/", "/runs/new", f"/runs/{run['id']}", f"/compare?ids={run['id']}", "/docs", "/login"]:
        html = browser.get(path).text
        external = re.findall(r"""(?:src|href)\s*=\s*["'](?:https?:)?//[^"']+""", html)
        assert external == [], (path, external)
        for asset in re.findall(r"""(?:src|href)\s*=\s*["'](/static/[^"']+)""", html):
            assert browser.get(asset).status_code == 200, asset


def test_the_runs_list_and_run_page_show_a_runs_gpus_and_no_machine_panel_without_nvml(web):
    run = new_run(web, name="on-gpus")
    with Session(web["records"].engine) as s:  # what the daemon records as it starts the worker
        s.execute(update(Run).where(Run.id == run["id"]).values(gpus="0,1"))
        s.commit()
    browser, _ = logged_in(web)
    rows = browser.get("/partials/runs").text
    row = rows.split(f'data-run-id="{run["id"]}"')[1].split("</tr>")[0]
    assert "<td>0,1</td>" in row
    assert '<b id="run-gpus">0,1</b>' in browser.get(f"/runs/{run['id']}").text
    assert ('class="machine"' in browser.get("/").text) == bool(machine_gpus())
