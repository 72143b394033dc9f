"""The loopback server agents call: a base URL and a secret key per episode, each API's route (its face: completions.py,
responses.py, messages.py) on the request core (core.py), served by uvicorn and reached in process by the episode's
own httpx client. Imported only when a run's env is an agent: the engine runs without the serving stack."""
import asyncio
import contextlib
import functools
import secrets
import socket

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from . import completions, messages, responses
from .agents import Agent, AgentContext
from .core import AgentEpisode, Body, OpenAIError, RequestCore
from ..episode import Episode

# Each API: its path, its request body, its reply (from the request core) and its stream of server-sent events.
ROUTES = [("chat/completions", completions.ChatBody, completions.chat_reply, completions.chat_events),
          ("completions", completions.CompletionBody, completions.text_reply, completions.text_events),
          ("responses", responses.ResponsesBody, responses.reply, responses.events),
          ("messages", messages.MessagesBody, messages.reply, messages.events)]


class AgentServer(RequestCore):
    """Serves /e/{episode}/v1/... on 127.0.0.1 for the run's agent episodes (`serve` is a task of the run's
    TaskGroup); `episode` runs one agent against it and returns the segments it trains."""

    def __init__(self, tokenizer, stops: list[int], context_limit: int, parse, model: str, run_seed: int):
        super().__init__(tokenizer, stops, context_limit, parse, model, run_seed)
        self.port: int | None = None
        self.listening = asyncio.Event()  # set once the port is bound: episodes wait for it
        self.app = app = FastAPI(title="molt agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(OpenAIError, _openai_error)
        app.add_exception_handler(RequestValidationError, _bad_request)
        app.get("/e/{name}/v1/models")(self.models)
        for path, body_type, reply, stream in ROUTES:
            app.post(f"/e/{{name}}/v1/{path}")(self.route(body_type, functools.partial(reply, self), stream))

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
        ep = self.episodes[name] = AgentEpisode(secrets.token_urlsafe(24), seed, group, index, greedy, sampler,
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

    async def models(self, name: str, request: Request):
        self.authorized(name, request)
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "molt"}]}

    def route(self, body_type: type[Body], reply, stream):
        """The endpoint of one API: its body validated as `body_type` (FastAPI reads the annotation)."""
        async def endpoint(name: str, body: body_type, request: Request):
            return await self.answer(name, body, request, reply, stream)
        return endpoint

    async def answer(self, name: str, body: Body, request: Request, reply, stream):
        """A request's reply, sampled once: the SDK's retry of a request (same body, x-stainless-retry-count > 0)
        gets the recorded reply, or waits for it while it is still being sampled. `stream(reply, body)` gives the
        reply as its API's server-sent events."""
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
        return StreamingResponse(stream(out, body), media_type="text/event-stream")


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
