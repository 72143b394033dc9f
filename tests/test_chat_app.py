"""Chat envs and datasets in the product: the env list, the launch form, and bad input refused at submit (REST 422,
`molt train` exit 2), each naming the problem."""
import json
import subprocess

import httpx
import pytest

from app_support import ROOT, child_env, molt, web_thread

TOKEN = "chat-test-token"


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    with web_thread(home, TOKEN) as (base, app):
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        yield {"base": base, "client": client, "home": home}
        client.close()


def test_env_list_says_which_envs_speak_chat_and_their_tools(web):
    envs = {e["name"]: e for e in web["client"].get("/api/v1/envs").json()}
    assert envs["chat_calculator"]["chat"] and envs["chat_calculator"]["tools"] == ["calculator"]
    assert envs["dataset"]["chat"] and envs["dataset"]["tools"] == []
    assert not envs["max_digit"]["chat"] and not envs["chat_calculator"]["agent"]
    agent = envs["calculator_agent"]
    assert agent["agent"] and agent["chat"] and agent["tools"] == ["calculator"] and agent["source"] is None
    # An agent is submitted over REST like an env, and refused like a chat env on a template-less policy.
    queued = web["client"].post("/api/v1/runs", json={"config": {"env": "calculator_agent",
                                                                 "model": {"preset": "tiny-chat"}}})
    assert queued.status_code == 201 and queued.json()["config"]["env"] == "calculator_agent"
    refused = web["client"].post("/api/v1/runs", json={"config": {"env": "calculator_agent",
                                                                  "model": {"preset": "tiny-dense"}}})
    assert refused.status_code == 422 and "no chat template" in refused.text


@pytest.mark.parametrize("env_args, model, problem", [
    ({"path": "/nonexistent/train.jsonl"}, "tiny-chat", "does not exist"),
    ({"path": "QUESTIONS"}, "tiny-chat", "no 'prompt' column"),
    ({"path": "GOOD", "reward": "fuzzy"}, "tiny-chat", "unknown reward 'fuzzy'"),
    ({"path": "GOOD"}, "tiny-dense", "no chat template"),
])
def test_bad_dataset_runs_are_a_422_naming_the_problem(web, tmp_path, env_args, model, problem):
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    (tmp_path / "g.jsonl").write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    files = {"QUESTIONS": str(tmp_path / "q.jsonl"), "GOOD": str(tmp_path / "g.jsonl")}
    config = {"env": "dataset", "env_args": {k: files.get(v, v) for k, v in env_args.items()},
              "model": {"preset": model}}
    response = web["client"].post("/api/v1/runs", json={"config": config})
    assert response.status_code == 422
    assert problem in response.text


def test_launch_form_sends_the_dataset_inputs_and_shows_their_errors(web, tmp_path):
    browser = httpx.Client(base_url=web["base"], timeout=10)
    browser.post("/login", data={"token": TOKEN})
    page = browser.get("/runs/new").text
    assert "chat_calculator (chat, tools: calculator)" in page and 'name="dataset_path"' in page
    assert '<option value="tiny-chat"' in page
    csrf = page.split('name="csrf_token" value="')[1].split('"')[0]
    form = {"env": "dataset", "preset": "tiny-chat", "dataset_path": str(tmp_path / "nope.jsonl"),
            "dataset_reward": "gsm8k", "csrf_token": csrf}
    response = browser.post("/runs/new", data=form, headers={"Origin": web["base"]})
    assert response.status_code == 422 and "does not exist" in response.text
    assert str(tmp_path / "nope.jsonl") in response.text  # what the user typed stays in the form
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "2+2?", "answer": "#### 4"}) + "\n")
    form["dataset_path"] = str(tmp_path / "train.jsonl")
    response = browser.post("/runs/new", data=form, headers={"Origin": web["base"]})
    assert response.status_code == 303, response.text
    run = web["client"].get(response.headers["location"].replace("/runs/", "/api/v1/runs/")).json()
    assert run["config"]["env_args"] == {"path": str(tmp_path / "train.jsonl"), "reward": "gsm8k"}
    clone = browser.get(f"/runs/new?clone={run['id']}").text  # the clone fills the dataset inputs back in
    assert f'name="dataset_path" value="{tmp_path / "train.jsonl"}"' in clone and 'value="gsm8k"' in clone


def test_molt_train_exits_2_on_a_chat_env_without_a_chat_template(tmp_path):
    done = subprocess.run(molt("train", "--env", "chat_calculator", "--preset", "tiny-dense", "--out",
                               str(tmp_path / "out")), capture_output=True, text=True, cwd=ROOT,
                          env=child_env(tmp_path / "home"), timeout=120)
    assert done.returncode == 2, done.stderr
    assert "no chat template" in done.stderr
