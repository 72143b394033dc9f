"""Agents in any framework: the Agent contract (user code that drives its own loop through an OpenAI client) and its
context (the built-in calculator agent is in molt_envs/agents.py)."""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # httpx and openai load only with the agent server and the agents that use them
    import httpx

from ..envs import Env


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
