"""A user's own env directory (--envs / $MOLT_ENVS): loaded by every process, listed, launched, and broken files named."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
from pydantic import ValidationError

from app_support import FAST, ROOT, child_env, molt, serve
from molt_engine import ENVS, RunConfig, load_agents_dir
from molt_engine.envs import EnvLoadError

ECHO = '''
from molt_engine import Env, Observation, Result, register


@register
class UserEcho(Env):
    """Say the seed's last digit."""
    name = "user_echo"
    max_turns, max_tokens = 1, 4

    async def reset(self, seed):
        self.answer = str(seed % 10)
        return Observation(f"say {self.answer}:")

    async def step(self, action):
        return Result(reward=float(action == self.answer), terminated=True)

    def demonstration(self, seed):
        return [str(seed % 10)]
'''
BROKEN = '''
from molt_engine import Env, register

x = 1
def oops(:
    pass
'''
FAILS_TO_START = '''
from molt_engine import Env, register


@register
class UserFragile(Env):
    name = "user_fragile"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        raise RuntimeError("no API key for the tool")
'''


@pytest.fixture
def env_dir(tmp_path):
    """A directory with one good env, one file with a syntax error (line 5) and one env whose constructor raises;
    whatever it registers is removed afterwards, so other tests see the built-in envs only."""
    (tmp_path / "echo.py").write_text(ECHO)
    (tmp_path / "broken.py").write_text(BROKEN)
    (tmp_path / "fragile.py").write_text(FAILS_TO_START)
    before = set(ENVS)
    yield tmp_path
    for name in set(ENVS) - before:
        del ENVS[name]
    for module in [m for m in sys.modules if m.startswith("molt_agents.")]:
        del sys.modules[module]


def test_a_broken_file_is_named_with_its_line_and_the_others_still_load(env_dir):
    with pytest.raises(EnvLoadError) as failed:
        load_agents_dir(env_dir)
    assert list(failed.value.errors) == [str(env_dir / "broken.py")]
    assert failed.value.errors[str(env_dir / "broken.py")].startswith(f"{env_dir / 'broken.py'}:5: SyntaxError")
    assert {"user_echo", "user_fragile"} <= set(ENVS)


def test_an_env_whose_constructor_raises_is_refused_naming_the_file_and_line(env_dir):
    with pytest.raises(EnvLoadError):
        load_agents_dir(env_dir)
    with pytest.raises(ValidationError) as refused:
        RunConfig.model_validate({"env": "user_fragile"})
    assert f"{env_dir / 'fragile.py'}:11: RuntimeError: no API key for the tool" in str(refused.value)


def test_molt_train_refuses_an_env_of_a_broken_file_with_exit_2(env_dir):
    (env_dir / "echo.py").unlink()
    (env_dir / "fragile.py").unlink()
    (env_dir / "broken.py").write_text(BROKEN + ECHO.replace("user_echo", "user_broken"))
    done = subprocess.run(molt("train", "--envs", str(env_dir), "--env", "user_broken", "--out",
                               str(env_dir / "out")), capture_output=True, text=True, cwd=ROOT,
                          env=child_env(env_dir / "home"), timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"{env_dir / 'broken.py'}:5: SyntaxError" in done.stderr
    assert "unknown env 'user_broken'" in done.stderr


@pytest.mark.slow  # ~30 s end to end: runs in CI with the slow tests
def test_served_user_env_is_listed_launched_and_completes_beside_a_built_in_run(env_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    with serve(home, "--envs", str(env_dir)) as served:
        assert f"{env_dir / 'broken.py'}:5: SyntaxError" in served.output  # said at start
        envs = {e["name"]: e for e in served.client.get("/api/v1/envs").json()}
        assert envs["user_echo"]["source"] == str(env_dir / "echo.py")
        assert envs["max_digit"]["source"] is None

        refused = served.client.post("/api/v1/runs", json={"config": {**FAST, "env": "user_fragile"}})
        assert refused.status_code == 422
        assert f"{env_dir / 'fragile.py'}:11: RuntimeError" in refused.text

        (env_dir / "late.py").write_text(textwrap.dedent(BROKEN))  # added while serving: named at submit
        refused = served.client.post("/api/v1/runs", json={"config": {**FAST, "env": "user_late"}})
        assert refused.status_code == 422
        assert f"{env_dir / 'late.py'}:5: SyntaxError" in refused.text

        user = served.create({**FAST, "env": "user_echo", "loop": {**FAST["loop"], "steps": 10}})
        built_in = served.create({**FAST, "loop": {**FAST["loop"], "steps": 10}})
        assert served.wait(user["id"], timeout=300)["status"] == "completed"
        assert served.wait(built_in["id"], timeout=300)["status"] == "completed"


USER_AGENT = '''
import openai
from molt_engine import Agent, register


@register
class UserAgent(Agent):
    """Ask once with the OpenAI SDK; reward the length of the reply, odd or even."""
    name = "user_agent"
    max_tokens = 4

    async def run(self, ctx):
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "Hi"}])
        return float(len(reply.choices[0].message.content or "") % 2)
'''


def test_molt_train_runs_a_user_agent_from_the_env_directory(tmp_path):
    """No demonstration: the default warm start is skipped, and said."""
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "agent.py").write_text(USER_AGENT)
    (tmp_path / "run.json").write_text(json.dumps({"loop": {"groups_per_step": 2, "group_size": 4, "eval_every": 0}}))
    done = subprocess.run(molt("train", "--envs", str(tmp_path / "envs"), "--env", "user_agent", "--preset",
                               "tiny-chat", "--steps", "3", "--config", str(tmp_path / "run.json"), "--out",
                               str(tmp_path / "out")),
                          capture_output=True, text=True, cwd=ROOT, env=child_env(tmp_path / "home"), timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["status"] == "completed" and summary["segments_per_episode"] == 1.0
    assert summary["agent_errors"] == 0 and "env_errors" not in summary
    assert "user_agent has no demonstrations: no warm start" in done.stdout + done.stderr


def test_an_installed_env_package_registers_through_its_entry_point_and_a_broken_one_is_named(tmp_path):
    """A package of envs a user pip-installs names itself in the entry point group `molt.envs` (here: its dist-info on
    the path, as pip writes it); every molt process then has its envs beside the built-ins. One that fails to import
    is named on stderr and the rest load."""
    site = tmp_path / "site"
    for name, code in (("user_envs_pkg", ECHO), ("broken_envs_pkg", "raise RuntimeError('half installed')\n")):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(code)
        info = site / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[molt.envs]\nenvs = {name}\n")
    proc = subprocess.run([sys.executable, "-c", "import molt_engine; print(' '.join(sorted(molt_engine.ENVS)))"],
                          env=child_env(tmp_path, PYTHONPATH=f"{site}{os.pathsep}{ROOT}"), cwd=tmp_path,
                          capture_output=True, text=True, check=True)
    assert {"user_echo", "max_digit", "chat_calculator", "calculator_agent", "dataset"} <= set(proc.stdout.split())
    assert "molt: the env package broken_envs_pkg did not load: RuntimeError: half installed" in proc.stderr
