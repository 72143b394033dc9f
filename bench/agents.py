"""The agent path vs the env path on the same task: the calculator agent (the OpenAI SDK against the run's loopback
server) vs the chat calculator env, on the same warm-started tiny-chat policy, 64 episodes at once. The agent runs
on Chat Completions with `ctx.http_client` (the endpoint in process, as the built-in agent uses it) and with a client
of its own over 127.0.0.1 (as a framework that makes its own client), on the Responses API (in process) and on
Anthropic's Messages API (the anthropic SDK, over 127.0.0.1: it brings its own HTTP client).

    python bench/agents.py --steps 12 --rounds 5

A warm start as bench/chat_learning.py's calculator recipe (seed 0, --warm-steps at lr 1e-3), but on demonstrations
that always call the tool (mental_share 0; the calculator agent's are the same tokens), is saved once; every run loads
it (warm_start 0). Both paths then sample from the same weights, and the calls are well formed: an episode takes the
same turns on both paths (a malformed call is an error result and another turn for the env, but the end of the
episode for the agent, which gets it back as content). groups_per_step 8 x group_size 8: 64 episodes in flight,
i.e. 64 agents at once on the agent path. Runs take turns, env, agent, agent over the socket (--rounds rounds), so
load changes hit all three. Prints per run the median samples/s over the steps after
the first, the mean decode batch (requests per decode step: sampler_occupancy x 64), requests per episode and agent
errors; then for each agent path the median of the per-round ratios agent/env samples/s and the overhead (1 - ratio).
"""
import argparse
import dataclasses
import json
import random
import ssl
import statistics
import tempfile
from pathlib import Path

import anthropic
import httpx
import httpx2
import openai
import torch
from chat_learning import warm_started
from chat_overhead import Rates

from molt_engine import register, train
from molt_engine.config import AlgoConfig
from molt_envs.agents import CALCULATOR, CalculatorAgent
from molt_envs.builtin import _parse_int, calculator, calculator_question

IN_FLIGHT = 64
TLS = ssl.create_default_context()  # one for all clients: the SDK's own client makes one each (~25 ms)


@register
class SocketCalculatorAgent(CalculatorAgent):
    """The calculator agent with an HTTP client of its own, over 127.0.0.1 to the run's uvicorn server."""
    name = "calculator_agent_socket"

    async def run(self, ctx):
        async with httpx.AsyncClient(verify=TLS, trust_env=False) as http:
            return await super().run(dataclasses.replace(ctx, http_client=http))


@register
class ResponsesCalculatorAgent(CalculatorAgent):
    """The calculator agent on the Responses API: its input items grow by the output items and the call outputs."""
    name = "calculator_agent_responses"

    async def run(self, ctx):
        a, op, b, value = calculator_question(random.Random(ctx.seed))
        items = [{"role": "user", "content": f"What is {a}{op}{b}?"}]
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        tool = {"type": "function", **CALCULATOR["function"]}
        for _ in range(self.max_turns):
            reply = await client.responses.create(model=ctx.model, input=items, tools=[tool],
                                                  max_output_tokens=self.max_tokens)
            items += [o.model_dump(exclude_none=True) for o in reply.output]
            calls = [o for o in reply.output if o.type == "function_call"]
            if not calls:
                return float(_parse_int(reply.output_text) == value)
            items += [{"type": "function_call_output", "call_id": c.call_id, "output": tool_result(c.arguments)}
                      for c in calls]
        return 0.0


@register
class MessagesCalculatorAgent(CalculatorAgent):
    """The calculator agent on Anthropic's Messages API, through the anthropic SDK over 127.0.0.1 (its client is
    httpx2, which the episode's in-process httpx client is not)."""
    name = "calculator_agent_messages"

    async def run(self, ctx):
        a, op, b, value = calculator_question(random.Random(ctx.seed))
        messages = [{"role": "user", "content": f"What is {a}{op}{b}?"}]
        tool = CALCULATOR["function"]
        tools = [{"name": tool["name"], "description": tool["description"], "input_schema": tool["parameters"]}]
        # The SDK's own HTTP client (httpx2) builds an SSL context per client (~60 ms): one shared context instead
        http = httpx2.AsyncClient(verify=TLS, trust_env=False)
        async with anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key,
                                            http_client=http) as client:
            for _ in range(self.max_turns):
                reply = await client.messages.create(model=ctx.model, max_tokens=self.max_tokens, messages=messages,
                                                     tools=tools)
                messages.append({"role": "assistant",
                                 "content": [block.model_dump(exclude_none=True) for block in reply.content]})
                calls = [block for block in reply.content if block.type == "tool_use"]
                if not calls:
                    return float(_parse_int("".join(x.text for x in reply.content if x.type == "text")) == value)
                messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": c.id, "content": tool_result(json.dumps(c.input))}
                    for c in calls]})
        return 0.0


def tool_result(arguments: str) -> str:
    try:
        return calculator(**json.loads(arguments))
    except Exception as e:  # the policy's mistake: it reads the error and may try again
        return f"error: {e}"


def run(env: str, directory: str, steps: int) -> dict:
    sink = Rates()
    summary = train({"env": env, "model": {"preset": None, "path": directory}, "seed": 0, "warm_start": {"steps": 0},
                     "algo": {"lr": AlgoConfig().lr},  # the presets' lr, not model.path's (1e-6): a tiny warm-started policy
                     "loop": {"steps": steps, "groups_per_step": 8, "group_size": 8, "eval_every": 0},
                     "checkpoint": {"every": 0}}, sink)
    rows = sink.rows[1:]
    out = {"samples_per_s": statistics.median(r["samples_per_s"] for r in rows),
           "decode_batch": statistics.mean(r["sampler_occupancy"] for r in rows) * IN_FLIGHT,
           "tool_call_rate": statistics.mean(r["tool_call_rate"] for r in rows),
           "reward": statistics.mean(r["reward_mean"] for r in rows), "status": summary["status"]}
    if "agent_errors" in rows[0]:
        out.update(requests_per_episode=statistics.mean(r["agent_requests_per_episode"] for r in rows),
                   segments_per_episode=statistics.mean(r["segments_per_episode"] for r in rows),
                   agent_errors=sum(r["agent_errors"] for r in sink.rows))
    else:
        out["env_errors"] = sum(r["env_errors"] for r in sink.rows)
    print(f"  {env:17s} " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()),
          flush=True)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warm-steps", type=int, default=1000, help="as bench/chat_learning.py's recipe")
    parser.add_argument("--warm-dir", type=Path, help="keep the warm-started policy here (chat_learning.py's too)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        directory = str(warm_started({"env": "chat_calculator", "model": {"preset": "tiny-chat"}, "seed": 0,
                                      "env_args": {"mental_share": 0.0}, "warm_start": {"steps": args.warm_steps, "lr": 1e-3}},
                                     args.warm_dir or Path(tmp)))
        ratios = {"calculator_agent": [], "calculator_agent_socket": [], "calculator_agent_responses": [],
                  "calculator_agent_messages": []}
        for k in range(args.rounds):
            print(f"round {k}", flush=True)
            env = run("chat_calculator", directory, args.steps)
            for agent, rows in ratios.items():
                rows.append(run(agent, directory, args.steps)["samples_per_s"] / env["samples_per_s"])
        for agent, rows in ratios.items():
            ratio = statistics.median(rows)
            print(f"{agent}/env samples/s per round {[round(r, 3) for r in rows]}; median {ratio:.3f}, "
                  f"overhead {1 - ratio:.1%}")


if __name__ == "__main__":
    main()
