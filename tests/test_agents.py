"""Agents in any framework: the loopback OpenAI server driven by the real `openai` SDK, token-exact segments, and the
OpenAI errors, on tiny-chat."""
import asyncio
import contextlib
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from test_invariants import action_runs, capture, registered, trained_as_sampled  # noqa: F401  (the fixtures)

from molt_engine import EnvFailure, NullSink, RunConfig, train
from molt_engine.serving.agents import Agent, AgentContext
from molt_envs.agents import CALCULATOR
from molt_engine.algo import advantages
from molt_engine.chat import hermes, stop_ids
from molt_engine.config import ModelConfig
from molt_engine.envs import DEMO_SEEDS
from molt_engine.models import chat_tokenizer, load_policy
from molt_engine.rollout import Rollout
from molt_engine.inference.sampler import Sampler
from molt_engine.serving.server import AgentServer

SMALL = {"groups_per_step": 2, "group_size": 4, "eval_every": 0}
QUESTION = {"role": "user", "content": "What is 2*3? Check three times."}


class ThreeCallsAgent(Agent):
    """Three calculator calls through the OpenAI SDK, then the answer. Over 127.0.0.1 with a client of its own, or
    streamed and in process (`ctx.http_client`) when `stream` is set."""
    name = "test_three_calls_agent"
    tools = [CALCULATOR]  # a list: the SDK sends it as it is
    max_tokens = 32
    stream = False

    async def run(self, ctx: AgentContext) -> float:
        messages = [QUESTION]
        http = ctx.http_client if self.stream else None
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=http) as client:
            for _ in range(4):
                message = await self.ask(client, ctx.model, messages)
                messages.append(message)
                if not message.get("tool_calls"):
                    return float(message.get("content", "").strip() == "6")
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": "6"} for c in message["tool_calls"]]
        return 0.0

    async def ask(self, client, model, messages) -> dict:
        if not self.stream:
            reply = await client.chat.completions.create(model=model, messages=messages, tools=self.tools)
            return reply.choices[0].message.model_dump(exclude_none=True)
        message, calls = {"role": "assistant", "content": ""}, {}
        async for chunk in await client.chat.completions.create(model=model, messages=messages, tools=self.tools,
                                                                 stream=True):
            for choice in chunk.choices:
                message["content"] += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    calls[call.index] = call.model_dump(exclude_none=True)
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        return message

    def demonstration(self, seed):
        call = {"id": "call_0", "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": "2*3"})}}
        replies = [{"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_0", "content": "6"}] * 3
        return [QUESTION, *replies, {"role": "assistant", "content": "6"}]


class StreamingThreeCallsAgent(ThreeCallsAgent):
    name = "test_three_calls_agent_streaming"
    stream = True


class RewritingAgent(Agent):
    """Asks, then asks again with its first reply rewritten: the second request cannot extend the first segment."""
    name = "test_rewriting_agent"
    max_tokens = 6

    async def run(self, ctx: AgentContext) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
            messages = [{"role": "user", "content": "Say something."}]
            first = await client.chat.completions.create(model=ctx.model, messages=messages)
            messages += [{"role": "assistant", "content": "(rewritten) " + (first.choices[0].message.content or "")},
                         {"role": "user", "content": "Again."}]
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return float(len(first.choices[0].message.content or "") % 2)  # differs within a group

    def demonstration(self, seed):
        return [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "ok"}]


@pytest.mark.parametrize("agent", [ThreeCallsAgent, StreamingThreeCallsAgent])
def test_agent_turns_train_exactly_the_sampled_tokens(capture, registered, agent):
    registered(agent)
    # A warm start that makes whole calls likely when sampled at temperature 0.5: the agent gets three in a row.
    summary = train({"env": agent.name, "model": {"preset": "tiny-chat"},
                     "loop": {**SMALL, "steps": 2, "max_staleness": 0, "temperature": 0.5},
                     "warm_start": {"steps": 100, "batch_size": 8, "lr": 1e-3}})
    assert summary["status"] == "completed"
    three_calls = 0
    for ep in trained_as_sampled(capture):  # each run of actions is one request's sample, with its log-probs
        assert ep.info["segment"] == 0 and ep.info["turns"] == len(action_runs(ep))
        three_calls += ep.info["tool_calls"] == 3
    assert three_calls > 0  # the warm start taught the three calls: the agent really made three tool turns
    assert len(capture["losses"]) == 2
    for logp, behav, mask in capture["losses"]:
        assert mask.any() and (logp[mask] - behav[mask]).abs().max() <= 1e-5
    assert summary["segments_per_episode"] == 1.0 and summary["agent_requests_per_episode"] >= 1.0


def test_an_agent_that_rewrites_its_history_trains_two_segments(capture, registered):
    registered(RewritingAgent)
    summary = train({"env": RewritingAgent.name, "model": {"preset": "tiny-chat"},
                     "loop": {**SMALL, "steps": 2, "max_staleness": 0}, "warm_start": {"steps": 0}})
    assert summary["segments_per_episode"] == 2.0 and summary["agent_requests_per_episode"] == 2.0
    rows = trained_as_sampled(capture)  # each segment's tokens: its own request's context and sample
    assert [e.info["segment"] for e in rows] == [0, 1] * (len(rows) // 2)
    assert all(len(action_runs(e)) == 1 for e in rows)  # one request per segment, nothing of the other's
    text = chat_tokenizer().decode
    for first, second in zip(rows[0::2], rows[1::2]):
        assert "(rewritten)" in text(second.token_ids) and "(rewritten)" not in text(first.token_ids)
        assert first.reward == second.reward
    # A later segment takes its episode's advantage, and the group baselines count each episode once (counted
    # twice, the group's std, hence every advantage, would differ).
    assert sum(float(a.abs().sum()) for a in capture["advantages"]) > 0
    for (episodes, _), adv in zip(capture["batches"], capture["advantages"]):
        for group in {e.group for e in episodes}:
            rows = [i for i, e in enumerate(episodes) if e.group == group]
            firsts = torch.tensor([[episodes[i].reward for i in rows if episodes[i].info["segment"] == 0]])
            assert torch.allclose(adv[rows], advantages(firsts, "grpo")[0].repeat_interleave(2))


@contextlib.asynccontextmanager
async def serving(limit: int = 1024):
    """A real server and sampler on a random tiny-chat policy, serving until the block ends."""
    model, tok = load_policy(ModelConfig(preset="tiny-chat"), seed=0)
    stops = stop_ids(tok)
    server = AgentServer(tok, stops, limit, hermes, "tiny-chat", 0)
    sampler = Sampler(model, stops, tok.pad_token_id, 1.0)
    tasks = [asyncio.create_task(server.serve()), asyncio.create_task(sampler.run())]
    try:
        yield server, sampler
    finally:
        for t in tasks:
            t.cancel()


async def _served(agent_run):
    """Run `agent_run(ctx, server)` as an agent episode; returns what it returned, the episode's segments and the
    sampler."""
    out = {}

    class Probe(Agent):
        name = "probe"
        max_tokens = 8

        async def run(self, ctx):
            out["value"] = await agent_run(ctx, server)
            return 1.0

    async with serving() as (server, sampler):
        segments = await server.episode(Probe(), sampler, 7, 0, 0, False)
    return out["value"], segments, sampler


def test_the_endpoint_answers_like_openai_and_records_one_segment():
    """Plain, streamed, logprobs, legacy completions and the model list, each through the SDK, extend one segment when
    the agent sends its history back as it got it; the server listens on 127.0.0.1 only."""
    async def agent(ctx, server):
        assert ctx.base_url.startswith(f"http://127.0.0.1:{server.port}/e/")
        # The kernel's table of listening sockets: this port listens on 127.0.0.1 (0100007F) and nothing else.
        table = Path("/proc/net/tcp").read_text().splitlines()[1:] + Path("/proc/net/tcp6").read_text().splitlines()[1:]
        listening = [line.split()[1] for line in table if line.split()[3] == "0A"]
        assert [a for a in listening if int(a.split(":")[1], 16) == server.port] == [f"0100007F:{server.port:04X}"]
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
            models = await client.models.list()
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
            first = await client.chat.completions.create(model=ctx.model, messages=messages, logprobs=True,
                                                         top_logprobs=3, max_tokens=5)
            messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More"}]
            streamed = [c async for c in await client.chat.completions.create(
                model=ctx.model, messages=messages, max_completion_tokens=4, stream=True,
                stream_options={"include_usage": True})]
        return models, first, streamed
    (models, first, streamed), segments, sampler = asyncio.run(_served(agent))
    assert [m.id for m in models.data] == ["tiny-chat"]
    choice = first.choices[0]
    assert choice.finish_reason in ("stop", "length") and len(choice.logprobs.content) == first.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in choice.logprobs.content)
    assert streamed[-1].usage.completion_tokens <= 4 and streamed[-2].choices[0].finish_reason in ("stop", "length")
    (segment,) = segments  # the second request extended the first's segment
    runs = action_runs(segment)
    assert len(runs) == 2 and segment.info["metrics"]["agent_requests_per_episode"] == 2
    first_ids = segment.token_ids[runs[0][0]:runs[0][1]]
    assert [round(lp, 4) for lp in segment.logprobs[runs[0][0]:runs[0][1]]] == [
        round(t.logprob, 4) for t in choice.logprobs.content]
    assert len(first_ids) == first.usage.completion_tokens
    assert sampler.stats["tokens"] == sum(b - a for a, b in runs)


def test_wrong_keys_unknown_models_bad_parameters_and_ended_episodes_get_openai_errors():
    async def agent(ctx, server):
        messages = [{"role": "user", "content": "Hi"}]
        errors = {}
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key="not-the-key", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError) as e:
                await wrong.chat.completions.create(model=ctx.model, messages=messages)
            errors["key"] = e.value
        other = next(ep for name, ep in server.episodes.items() if name not in ctx.base_url)
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=other.key, max_retries=0) as stolen:
            with pytest.raises(openai.AuthenticationError):
                await stolen.chat.completions.create(model=ctx.model, messages=messages)
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            with pytest.raises(openai.NotFoundError) as e:
                await client.chat.completions.create(model="gpt-4o", messages=messages)
            errors["model"] = e.value
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model=ctx.model, messages=messages, temperature=5)
            errors["param"] = e.value
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "x " * 300}])
            errors["long"] = e.value
        return errors
    errors, segments, _ = asyncio.run(two_episodes_served(agent))
    assert errors["key"].status_code == 401 and errors["key"].code == "invalid_api_key"
    assert errors["model"].status_code == 404 and "gpt-4o" in errors["model"].message
    assert errors["param"].status_code == 400 and errors["param"].param == "temperature"
    assert errors["long"].status_code == 400 and errors["long"].code == "context_length_exceeded"
    assert segments == []  # nothing was sampled: every request was refused before the sampler


async def two_episodes_served(agent_run):
    """As _served, with a second (idle) episode on the same server whose key the probe can try."""
    idle_started, idle_done, out = asyncio.Event(), asyncio.Event(), {}

    class Idle(Agent):
        name = "idle"

        async def run(self, ctx):
            out["idle"] = ctx
            idle_started.set()
            await idle_done.wait()
            return 0.0

    class Probe(Agent):
        name = "probe"

        async def run(self, ctx):
            await idle_started.wait()
            out["value"] = await agent_run(ctx, server)
            return 1.0

    async with serving(limit=256) as (server, sampler):
        idle = asyncio.create_task(server.episode(Idle(), sampler, 1, 0, 0, False))
        segments = await server.episode(Probe(), sampler, 7, 0, 1, False)
        idle_done.set()
        await idle
        # The idle episode has ended: its own key now gets a 409.
        async with openai.AsyncOpenAI(base_url=out["idle"].base_url, api_key=out["idle"].api_key,
                                      max_retries=0) as late:
            with pytest.raises(openai.ConflictError) as e:
                await late.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}])
        assert e.value.status_code == 409 and e.value.code == "episode_ended"
    return out["value"], segments, sampler


def test_a_retried_request_gets_the_recorded_reply_and_a_rewrite_starts_a_segment():
    async def agent(ctx, server):
        body = {"model": ctx.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
        headers = {"Authorization": f"Bearer {ctx.api_key}"}
        async with httpx.AsyncClient(base_url=ctx.base_url) as http:
            first = (await http.post("/chat/completions", json=body, headers=headers)).json()
            retry = (await http.post("/chat/completions", json=body,
                                     headers={**headers, "x-stainless-retry-count": "1"})).json()
            again = (await http.post("/chat/completions", json=body, headers=headers)).json()  # not a retry
            text = (await http.post("/completions", json={"model": ctx.model, "prompt": "12+3=", "max_tokens": 3},
                                    headers=headers)).json()
            more = (await http.post("/completions", headers=headers, json={
                "model": ctx.model, "prompt": "12+3=" + text["choices"][0]["text"] + " ok", "max_tokens": 3})).json()
        return first, retry, again, text, more
    (first, retry, again, text, more), segments, sampler = asyncio.run(_served(agent))
    assert retry == first  # the recorded reply, not a second sample
    assert again["id"] != first["id"]
    # Segments: the first request (its retry added nothing), the same question asked again, the text prompt and
    # its extension.
    assert [len(action_runs(s)) for s in segments] == [1, 1, 2]
    assert sampler.stats["tokens"] == sum(e - s for seg in segments for s, e in action_runs(seg))
    assert segments[0].info["metrics"]["segments_per_episode"] == 3
    assert more["usage"]["prompt_tokens"] > text["usage"]["total_tokens"]


def test_64_agents_at_once_are_batched_together_and_every_request_is_answered():
    class Twice(Agent):
        name = "twice"
        max_tokens = 8

        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client,
                                        max_retries=0)
            messages = [{"role": "user", "content": f"Count to {ctx.seed}."}]
            for _ in range(2):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "Go on."}]
            clients.append(ctx.http_client)
            return 1.0

    clients = []

    async def many():
        async with serving() as (server, sampler):
            return await asyncio.gather(*(server.episode(Twice(), sampler, i, i // 8, i % 8, False)
                                          for i in range(64))), sampler
    episodes, sampler = asyncio.run(many())
    assert len(episodes) == 64 and all(len(segments) == 1 for segments in episodes)
    assert len({id(c) for c in clients}) == 64 and all(c.is_closed for c in clients)  # each episode's own, closed
    assert all(len(action_runs(segments[0])) == 2 for segments in episodes)  # 128 requests, 128 replies recorded
    assert sampler.stats["tokens"] == sum(e - s for (seg,) in episodes for s, e in action_runs(seg))
    # Requests per decode step: the agents' requests were decoded together, not one by one.
    assert sampler.stats["rows"] / sampler.stats["steps"] >= 16


def test_a_forced_tool_call_starts_the_reply_with_the_call_opening_as_prompt():
    opening = '<tool_call>\n{"name": "calculator", "arguments": '

    async def agent(ctx, server):
        messages = [{"role": "user", "content": "What is 6*7?"}]
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            forced = await client.chat.completions.create(
                model=ctx.model, messages=messages, tools=[CALCULATOR], max_tokens=12,
                tool_choice={"type": "function", "function": {"name": "calculator"}})
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model=ctx.model, messages=messages, tool_choice="required")
        return forced.choices[0].message, e.value
    (message, error), (segment,), _ = asyncio.run(_served(agent))
    # A random policy rarely closes the call: then it comes back as content, opening included.
    assert (message.tool_calls and message.tool_calls[0].function.name == "calculator") or \
        message.content.startswith(opening)
    ((start, _),) = action_runs(segment)
    assert chat_tokenizer().decode(segment.token_ids[:start]).endswith("<|im_start|>assistant\n" + opening)
    assert error.status_code == 400 and error.param == "tool_choice" and "needs tools" in error.message


class FlakyAgent(Agent):
    """Asks once; for some prompts it then raises, for others it hangs past its timeout."""
    name = "test_flaky_agent"
    max_tokens = 4
    timeout = 5.0
    failed = {"raised": 0, "hung": 0}

    async def run(self, ctx):
        if ctx.seed % 5 == 3:
            self.failed["hung"] += 1
            await asyncio.Event().wait()
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
            await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "Hi"}])
        if ctx.seed % 5 == 1:
            self.failed["raised"] += 1
            raise RuntimeError("the agent's own bug")
        return float(ctx.seed % 2)


class Steps(NullSink):
    def __init__(self):
        self.rows = []

    def metrics(self, step, values):
        self.rows.append(values)


def test_agents_that_raise_or_hang_are_counted_and_dropped_and_most_failing_stops_the_run(registered, monkeypatch):
    registered(FlakyAgent)
    monkeypatch.setattr(FlakyAgent, "failed", {"raised": 0, "hung": 0})  # this test's counts only
    sink = Steps()
    summary = train({"env": FlakyAgent.name, "model": {"preset": "tiny-chat"}, "warm_start": {"steps": 0},
                     "loop": {**SMALL, "steps": 4}}, sink)
    assert summary["status"] == "completed"
    assert FlakyAgent.failed["raised"] > 0 and FlakyAgent.failed["hung"] > 0
    assert sum(r["agent_errors"] for r in sink.rows) == FlakyAgent.failed["raised"] + FlakyAgent.failed["hung"]

    registered(BrokenAgent)
    with pytest.raises(EnvFailure, match="the agent's own bug"):
        train({"env": BrokenAgent.name, "model": {"preset": "tiny-chat"}, "warm_start": {"steps": 0},
               "loop": {**SMALL, "steps": 4}})


def test_an_agent_cut_off_mid_request_by_its_timeout_stops_there():
    """`ctx.http_client` runs the server's handler in the agent's own task: the timeout reaches the agent as a
    cancellation, not as an error reply it could catch and go on from (or that the SDK would retry)."""
    caught = []

    class Patient(Agent):
        name = "patient"
        timeout = 1.0

        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
            while True:
                try:
                    await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "Hi"}])
                except openai.APIError as e:
                    caught.append(e)

    async def cut_off():
        model, tok = load_policy(ModelConfig(preset="tiny-chat"), seed=0)
        stops = stop_ids(tok)
        server = AgentServer(tok, stops, 1024, hermes, "tiny-chat", 0)
        idle = Sampler(model, stops, tok.pad_token_id, 1.0)  # never run: the request waits for it until the timeout
        serving = asyncio.create_task(server.serve())
        try:
            with pytest.raises(TimeoutError, match="ran longer than its timeout"):
                await server.episode(Patient(), idle, 0, 0, 0, False)
        finally:
            serving.cancel()
        return idle
    idle = asyncio.run(cut_off())
    assert caught == [] and len(idle.pending) == 1  # one request, never retried


class BrokenAgent(Agent):
    name = "test_broken_agent"

    async def run(self, ctx):
        raise RuntimeError("the agent's own bug")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~10 min in a clean-clone CI run on 2 busy cores: too close to the suite-wide 600 s
def test_an_agent_written_with_the_openai_sdk_learns_the_chat_calculator():
    """bench/chat_learning.py's recipe, seed 0: the warm start leaves the sampled reward <= 0.5, RL takes the 10-step
    mean to >= 0.8 (it took 13 steps there)."""
    sink = Steps()
    train({"env": "calculator_agent", "model": {"preset": "tiny-chat"}, "seed": 0,
           "warm_start": {"steps": 1000, "lr": 1e-3}, "checkpoint": {"every": 0},
           "loop": {"groups_per_step": 8, "group_size": 8, "eval_every": 0, "steps": 80}}, sink)
    rewards = [r["reward_mean"] for r in sink.rows]
    assert rewards[0] <= 0.5
    assert max(sum(rewards[i:i + 10]) / 10 for i in range(len(rewards) - 9)) >= 0.8
    assert all(r["agent_errors"] == 0 and r["segments_per_episode"] == 1.0 for r in sink.rows)


def test_the_calculator_agent_and_the_chat_calculator_warm_start_on_the_same_tokens():
    """The agent renders its demonstrations (whole conversations) as the env renders its replies: one warm start
    serves both (bench/chat_learning.py shares it), and the two paths learn the same task."""
    tok = chat_tokenizer()
    rows = {}
    for env in ("chat_calculator", "calculator_agent"):
        rollout = Rollout(RunConfig.model_validate({"env": env, "model": {"preset": "tiny-chat"}}), tok, 1024,
                          stop_ids(tok))
        rows[env] = [asyncio.run(rollout.demonstration(DEMO_SEEDS + i)) for i in range(50)]
    pairs = list(zip(rows["chat_calculator"], rows["calculator_agent"]))
    assert all(a.token_ids == b.token_ids and a.is_action == b.is_action for a, b in pairs)
    assert {sum(a.is_action) > 10 for a, _ in pairs} == {True, False}  # both kinds: a tool call, a head-answer


def test_training_samples_at_the_runs_temperature_whatever_a_request_asks_and_counts_it():
    """A training episode's `temperature: 0` or `top_p` would make the trained log-probs not the behaviour
    policy's: the server samples as the run does and counts the request; eval episodes decode greedily."""
    class Greedy(Agent):
        name = "greedy"
        max_tokens = 8

        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
            question = [{"role": "user", "content": "Hi"}]
            replies[ctx.seed] = []
            for asked in ({"temperature": 0}, {"top_p": 0.5}, {"temperature": 1.0}, {}):  # the last two: as the run
                reply = await client.chat.completions.create(model=ctx.model, messages=question, **asked)
                replies[ctx.seed].append(reply.choices[0].message.content)
            return 1.0

    replies = {}

    async def episodes(greedy):
        async with serving() as (server, sampler):
            return await asyncio.gather(*(server.episode(Greedy(), sampler, seed, 0, 0, greedy) for seed in range(4)))
    training = asyncio.run(episodes(False))
    sampled = [replies[seed][0] for seed in range(4)]
    assert len(set(sampled)) > 1  # temperature 0 asked, yet each seed drew its own sample
    assert all(rows[0].info["metrics"]["sampling_overrides"] == 2 for rows in training)
    evals = asyncio.run(episodes(True))
    assert len({tuple(replies[seed]) for seed in range(4)}) == 1  # greedy: the same replies whatever the seed
    assert all(rows[0].info["metrics"]["sampling_overrides"] == 0 for rows in evals)


def test_a_stop_string_ends_the_text_and_the_record_alike_so_a_react_loop_sees_it_once():
    """/v1/completions in a ReAct loop: the text ends before the stop (as OpenAI's does), the agent appends the stop
    and an observation, and the next prompt goes on from there. The record then reads as the agent's transcript:
    every request's kept tokens continue its prompt, and the stop is never there twice."""
    stop = "a"

    async def agent(ctx, server):
        prompt, finishes = "Thought: 12+3=", []
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        for _ in range(6):
            choice = (await client.completions.create(model=ctx.model, prompt=prompt, max_tokens=16,
                                                      stop=stop)).choices[0]
            assert stop not in choice.text
            asked, prompt = prompt, prompt + choice.text
            prompt += (stop if choice.finish_reason == "stop" else "") + " Observation: 15\nThought:"
        return asked, choice.text
    (asked, text), (segment,), sampler = asyncio.run(_served(agent))  # one segment: each request continued it
    assert sampler.stats["tokens"] > sum(b - a for a, b in action_runs(segment))  # stops cut replies: tokens left out
    # The record is the last request's prompt, then as much of its reply's text as whole tokens hold.
    record = chat_tokenizer().decode(segment.token_ids)
    assert record.startswith(asked) and (asked + text).startswith(record)


def test_a_chat_reply_cut_by_a_stop_string_is_recorded_without_it():
    async def agent(ctx, server):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        messages, choices = [{"role": "user", "content": "Hi"}], []
        for _ in range(6):
            choice = (await client.chat.completions.create(model=ctx.model, messages=messages, stop=["a"],
                                                           max_tokens=16)).choices[0]
            choices.append(choice)
            messages += [choice.message.model_dump(exclude_none=True), {"role": "user", "content": "More"}]
        return choices
    choices, segments, sampler = asyncio.run(_served(agent))
    assert all("a" not in c.message.content for c in choices)
    assert sampler.stats["tokens"] > sum(b - a for s in segments for a, b in action_runs(s))  # stops cut replies
    replies = [chat_tokenizer().decode(s.token_ids[a:b]) for s in segments for a, b in action_runs(s)]
    assert replies and all("a" not in reply for reply in replies)  # the stop's tokens are never trained
