"""Agents in any framework: the Agent contract (user code that drives its own loop through an OpenAI client), its
context, and the built-in calculator agent, written with the official OpenAI SDK only."""
import json
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # httpx and openai load only with the agent server and the agents that use them
    import httpx

from ..envs import Env, register

from ..builtin_envs import ChatCalculator, _parse_int, calculator, calculator_question


@dataclass
class AgentContext:
    """What an agent's episode gets: its seed, and an OpenAI endpoint of its own (base URL and secret key) served by
    the engine's policy under the name `model`. `http_client` is the episode's own httpx client, closed when it ends:
    it reaches the same endpoint in process (no socket, no HTTP parsing: the agent path runs ~1.2x faster). Pass it to
    `openai.AsyncOpenAI(http_client=...)` (LangChain: `http_async_client`); any other client
    (Anthropic's SDK: its own httpx2) works over `base_url`. The endpoint speaks Chat Completions, Completions, Responses and
    Anthropic's Messages.
    `metrics` is the agent's to fill (name -> number): the run reports their means, as it does an env's
    `Result.info["metrics"]`."""
    seed: int
    base_url: str
    api_key: str
    model: str
    http_client: "httpx.AsyncClient | None" = None
    metrics: dict = field(default_factory=dict)

    @property
    def anthropic_base_url(self) -> str:
        """The same endpoint for Anthropic's SDK, which adds /v1 itself: `AsyncAnthropic(base_url=...)`."""
        return self.base_url.removesuffix("/v1")


class Agent(Env):
    """Subclass, set `name`, implement `run` (and `demonstration` for a warm start); register like an env.

    `run` drives the episode with any OpenAI-compatible client pointed at `ctx.base_url` and returns the reward.
    The engine records exactly the tokens its policy sampled for each request. Sampling follows the run
    (`loop.temperature`, whatever a request's `temperature` or `top_p` say; eval episodes decode greedily) so that
    the trained log-probs are those that were sampled. An agent that raises or runs longer than `timeout` seconds is
    an env error: the episode is dropped and counted."""

    chat = True          # requests are rendered with the policy's chat template
    tools: tuple = ()    # OpenAI tool schemas: those its demonstrations are rendered with (what run() sends)
    max_tokens = 256     # per request, when the request does not say
    timeout = 300.0      # seconds per episode

    async def run(self, ctx: AgentContext) -> float:
        raise NotImplementedError

    def demonstration(self, seed: int) -> list[dict]:
        """A good episode as OpenAI-format messages (prompt, assistant replies with content or tool_calls, tool
        results), rendered with `tools` for the supervised warm start."""
        raise NotImplementedError


CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression of integers.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": "integers joined by +, - or *, e.g. \"12*7\""}}}}}


@register
class CalculatorAgent(Agent):
    """The chat calculator as agent code: ask, run the calculator the policy calls, score the answer. Its env args
    and demonstrations are the chat calculator's (`mental_share` of them answer at once)."""

    name = "calculator_agent"
    tools = (CALCULATOR,)
    max_tokens = 32
    max_turns = 3

    def __init__(self, **env_args):
        super().__init__()
        self.env = ChatCalculator(**env_args)  # the same question, answer and demonstrations

    async def run(self, ctx: AgentContext) -> float:
        a, op, b, value = calculator_question(random.Random(ctx.seed))
        messages = [{"role": "user", "content": f"What is {a}{op}{b}?"}]
        ctx.metrics["tool_error_rate"] = 0
        import openai  # here: the engine imports without the OpenAI SDK, which only agent episodes use
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        for _ in range(self.max_turns):
            reply = (await client.chat.completions.create(model=ctx.model, messages=messages, tools=list(self.tools),
                                                          max_tokens=self.max_tokens)).choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                return float(_parse_int(reply.content or "") == value)
            for call in reply.tool_calls:
                try:
                    if call.function.name != "calculator":
                        raise ValueError(f"unknown tool {call.function.name!r}")
                    result = calculator(**json.loads(call.function.arguments))
                except Exception as e:  # the policy's mistake: it reads the error and may try again
                    result = f"error: {e}"
                    ctx.metrics["tool_error_rate"] += 1
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 0.0

    def demonstration(self, seed: int) -> list[dict]:
        """The chat calculator's demonstration as a whole conversation: the question, then its replies, a call
        followed by the tool's result."""
        a, op, b, value = calculator_question(random.Random(seed))
        messages = [{"role": "user", "content": f"What is {a}{op}{b}?"}]
        for reply in self.env.demonstration(seed):
            messages.append(reply)
            if reply.get("tool_calls"):
                messages.append({"role": "tool", "content": str(value)})
        return messages
