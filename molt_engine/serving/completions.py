"""The Chat Completions face of the loopback server (`POST /v1/chat/completions`, and the legacy `/v1/completions`):
a request's messages to the request core, its reply to a chat completion and, when streamed, to its chunks."""
import itertools
import json
import time
import uuid

from pydantic import Field

from .core import Body, template_message


class ChatBody(Body):
    messages: list[dict] = Field(min_length=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)


class CompletionBody(Body):
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=20)


async def chat_reply(server, ep, body: ChatBody) -> dict:
    messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    out = await server.chat_turn(ep, body, messages, body.tools, body.tool_choice,
                               body.max_completion_tokens or body.max_tokens,
                               body.top_logprobs if body.logprobs else None)
    content, calls = out["content"], out["calls"]
    message = {"role": "assistant", "content": content or (None if calls else ""), "refusal": None}
    if calls:
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                 for c in calls]
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": server.model, "usage": server.usage(ep, out["ids"]),
            "choices": [{"index": 0, "message": message, "finish_reason": out["finish"],
                         "logprobs": {"content": out["logprobs"]} if body.logprobs else None}]}


async def text_reply(server, ep, body: CompletionBody) -> dict:
    async with ep.lock:
        extends = isinstance(ep.said, str) and body.prompt.startswith(ep.said)
        delta = server.encode(body.prompt[len(ep.said):] if extends else body.prompt)
        out = await server.sample(ep, body, delta, extends, body.max_tokens, body.logprobs)
        ep.said, ep.tools = body.prompt + out["kept"], None  # the rest of the text, if any, comes back as prompt
    lp = None
    if body.logprobs is not None:
        logprobs = out["logprobs"]
        tokens = [t["token"] for t in logprobs]
        lp = {"tokens": tokens, "token_logprobs": [t["logprob"] for t in logprobs],
              "top_logprobs": [{x["token"]: x["logprob"] for x in t["top_logprobs"]} for t in logprobs],
              "text_offset": list(itertools.accumulate(map(len, tokens[:-1]), initial=len(body.prompt)))}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": server.model, "usage": server.usage(ep, out["ids"]),
            "choices": [{"index": 0, "text": out["text"], "finish_reason": out["finish"], "logprobs": lp}]}


def chat_events(out: dict, body: ChatBody):
    return _sse(_chat_chunks(out, body))


def text_events(out: dict, body: CompletionBody):
    return _sse([out])


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
