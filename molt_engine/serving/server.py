"""The loopback server agents call: a base URL and a secret key per episode, requests decoded by the run's shared
sampler, and token-exact segments recorded from what the policy sampled. One request core (`chat_turn`: context,
template delta, sampler, parsed reply) with three faces: Chat Completions (and legacy Completions) here, the Responses
API in responses.py, Anthropic's Messages API in messages.py."""
import asyncio
import contextlib
import itertools
import json
import secrets
import socket
import time
import uuid
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .agents import Agent, AgentContext
from ..chat import Template, hermes
from ..episode import Episode


class OpenAIError(Exception):
    """Answered as OpenAI's error JSON: {"error": {"message", "type", "param", "code"}} (Anthropic's shape on
    /v1/messages)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Body(BaseModel):
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


class ChatBody(_Body):
    messages: list[dict] = Field(min_length=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)


class CompletionBody(_Body):
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=20)


@dataclass
class _Episode:
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


class AgentServer:
    """Serves /e/{episode}/v1/... on 127.0.0.1 for the run's agent episodes (`serve` is a task of the run's
    TaskGroup); `episode` runs one agent against it and returns the segments it trains."""

    def __init__(self, tokenizer, stops: list[int], context_limit: int, parse, model: str, run_seed: int):
        self.tokenizer, self.stops, self.context_limit = tokenizer, stops, context_limit
        self.parse, self.model, self.run_seed = parse, model, run_seed
        self.episodes: dict[str, _Episode] = {}
        self.finished: dict[str, str] = {}  # recently ended episodes -> key: their late requests get 409
        self.port: int | None = None
        self.listening = asyncio.Event()  # set once the port is bound: episodes wait for it
        self.app = app = FastAPI(title="molt agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(OpenAIError, _openai_error)
        app.add_exception_handler(RequestValidationError, _bad_request)
        app.post("/e/{name}/v1/chat/completions")(self.chat_completions)
        app.post("/e/{name}/v1/completions")(self.completions)
        app.get("/e/{name}/v1/models")(self.models)
        from . import messages, responses  # here: the two faces import this module's core
        app.post("/e/{name}/v1/responses")(responses.endpoint(self))
        app.post("/e/{name}/v1/messages")(messages.endpoint(self))

    async def serve(self):
        """Listen on a free port of 127.0.0.1 only, until the run's TaskGroup ends. The socket listens from the
        start, so agents may connect before uvicorn accepts."""
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.listening.set()
        server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off"))
        server.capture_signals = contextlib.nullcontext  # the run's own SIGTERM/SIGINT handlers stay in charge
        try:
            await server.serve(sockets=[sock])
        finally:
            sock.close()

    async def episode(self, agent: Agent, sampler, seed: int, group: int, index: int, greedy: bool) -> list[Episode]:
        """Run `agent` once with an endpoint of its own; its reward goes to every segment. Each segment is a row of
        its own: the first carries the episode's counts, the later ones say which segment they are."""
        await self.listening.wait()
        name = secrets.token_hex(8)
        ep = self.episodes[name] = _Episode(secrets.token_urlsafe(24), seed, group, index, greedy, sampler,
                                            agent.max_tokens)
        # The episode's own client reaches this app in process: no socket, no HTTP parsing on either side (~0.6 ms a
        # request of ~2.5). No proxy from the environment: the endpoint is this process.
        http = httpx.AsyncClient(transport=httpx.ASGITransport(self.app, raise_app_exceptions=False), trust_env=False)
        ctx = AgentContext(seed, f"http://127.0.0.1:{self.port}/e/{name}/v1", ep.key, self.model, http)
        try:
            reward = float(await asyncio.wait_for(agent.run(ctx), agent.timeout))
        except TimeoutError:
            raise TimeoutError(f"agent {agent.name!r} ran longer than its timeout ({agent.timeout:g} s)") from None
        finally:
            for task in ep.replies.values():  # requests still being answered: nobody is waiting for them
                task.cancel()
            self.finished[name] = self.episodes.pop(name).key
            if len(self.finished) > 10_000:
                del self.finished[next(iter(self.finished))]
            await http.aclose()
        rows = [s for s in ep.segments if any(s.is_action)]
        for k, row in enumerate(rows):
            row.reward = reward
            row.info = {"segment": k, "turns": 0, "tool_calls": 0, "truncated": False, "entropy": sum(row.entropies),
                        "success": reward >= agent.success_reward, "metrics": {}}
        if rows:
            rows[0].info.update(turns=ep.requests, tool_calls=ep.tool_calls, template_prefix_breaks=ep.breaks,
                                metrics={**ctx.metrics, "agent_requests_per_episode": ep.requests,
                                         "segments_per_episode": len(rows), "sampling_overrides": ep.overrides})
        return rows

    # ---- requests -------------------------------------------------------------------------------------------------

    def authorized(self, name: str, request: Request) -> _Episode:
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

    async def models(self, name: str, request: Request):
        self.authorized(name, request)
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "molt"}]}

    async def chat_completions(self, name: str, body: ChatBody, request: Request):
        return await self.answer(name, body, request, self.chat_reply, lambda out: _sse(_chat_chunks(out, body)))

    async def completions(self, name: str, body: CompletionBody, request: Request):
        return await self.answer(name, body, request, self.text_reply, lambda out: _sse([out]))

    async def answer(self, name: str, body: _Body, request: Request, reply, stream):
        """A request's reply, sampled once: the SDK's retry of a request (same body, x-stainless-retry-count > 0)
        gets the recorded reply, or waits for it while it is still being sampled. `stream(reply)` gives the reply as
        its API's server-sent events."""
        ep = self.authorized(name, request)
        if body.model != self.model:
            raise OpenAIError(404, f"the model {body.model!r} does not exist; this endpoint serves {self.model!r}",
                              code="model_not_found", param="model")
        fingerprint = body.model_dump_json()
        task = ep.replies.get(fingerprint) if int(request.headers.get("x-stainless-retry-count") or 0) else None
        if task is None:
            task = ep.replies[fingerprint] = asyncio.create_task(reply(ep, body))
        try:
            out = await asyncio.shield(task)  # a client that gives up does not cancel a sample the segment holds
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the caller itself: an in-process client's episode is ending
                raise
            # The reply was cut off by the end of its episode or run: an answer, not an error in the server's log.
            raise OpenAIError(409, f"episode {name} (or its run) ended while this request was answered",
                              code="episode_ended") from None
        if not body.stream:
            return JSONResponse(out)  # as it is: FastAPI's encoder would walk the plain dict for nothing
        return StreamingResponse(stream(out), media_type="text/event-stream")

    async def chat_turn(self, ep: _Episode, body: _Body, messages: list[dict], tools: list | None, choice,
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

    async def chat_reply(self, ep: _Episode, body: ChatBody) -> dict:
        messages = [template_message(m, i) for i, m in enumerate(body.messages)]
        out = await self.chat_turn(ep, body, messages, body.tools, body.tool_choice,
                                   body.max_completion_tokens or body.max_tokens,
                                   body.top_logprobs if body.logprobs else None)
        content, calls = out["content"], out["calls"]
        message = {"role": "assistant", "content": content or (None if calls else ""), "refusal": None}
        if calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                      "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                     for c in calls]
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model, "usage": self.usage(ep, out["ids"]),
                "choices": [{"index": 0, "message": message, "finish_reason": out["finish"],
                             "logprobs": {"content": out["logprobs"]} if body.logprobs else None}]}

    async def text_reply(self, ep: _Episode, body: CompletionBody) -> dict:
        async with ep.lock:
            extends = isinstance(ep.said, str) and body.prompt.startswith(ep.said)
            delta = self.encode(body.prompt[len(ep.said):] if extends else body.prompt)
            out = await self.sample(ep, body, delta, extends, body.max_tokens, body.logprobs)
            ep.said, ep.tools = body.prompt + out["kept"], None  # the rest of the text, if any, comes back as prompt
        lp = None
        if body.logprobs is not None:
            logprobs = out["logprobs"]
            tokens = [t["token"] for t in logprobs]
            lp = {"tokens": tokens, "token_logprobs": [t["logprob"] for t in logprobs],
                  "top_logprobs": [{x["token"]: x["logprob"] for x in t["top_logprobs"]} for t in logprobs],
                  "text_offset": list(itertools.accumulate(map(len, tokens[:-1]), initial=len(body.prompt)))}
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model, "usage": self.usage(ep, out["ids"]),
                "choices": [{"index": 0, "text": out["text"], "finish_reason": out["finish"], "logprobs": lp}]}

    async def sample(self, ep: _Episode, body: _Body, delta: list[int], extends: bool, max_tokens: int | None,
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
    def usage(ep: _Episode, ids: list[int]) -> dict:
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


def _chat_chunks(out: dict, body: ChatBody) -> list[dict]:
    """A chat completion as the chunks of a stream: the role and content, each tool call, the finish reason, and
    the usage when `stream_options.include_usage` asks."""
    choice, base = out["choices"][0], {k: out[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    message = choice["message"]
    chunks = [{"role": "assistant", "content": message["content"] or ""}]
    chunks += [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(message.get("tool_calls", []))]
    out_chunks = [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                        "logprobs": choice["logprobs"] if i == 0 else None}]}
                  for i, delta in enumerate(chunks)]
    out_chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]})
    if (body.stream_options or {}).get("include_usage"):
        out_chunks.append({**base, "choices": [], "usage": out["usage"]})
    return out_chunks


async def _sse(chunks: list[dict]):
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


async def _openai_error(request, e: OpenAIError):  # async: a sync handler would wait on a thread at the run's end
    if request.url.path.endswith("/v1/messages"):  # Anthropic's shape: {"type": "error", "error": {type, message}}
        kind = {404: "not_found_error", 401: "authentication_error"}.get(e.status, "invalid_request_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": e.body["error"]["message"]}},
                            status_code=e.status)
    return JSONResponse(e.body, status_code=e.status)


async def _bad_request(request, e: RequestValidationError):
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"][1:]) or None
    message = "; ".join(f"{'.'.join(str(p) for p in err['loc'][1:])}: {err['msg']}" for err in e.errors())
    return await _openai_error(request, OpenAIError(400, message, param=param))
