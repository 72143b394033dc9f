"""Agents on the three APIs: the Responses and Anthropic Messages faces of the loopback server, driven by real
frameworks (the OpenAI Agents SDK on both of its models, LangChain, the anthropic SDK) that train token-exact, and a
fuzz pass over the three request schemas that never gets a 5xx."""
import asyncio
import json

import anthropic
import hypothesis
import hypothesis.strategies as st
import openai
import pytest
from agents import Agent as SDKAgent
from agents import ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, RunConfig, Runner, function_tool
from agents.exceptions import MaxTurnsExceeded
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from test_agents import _served
from test_invariants import action_runs, capture, registered, trained_as_sampled  # noqa: F401  (the fixtures)

from molt_engine import train
from molt_engine.serving.agents import Agent, AgentContext
from molt_envs.agents import CALCULATOR

QUESTION = "What is 2*3?"
SCHEMA = CALCULATOR["function"]


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers.

    Args:
        expression: integers joined by +, - or *, e.g. "12*7"
    """
    return "6"


class Calls(Agent):
    """Asks the question; the policy calls the calculator (it always answers 6), then answers. Subclasses speak
    through one framework each; the warm start's demonstrations are rendered with the tool schema that framework
    sends."""
    tools = [CALCULATOR]
    max_tokens = 32

    async def run(self, ctx: AgentContext) -> float:
        try:
            return float((await self.ask(ctx)).strip() == "6")
        except MaxTurnsExceeded:  # the policy kept calling: a wrong answer, not a broken episode
            return 0.0

    def demonstration(self, seed):
        call = {"id": "call_0", "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": "2*3"})}}
        return [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "6"}, {"role": "assistant", "content": "6"}]


def sdk_agent(model) -> SDKAgent:
    return SDKAgent(name="calculator agent", tools=[calculator], model=model,
                    model_settings=ModelSettings(max_tokens=Calls.max_tokens))


class AgentsSDKResponses(Calls):
    """The OpenAI Agents SDK on its Responses model, streamed."""
    name = "test_agents_sdk_responses"
    tools = [{"type": "function", "function": {"name": calculator.name, "description": calculator.description,
                                               "parameters": calculator.params_json_schema}}]

    async def ask(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        result = Runner.run_streamed(sdk_agent(OpenAIResponsesModel(ctx.model, client)), QUESTION, max_turns=4,
                                     run_config=RunConfig(tracing_disabled=True))
        async for _ in result.stream_events():
            pass
        return str(result.final_output)


class AgentsSDKChat(AgentsSDKResponses):
    """The OpenAI Agents SDK on its Chat Completions model."""
    name = "test_agents_sdk_chat"
    tools = [{"type": "function", "function": {"name": calculator.name, "description": calculator.description,
                                               "parameters": calculator.params_json_schema, "strict": True}}]

    async def ask(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        result = await Runner.run(sdk_agent(OpenAIChatCompletionsModel(ctx.model, client)), QUESTION, max_turns=4,
                                  run_config=RunConfig(tracing_disabled=True))
        return str(result.final_output)


class LangChainAgent(Calls):
    """LangChain's ChatOpenAI with bind_tools, its own tool loop."""
    name = "test_langchain_agent"

    async def ask(self, ctx):
        llm = ChatOpenAI(model=ctx.model, base_url=ctx.base_url, api_key=ctx.api_key,
                         http_async_client=ctx.http_client, max_tokens=self.max_tokens).bind_tools([CALCULATOR])
        messages = [HumanMessage(QUESTION)]
        for _ in range(4):
            reply = await llm.ainvoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                return reply.content
            messages += [ToolMessage("6", tool_call_id=call["id"]) for call in reply.tool_calls]
        return ""


class AnthropicAgent(Calls):
    """Anthropic's SDK (Messages API, streamed), its own tool loop."""
    name = "test_anthropic_agent"

    async def ask(self, ctx):
        client = anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key)
        tools = [{"name": SCHEMA["name"], "description": SCHEMA["description"], "input_schema": SCHEMA["parameters"]}]
        messages = [{"role": "user", "content": QUESTION}]
        for _ in range(4):
            async with client.messages.stream(model=ctx.model, max_tokens=self.max_tokens, messages=messages,
                                              tools=tools) as stream:
                reply = await stream.get_final_message()
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            calls = [b for b in reply.content if b.type == "tool_use"]
            if not calls:
                return "".join(b.text for b in reply.content if b.type == "text")
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "6"}
                                                         for b in calls]})
        return ""


@pytest.mark.parametrize("agent", [AgentsSDKResponses, AgentsSDKChat, LangChainAgent, AnthropicAgent])
def test_an_agent_in_each_framework_trains_the_tokens_it_sampled(capture, registered, agent):
    registered(agent)
    summary = train({"env": agent.name, "model": {"preset": "tiny-chat"},
                     "loop": {"groups_per_step": 2, "group_size": 4, "eval_every": 0, "steps": 2, "max_staleness": 0,
                              "temperature": 0.5},
                     "warm_start": {"steps": 100, "batch_size": 8, "lr": 1e-3}})
    assert summary["status"] == "completed"
    rows = trained_as_sampled(capture)  # each run of actions is one request's sample, with its log-probs
    assert rows and all(ep.info["turns"] == len(action_runs(ep)) for ep in rows if ep.info["segment"] == 0)
    # multi-turn with a tool: the framework ran the calculator and came back with its result
    assert max(ep.info["tool_calls"] for ep in rows if ep.info["segment"] == 0) >= 1
    assert max(len(action_runs(ep)) for ep in rows) >= 2
    for logp, behav, mask in capture["losses"]:
        assert mask.any() and (logp[mask] - behav[mask]).abs().max() <= 1e-5


def test_responses_and_messages_extend_one_segment_plain_streamed_and_by_previous_response_id():
    """Each API's requests that go on from the last reply append only the template's delta: one segment."""
    tool = {"type": "function", "name": SCHEMA["name"], "parameters": SCHEMA["parameters"]}

    async def responses(ctx, server):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        first = await client.responses.create(model=ctx.model, input=QUESTION, tools=[tool], instructions="Be brief.")
        items = [{"role": "user", "content": QUESTION}] + [o.model_dump(exclude_none=True) for o in first.output]
        async with await client.responses.create(model=ctx.model, input=items + [{"role": "user", "content": "Sure?"}],
                                                 tools=[tool], instructions="Be brief.", stream=True) as stream:
            kinds = [event.type async for event in stream]
        third = await client.responses.create(model=ctx.model, input="Once more.", tools=[tool],
                                              previous_response_id=first.id)  # a new segment: no instructions
        return first, kinds, third

    (first, kinds, third), segments, _ = asyncio.run(_served(responses))
    assert first.object == "response" and first.output and first.usage.output_tokens > 0
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_item.done" in kinds
    assert third.output and third.previous_response_id == first.id
    assert len(segments) == 2 and len(action_runs(segments[0])) == 2 and len(action_runs(segments[1])) == 1

    async def messages(ctx, server):
        client = anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key)
        tools = [{"name": SCHEMA["name"], "input_schema": SCHEMA["parameters"]}]
        conversation = [{"role": "user", "content": QUESTION}]
        first = await client.messages.create(model=ctx.model, max_tokens=8, system="Be brief.", tools=tools,
                                             messages=conversation)
        conversation += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                         {"role": "user", "content": "Sure?"}]
        async with client.messages.stream(model=ctx.model, max_tokens=8, system="Be brief.", tools=tools,
                                          messages=conversation) as stream:
            kinds = [event.type async for event in stream]
            second = await stream.get_final_message()
        return first, kinds, second

    (first, kinds, second), segments, _ = asyncio.run(_served(messages))
    assert first.type == "message" and first.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert first.usage.output_tokens > 0 and second.content
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert len(segments) == 1 and len(action_runs(segments[0])) == 2


def test_each_api_answers_bad_input_in_its_own_error_shape():
    async def probe(ctx, server):
        out = {}
        http, key = ctx.http_client, {"authorization": f"Bearer {ctx.api_key}"}
        out["responses"] = await http.post(f"{ctx.base_url}/responses", json={"model": ctx.model, "input": []},
                                           headers=key)
        out["responses_item"] = await http.post(f"{ctx.base_url}/responses", headers=key, json={
            "model": ctx.model, "input": [{"type": "item_reference", "id": "x"}]})
        out["responses_previous"] = await http.post(f"{ctx.base_url}/responses", headers=key, json={
            "model": ctx.model, "input": "hi", "previous_response_id": "resp_nope"})
        out["messages"] = await http.post(f"{ctx.base_url}/messages", headers={"x-api-key": ctx.api_key}, json={
            "model": ctx.model, "messages": [{"role": "user", "content": "hi"}]})  # no max_tokens
        out["messages_key"] = await http.post(f"{ctx.base_url}/messages", headers={"x-api-key": "wrong"}, json={
            "model": ctx.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        out["messages_choice"] = await http.post(f"{ctx.base_url}/messages", headers={"x-api-key": ctx.api_key},
                                                 json={"model": ctx.model, "max_tokens": 4, "tool_choice": {"type": "x"},
                                                       "messages": [{"role": "user", "content": "hi"}]})
        return out

    out, _, _ = asyncio.run(_served(probe))
    for name in ("responses", "responses_item", "responses_previous"):
        assert out[name].status_code == 400 and out[name].json()["error"]["type"] == "invalid_request_error", name
    assert "previous_response_id" in out["responses_previous"].json()["error"]["message"]
    assert "item_reference" in out["responses_item"].json()["error"]["message"]
    for name, status, kind in [("messages", 400, "invalid_request_error"), ("messages_key", 401, "authentication_error"),
                               ("messages_choice", 400, "invalid_request_error")]:
        body = out[name].json()
        assert out[name].status_code == status and body["type"] == "error" and body["error"]["type"] == kind, name
    assert "max_tokens" in out["messages"].json()["error"]["message"]


JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
FIELDS = {"chat/completions": ["messages", "tools", "tool_choice", "max_tokens", "stop", "n", "stream", "logprobs"],
          "responses": ["input", "instructions", "tools", "tool_choice", "max_output_tokens", "previous_response_id",
                        "stream"],
          "messages": ["messages", "system", "tools", "tool_choice", "max_tokens", "stop_sequences", "stream"]}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", 3]),
                                 "content": JSON | st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "tool_use", "tool_result", "input_text"]),
                                      "text": JSON, "input": JSON, "content": JSON}), max_size=2)})


def test_a_fuzz_pass_over_the_three_request_schemas_gets_4xx_never_5xx():
    """Random bodies (the schema's own fields with random JSON, messages of random blocks) on each API: every answer
    below 500, in that API's error shape when it is an error."""
    async def fuzz(ctx, server):
        seen = []

        @hypothesis.settings(max_examples=150, deadline=None, database=None, derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(st.sampled_from(sorted(FIELDS)), st.data())
        def case(api, data):
            body = {"model": ctx.model, **data.draw(st.dictionaries(st.sampled_from(FIELDS[api]), JSON, max_size=4))}
            if data.draw(st.booleans()):
                body["messages" if api != "responses" else "input"] = data.draw(st.lists(MESSAGE, min_size=1,
                                                                                           max_size=3))
            if api != "responses" and data.draw(st.booleans()):
                body["max_tokens"] = 2
            seen.append((api, body))

        case()  # draw the bodies here (hypothesis is synchronous), post them below on the episode's loop
        answers = []
        for api, body in seen:
            r = await ctx.http_client.post(f"{ctx.base_url}/{api}", json=body,
                                           headers={"authorization": f"Bearer {ctx.api_key}"})
            answers.append((api, body, r.status_code, r.text if r.status_code >= 400 else ""))
        return answers

    answers, _, _ = asyncio.run(_served(fuzz))
    assert len(answers) >= 150
    for api, body, status, text in answers:
        assert status < 500, (api, body, status, text)
        if status >= 400:
            error = json.loads(text)
            assert (error["type"] == "error" and error["error"]["message"]) if api == "messages" \
                else error["error"]["message"], (api, body, text)
    assert any(status == 200 for _, _, status, _ in answers) and any(status >= 400 for _, _, status, _ in answers)
