"""The built-in calculator agent: the chat calculator as agent code, written with the official OpenAI SDK only."""
import json
import random

from molt_engine.envs import register
from molt_engine.serving.agents import Agent, AgentContext

from .builtin import ChatCalculator, _parse_int, calculator, calculator_question


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
