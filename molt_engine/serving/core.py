"""The request core of the loopback server agents call: an episode's books, and one turn of any of its APIs (context,
template delta, sampler, parsed reply, token-exact segment). Each API's face is a module of its own (completions.py,
responses.py, messages.py); server.py holds the routes."""
import asyncio
import json
import secrets
from dataclasses import dataclass, field

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field

from ..chat import Template, hermes
from ..episode import Episode


class OpenAIError(Exception):
    """Answered as OpenAI's error JSON: {"error": {"message", "type", "param", "code"}} (Anthropic's shape on
    /v1/messages)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # the SDKs send fields that change nothing here (user, metadata, ...)
    model: str
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, le=2)  # accepted; training samples at the run's temperature
    top_p: float | None = Field(None, gt=0, le=1)        # accepted; the run's distribution is what is trained
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request: each is a sample the episode trains on")
    stream: bool = False
    stream_options: dict | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []


@dataclass
class AgentEpisode:
    """One agent episode's books: its segments (token-first records) and what the newest one stands for."""
    key: str
    seed: int
    group: int
    index: int
    greedy: bool
    sampler: object
    max_tokens: int
    segments: list[Episode] = field(default_factory=list)
    said: list | str | None = None  # the newest segment as the agent sees it: its messages (chat) or its text
    tools: list | None = None       # the tool schemas the newest segment was rendered with
    ended: bool = True              # its last reply ended at an end-of-turn token
    replies: dict = field(default_factory=dict)  # request body -> its reply (a task), for the SDK's retries
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    requests: int = 0
    tool_calls: int = 0
    breaks: int = 0
    overrides: int = 0  # requests whose temperature or top_p the run's sampling overrode
    responses: dict = field(default_factory=dict)  # Responses API: response id -> its whole context (for
                                                   # previous_response_id)


class RequestCore:
    """What every request of an agent episode goes through, whatever its API: the episode's key, the rendering of its
    messages after the segment's context, the sample and its record."""

    def __init__(self, tokenizer, stops: list[int], context_limit: int, parse, model: str, run_seed: int):
        self.tokenizer, self.stops, self.context_limit = tokenizer, stops, context_limit
        self.parse, self.model, self.run_seed = parse, model, run_seed
        self.episodes: dict[str, AgentEpisode] = {}
        self.finished: dict[str, str] = {}  # recently ended episodes -> key: their late requests get 409

    def authorized(self, name: str, request) -> AgentEpisode:
        """The episode whose key the request carries. A wrong key, or another episode's, is a 401; a request to an
        episode that has ended is a 409."""
        key = (request.headers.get("authorization", "").removeprefix("Bearer ").strip()
               or request.headers.get("x-api-key", "").strip())  # Anthropic's SDK sends its key there
        ep = self.episodes.get(name)
        if ep is not None and secrets.compare_digest(ep.key, key):
            return ep
        if name in self.finished and secrets.compare_digest(self.finished[name], key):
            raise OpenAIError(409, f"episode {name} has ended; its endpoint takes no more requests", code="episode_ended")
        raise OpenAIError(401, "incorrect API key for this endpoint: each episode has its own (AgentContext.api_key)",
                          kind="authentication_error", code="invalid_api_key")

    async def chat_turn(self, ep: AgentEpisode, body: Body, messages: list[dict], tools: list | None, choice,
                        max_tokens: int | None, top: int | None = None) -> dict:
        """The request core of the three APIs: `messages` (template_message form) and `tools` (Chat Completions
        form) rendered as the template's delta after the segment's context when they extend it (a new segment
        otherwise), the reply sampled and parsed into content and tool calls. Returns `sample`'s dict plus
        `content`, `calls` ({"name", "arguments"}) and `finish` "tool_calls" when there are calls."""
        if not self.tokenizer.chat_template:
            raise OpenAIError(400, "this model's tokenizer has no chat template: use /v1/completions")
        choice = choice or ("auto" if tools else "none")
        named = isinstance(choice, dict) and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str)
        if choice not in ("auto", "none", "required") and not named:
            raise OpenAIError(400, f"tool_choice must be auto, none, required or a named function, not {choice!r}",
                              param="tool_choice")
        if choice != "none" and not tools:
            raise OpenAIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        if choice not in ("auto", "none") and self.parse is not hermes:
            raise OpenAIError(400, "a forced tool call (tool_choice required or named) needs the hermes tool parser",
                              param="tool_choice")
        template = Template(self.tokenizer, tools or [], self.stops)
        # A forced call: the opening of the parser's call format goes in as prompt, the policy samples the rest.
        forced = "" if choice in ("auto", "none") else _call_opening(choice)
        async with ep.lock:
            n = len(ep.said) if isinstance(ep.said, list) else 0
            extends = n > 0 and ep.tools == tools and messages[:n] == ep.said
            try:
                if extends:
                    delta, broke = template.after_reply(ep.said, messages[n:], ep.ended)
                else:
                    delta, broke = template.ids(messages, generation=True), False
            except (TemplateError, TypeError, ValueError, KeyError) as e:  # the messages are what it could not render
                raise OpenAIError(400, f"the model's chat template cannot render these messages: {e}",
                                  param="messages") from None
            delta += self.encode(forced)
            out = await self.sample(ep, body, delta, extends, max_tokens, top)
            ep.breaks += broke
            text = out["text"]
            content, calls = self.parse(forced + text) if choice != "none" else (text.strip(), [])
            if any("error" in c for c in calls):  # an unparsable call comes back as the text it is
                content, calls = (forced + text).strip(), []
            reply = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = [{"type": "function", "function": c} for c in calls]
                out["finish"] = "tool_calls"
            # The segment stands for this reply only when its tokens hold all of the reply's text (a stop string
            # may end the text inside a token): otherwise the next request starts a new segment.
            ep.said = messages + [reply] if out["kept"] == text else None
            ep.tools, ep.tool_calls = tools, ep.tool_calls + len(calls)
        return {**out, "content": content, "calls": calls, "context": messages + [reply]}

    async def sample(self, ep: AgentEpisode, body: Body, delta: list[int], extends: bool, max_tokens: int | None,
                     top: int | None) -> dict:
        """Append `delta` (non-action) to the newest segment, or start a new one with it, and sample the reply into
        it. The caller holds the episode's lock. Returns the reply's `ids` (those kept), their OpenAI `logprobs` with
        `top` alternatives each (none when `top` is None: not asked for), its `text`, the `finish` reason ("stop"
        or "length"), the stop string that ended it (`stop`, or None) and the text of the kept tokens (`kept`).

        Training episodes sample at the run's temperature whatever the request asks (the trained log-probs must be
        the behaviour policy's; overrides are counted); eval episodes decode greedily. A stop string ends the text
        before it, as OpenAI's does, and the segment keeps the sampled tokens that lie wholly inside that text: the
        stop is never in the record, so a prompt that goes on from the text (and, say, the stop) has it once."""
        before = len(ep.segments[-1].token_ids) if extends else 0
        if before + len(delta) >= self.context_limit:
            raise OpenAIError(400, f"the prompt is {before + len(delta)} tokens; this model's context is "
                              f"{self.context_limit}", code="context_length_exceeded", param="messages")
        if not extends:
            ep.segments.append(Episode(seed=ep.seed, group=ep.group))
        segment = ep.segments[-1]
        segment.extend(delta)
        budget = min(max_tokens or ep.max_tokens, self.context_limit - len(segment.token_ids))
        ep.requests += 1
        ep.overrides += not ep.greedy and (body.temperature not in (None, ep.sampler.temperature)
                                           or body.top_p not in (None, 1))
        asked = -1 if body.seed is None else body.seed  # hash(None) differs from one process to the next
        req = await ep.sampler.generate(
            segment.token_ids, budget, greedy=ep.greedy, top=top or 0,
            seed=hash((self.run_seed, ep.seed, ep.index, ep.requests, asked)) & (2**62 - 1))
        ids, ended = req.ids, req.ids[-1] in self.stops
        text = kept = self.tokenizer.decode(ids[:-1] if ended else ids)
        finish = "stop" if ended else "length"
        cut, stop = min(((i, s) for s in body.stops() if s and (i := text.find(s)) >= 0), default=(-1, None))
        if cut >= 0:
            text, finish = text[:cut], "stop"
            n = next(k for k in range(len(ids), -1, -1) if text.startswith(self.tokenizer.decode(ids[:k])))
            ids, kept = ids[:n], self.tokenizer.decode(ids[:n])
        segment.sampled(req, len(ids))
        ep.ended = bool(ids) and ids[-1] in self.stops
        token = self.tokenizer.decode
        logprobs = [{"token": token([t]), "logprob": lp, "bytes": list(token([t]).encode()),
                     "top_logprobs": [{"token": token([i]), "logprob": v, "bytes": list(token([i]).encode())}
                                      for i, v in (req.top_logprobs[j] if top else [])]}
                    for j, (t, lp) in enumerate(zip(ids, req.logprobs))] if top is not None else []
        return {"ids": ids, "logprobs": logprobs, "text": text, "finish": finish, "stop": stop, "kept": kept}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    @staticmethod
    def usage(ep: AgentEpisode, ids: list[int]) -> dict:
        total = len(ep.segments[-1].token_ids)
        return {"prompt_tokens": total - len(ids), "completion_tokens": len(ids), "total_tokens": total}


def template_message(m: dict, i: int) -> dict:
    """A request's message as the chat template takes it, and as it is compared with what a segment stands for:
    text content, tool-call arguments as objects."""
    if not isinstance(m.get("role"), str):
        raise OpenAIError(400, f"messages[{i}] has no role", param=f"messages[{i}].role")
    content = m.get("content") or ""
    if isinstance(content, list):  # content parts: the text ones
        content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    if not isinstance(content, str) or not isinstance(m.get("name") or "", str):
        raise OpenAIError(400, f"messages[{i}]: content must be a string or a list of parts, and name a string",
                          param=f"messages[{i}]")
    out = {"role": m["role"], "content": content}
    if m.get("name"):
        out["name"] = m["name"]
    calls, given = [], m.get("tool_calls") or []
    if not isinstance(given, list) or not all(isinstance(c, dict) and isinstance(c.get("function") or {}, dict)
                                              for c in given):
        raise OpenAIError(400, f"messages[{i}].tool_calls must be a list of {{'function': {{...}}}} objects",
                          param=f"messages[{i}].tool_calls")
    for j, call in enumerate(given):
        function = call.get("function") or {}
        arguments = function.get("arguments") or {}
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise OpenAIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                              param=f"messages[{i}].tool_calls") from None
        calls.append({"type": "function", "function": {"name": function.get("name"), "arguments": arguments}})
    if calls:
        out["tool_calls"] = calls
    return out


def _call_opening(choice) -> str:
    """The start of a Hermes/Qwen tool call, up to the arguments of the named function when one is forced."""
    if choice == "required":
        return '<tool_call>\n{"name": "'
    return '<tool_call>\n{"name": "' + choice["function"]["name"] + '", "arguments": '
