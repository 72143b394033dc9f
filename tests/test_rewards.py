"""Reward terms beyond the env's (molt_rewards): weighted functions (sync and async), a reward model made here, and
LLM judges served over real HTTP (scoring, hanging, failing), each through a real training run."""
import json
import math
import socket
import threading
import time

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from molt_engine import RunConfig, config_errors, train
from molt_engine.config import ValidationError
from molt_engine.envs import load_user_envs
from molt_engine.models import load_policy

BASE = {"env": "max_digit", "model": {"preset": "tiny-dense"}, "seed": 0, "warm_start": {"steps": 0},
        "checkpoint": {"every": 0}, "record": {"samples_per_step": 2},
        "loop": {"steps": 2, "groups_per_step": 2, "group_size": 4, "eval_every": 0}}


class Recorder:
    """A sink that keeps what the run reports."""

    def __init__(self):
        self.steps, self.records, self.events = {}, [], []

    def metrics(self, step, values): self.steps[step] = values
    def alert(self, kind, message, **data): pass
    def event(self, kind, message, **data): self.events.append((kind, message))
    def checkpoint(self, step, path, **info): pass
    def samples(self, step, kind, records): self.records += records


def run(config: dict, tmp_path) -> Recorder:
    sink = Recorder()
    train(config, sink, out_dir=tmp_path / "run")
    return sink


def prompt_and_completion(record: dict, tokenizer) -> tuple[str, str]:
    """What the terms score: the recorded episode's text before its first action and from it on."""
    ids, actions = record["tokens"]["id"], record["tokens"]["action"]
    first = actions.index(True)
    return (tokenizer.decode(ids[:first], skip_special_tokens=True),
            tokenizer.decode(ids[first:], skip_special_tokens=True))


@pytest.fixture
def reward_functions(tmp_path, monkeypatch):
    (tmp_path / "fns").mkdir()
    (tmp_path / "fns" / "terms.py").write_text(
        "import asyncio\n"
        "def length(prompt, completion, env_reward):\n"
        "    return float(len(completion))\n"
        "async def digits(prompt, completion, env_reward):\n"
        "    await asyncio.sleep(0.01)  # an async reward awaits (a judge, a sandbox) without holding the loop\n"
        "    return float(sum(c.isdigit() for c in completion)) + env_reward\n")
    monkeypatch.setenv("MOLT_ENVS", str(tmp_path / "fns"))
    load_user_envs()


def test_weighted_terms_sync_and_async_each_recorded(tmp_path, reward_functions):
    config = {**BASE, "rewards": {"env_weight": 2.0, "terms": [
        {"name": "length", "function": "terms:length", "weight": 0.5},
        {"name": "digits", "function": "terms:digits", "weight": -1.0}]}}
    sink = run(config, tmp_path)
    _, tokenizer = load_policy(RunConfig.model_validate(config).model, 0)
    for values in sink.steps.values():
        assert {"reward/env", "reward/length", "reward/digits"} <= set(values)
        combined = 2.0 * values["reward/env"] + 0.5 * values["reward/length"] - values["reward/digits"]
        assert values["reward_mean"] == pytest.approx(combined, abs=1e-5)
    assert len(sink.records) == 2 * 2 * 4
    for record in sink.records:  # each episode's own reward, from its own text
        _, completion = prompt_and_completion(record, tokenizer)
        env = float(record["success"])  # max_digit: 1 for the right digit, else 0
        expected = 2 * env + 0.5 * len(completion) - (sum(c.isdigit() for c in completion) + env)
        assert record["reward"] == pytest.approx(expected)


def test_bad_reward_terms_are_refused_naming_the_field(tmp_path, reward_functions):
    def errors(rewards):
        with pytest.raises(ValidationError) as e:
            RunConfig.model_validate({**BASE, "rewards": rewards})
        return "\n".join(config_errors(e.value))
    assert "exactly one of function, model, judge (got none)" in errors({"terms": [{"name": "x"}]})
    assert "unknown reward function 'terms:nope'" in errors({"terms": [{"name": "x", "function": "terms:nope"}]})
    assert "not a Hugging Face model directory" in errors({"terms": [{"name": "x", "model": str(tmp_path)}]})
    assert "must be unique" in errors({"terms": [{"name": "x", "function": "terms:length"}] * 2})
    assert "api_key_env" in errors({"terms": [{"name": "j", "judge": {"base_url": "http://x", "model": "m",
                                                                     "api_key_env": "not a name"}}]})
