"""Reward terms beyond max_digit: weighted terms on an agent that speaks all three APIs (its segments share the
episode's reward) and on the dataset env, and a hand-built judge model served by the project's own OpenAI-compatible
stack (molt_engine/serving) as an endpoint judge, pointwise and per group."""
import asyncio
import json
import re
import threading

import anthropic
import openai
import pytest
from test_invariants import registered  # noqa: F401  (the fixture)
from test_rewards import BASE, judged, prompt_and_completion, reward_functions, run, scripted_judge  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt_engine import RunConfig
from molt_engine.chat import hermes, stop_ids
from molt_engine.envs import load_user_envs
from molt_engine.inference.sampler import Sampler
from molt_engine.models import load_policy
from molt_engine.serving.agents import Agent, AgentContext
from molt_engine.serving.server import AgentServer
from molt_rewards.judges import read_scores

# The env's reward doubled, plus half the scored completion's length, less (its digits + the env's reward)
TERMS = {"env_weight": 2.0, "terms": [{"name": "length", "function": "terms:length", "weight": 0.5},
                                      {"name": "digits", "function": "terms:digits", "weight": -1.0}]}


def expected(env: float, completion: str) -> float:
    """TERMS' reward of an episode whose env reward is `env` and whose scored completion is `completion`."""
    return 2 * env + 0.5 * len(completion) - (sum(c.isdigit() for c in completion) + env)


def check_step_metrics(sink, config: dict):
    """Each term is its own metric, and the step's mean reward is their weighted sum (means over episodes)."""
    assert len(sink.steps) == config["loop"]["steps"]
    for values in sink.steps.values():
        assert {"reward/env", "reward/length", "reward/digits"} <= set(values)
        combined = 2.0 * values["reward/env"] + 0.5 * values["reward/length"] - values["reward/digits"]
        assert values["reward_mean"] == pytest.approx(combined, abs=1e-5)


class ThreeAPIs(Agent):
    """One request on each API the endpoint speaks (Chat Completions, Responses, Anthropic's Messages), each a
    conversation of its own, so a segment of its own. Its reward: the first reply's token count (1 to 6)."""
    name = "test_three_apis_agent"
    max_tokens = 6

    async def run(self, ctx: AgentContext) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key,
                                      http_client=ctx.http_client) as client:
            first = await client.chat.completions.create(model=ctx.model,
                                                         messages=[{"role": "user", "content": "First."}])
            await client.responses.create(model=ctx.model, input="Second.")
        async with anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key) as claude:
            await claude.messages.create(model=ctx.model, max_tokens=self.max_tokens,
                                         messages=[{"role": "user", "content": "Third."}])
        return float(first.usage.completion_tokens)


def test_terms_weigh_into_an_agents_reward_shared_by_its_segments(tmp_path, reward_functions, registered):
    """The terms score the episode's last segment (the Messages request: the most context); the combined reward
    goes to each of its three segments. One step: its requests are sampled one after another (~45 s on 2 loaded
    cores)."""
    registered(ThreeAPIs)
    config = {**BASE, "env": ThreeAPIs.name, "model": {"preset": "tiny-chat"}, "rewards": TERMS,
              "loop": {**BASE["loop"], "steps": 1}}
    sink = run(config, tmp_path)
    _, tokenizer = load_policy(RunConfig.model_validate(config).model, 0)
    check_step_metrics(sink, config)
    assert all(v["segments_per_episode"] == 3.0 for v in sink.steps.values())
    groups = {}
    for record in sink.records:
        groups.setdefault((record["version"], record["group"]), []).append(record)
    assert len(groups) == 2 and sum(map(len, groups.values())) == 2 * 4 * 3  # 2 groups x 4 episodes x 3 segments
    for rows in groups.values():
        for first, second, third in zip(rows[0::3], rows[1::3], rows[2::3]):  # an episode's segments, in order
            assert "First." in first["prompt"] and "Second." in second["prompt"] and "Third." in third["prompt"]
            env = float(sum(first["tokens"]["action"]))  # the agent's reward: its first reply's token count
            reward = expected(env, prompt_and_completion(third, tokenizer)[1])
            assert [r["reward"] for r in (first, second, third)] == pytest.approx([reward] * 3)


def test_terms_weigh_into_the_dataset_envs_reward(tmp_path, reward_functions):
    """A dataset whose own reward is a user's function of the row and the reply (the row's answer plus the reply's
    h's, a letter in no special token: the terms see the reply without them): each episode's recorded reward is the
    weighted sum of it and the terms."""
    (tmp_path / "fns" / "rows.py").write_text("def answer_and_hs(completion, answer, **columns):\n"
                                              "    return float(answer) + completion.count('h')\n")
    load_user_envs()
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Row {n}?", "answer": str(n)}) + "\n" for n in (1, 2, 3)))
    config = {**BASE, "env": "dataset", "model": {"preset": "tiny-chat"}, "rewards": TERMS,
              "env_args": {"path": str(path), "reward": "rows:answer_and_hs", "max_tokens": 8}}
    sink = run(config, tmp_path)
    _, tokenizer = load_policy(RunConfig.model_validate(config).model, 0)
    check_step_metrics(sink, config)
    assert len(sink.records) == 2 * 2 * 4
    for record in sink.records:
        _, completion = prompt_and_completion(record, tokenizer)
        env = float(re.search(r"Row (\d)\?", record["prompt"]).group(1)) + completion.count("h")
        assert record["reward"] == pytest.approx(expected(env, completion))


class ServedJudge:
    """A hand-built judge model (test_rewards.scripted_judge) hosted by the project's own OpenAI-compatible server
    (molt_engine/serving: what agents call the policy through) on 127.0.0.1, decoded by the engine's sampler, in an
    event loop of a thread of its own. That server serves its model under an agent episode's URL and key: here one
    episode, open until close(), whose requests are the judge's calls, decoded greedily (as eval episodes are)."""

    def __init__(self, path: str):
        model, self.tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
        stops = stop_ids(self.tokenizer, model.generation_config)
        self.server = AgentServer(self.tokenizer, stops, 4096, hermes, "scripted-judge", 0)
        self.sampler = Sampler(model, stops, self.tokenizer.pad_token_id, 1.0)
        self.ready, host = threading.Event(), self

        class Host(Agent):
            name, max_tokens, timeout = "judge host", 32, 3600.0

            async def run(self, ctx: AgentContext) -> float:
                host.ctx, host.episode = ctx, next(iter(host.server.episodes.values()))
                host.loop, host.done = asyncio.get_running_loop(), asyncio.Event()
                host.ready.set()
                await host.done.wait()
                return 0.0
        self.thread = threading.Thread(target=asyncio.run, args=(self.serve(Host()),), daemon=True)
        self.thread.start()
        assert self.ready.wait(120), "the judge endpoint did not open"

    async def serve(self, host: Agent):
        tasks = [asyncio.create_task(self.server.serve()), asyncio.create_task(self.sampler.run())]
        try:
            await self.server.episode(host, self.sampler, 0, 0, 0, True)
        finally:
            for task in tasks:
                task.cancel()

    def judge(self, **settings) -> dict:
        # One episode answers its requests one at a time (its lock): on a loaded machine a call may wait past the
        # default 30 s behind the others. No retry either: each answer here is one call's
        return {"base_url": self.ctx.base_url, "model": self.ctx.model, "api_key_env": "JUDGE_KEY", "timeout_s": 300,
                "retries": 0, **settings}

    def answers(self) -> list[tuple[str, str]]:
        """(prompt, reply) of each call it answered: the text before the model's sampled tokens, and theirs."""
        decode = self.tokenizer.decode
        return [(decode([t for t, a in zip(s.token_ids, s.is_action) if not a]),
                 decode([t for t, a in zip(s.token_ids, s.is_action) if a], skip_special_tokens=True))
                for s in self.episode.segments]

    def close(self):
        self.loop.call_soon_threadsafe(self.done.set)
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture
def served_judge(tmp_path, monkeypatch):
    served = []

    def serve(reply: str) -> ServedJudge:
        served.append(ServedJudge(scripted_judge(tmp_path / "judge", reply)))
        monkeypatch.setenv("JUDGE_KEY", served[-1].ctx.api_key)  # the episode's own key: others get a 401
        return served[-1]
    yield serve
    for judge in served:
        judge.close()


def replies_to(answers: list[tuple[str, str]], request: str) -> list[str]:
    """The model's replies to the calls whose request (as the model saw it) holds `request`: the judge's user message
    to its end of turn. The loop may sample, and judge, groups past its last step: calls no record stands for."""
    replies = [reply for prompt, reply in answers if request + "<|im_end|>" in prompt]
    assert replies, f"no call asked {request!r}"
    return replies


def test_a_served_model_judges_each_answer(tmp_path, served_judge):
    """Pointwise: one call per episode; each episode's reward is the score in the model's reply to its call."""
    judge = served_judge('{"score": 0.75}')
    config = judged(judge.judge())
    sink = run(config, tmp_path)
    _, tokenizer = load_policy(RunConfig.model_validate(config).model, 0)
    answers = judge.answers()
    assert len(sink.records) == 16 and len(answers) >= 16 and all('{"score": S}' in p for p, _ in answers)
    for record in sink.records:
        prompt, completion = prompt_and_completion(record, tokenizer)
        for reply in replies_to(answers, f"Question:\n{prompt}\n\nAnswer:\n{completion}"):
            # the model answered as it was built to (read_scores raises on anything else), and that is the reward
            assert read_scores(reply, 0) == [record["reward"]] == [0.75]
    for values in sink.steps.values():
        assert values["reward/judge"] == 0.75 and values["judge_errors"] == values["judge_timeouts"] == 0


def test_a_served_model_judges_a_group_in_one_call(tmp_path, served_judge):
    """Group mode (groups of 2: the model's reply must hold 2 scores): one call per group; each answer gets the
    score at its position in the model's reply to the group's call."""
    judge = served_judge('{"scores":[1,0.5]}')
    config = judged(judge.judge(mode="group"))
    config["loop"] = {**config["loop"], "group_size": 2}
    sink = run(config, tmp_path)
    _, tokenizer = load_policy(RunConfig.model_validate(config).model, 0)
    answers = judge.answers()
    groups = {}
    for record in sink.records:
        groups.setdefault((record["version"], record["group"]), []).append(record)
    assert len(groups) == 4 and len(answers) >= 4  # 2 steps x 2 groups
    for records in groups.values():
        texts = [prompt_and_completion(r, tokenizer) for r in records]
        answered = "".join(f"Answer {i + 1}:\n{completion}\n\n" for i, (_, completion) in enumerate(texts))
        request = f"Question:\n{texts[0][0]}\n\n{answered}"
        for reply in replies_to(answers, request):
            assert read_scores(reply, 2) == [r["reward"] for r in records] == [1.0, 0.5]
    for values in sink.steps.values():
        assert values["reward/judge"] == 0.75 and values["judge_errors"] == values["judge_timeouts"] == 0
