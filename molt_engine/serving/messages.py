"""Anthropic's Messages API face of the loopback server (`POST /v1/messages`): content blocks to chat messages, the
request core's reply to a message of text and tool_use blocks and, when streamed, to Anthropic's events."""
import json
import uuid

from pydantic import Field

from .core import Body, OpenAIError, template_message


class MessagesBody(Body):
    max_tokens: int = Field(gt=0)
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    stop_sequences: list[str] | None = None
    top_k: int | None = Field(None, gt=0)  # accepted; the run's distribution is what is trained

    def stops(self) -> list[str]:
        return self.stop_sequences or []


async def reply(server, ep, body: MessagesBody) -> dict:
    system = body.system if isinstance(body.system, str) else _text(body.system or [])
    chat = ([{"role": "system", "content": system}] if system else []) + chat_messages(body.messages)
    tools = None
    if body.tools:
        for i, t in enumerate(body.tools):
            if not t.get("name") or "input_schema" not in t:
                raise OpenAIError(400, f"tools.{i}: a tool needs a name and an input_schema (only client tools are "
                                  "served)", param=f"tools.{i}")
        tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                   "parameters": t["input_schema"]}} for t in body.tools]
    kind = (body.tool_choice or {}).get("type", "auto")
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if kind == "tool":
        choice = {"type": "function", "function": {"name": body.tool_choice.get("name")}}
    if choice is None:
        raise OpenAIError(400, f"tool_choice.type must be auto, any, tool or none, not {kind!r}", param="tool_choice")
    out = await server.chat_turn(ep, body, [template_message(m, i) for i, m in enumerate(chat)], tools,
                                 choice if tools or body.tool_choice else None, body.max_tokens)
    content = [{"type": "text", "text": out["content"]}] if out["content"] or not out["calls"] else []
    content += [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": c["name"],
                 "input": c["arguments"]} for c in out["calls"]]
    reason = {"tool_calls": "tool_use", "length": "max_tokens"}.get(out["finish"],
                                                                    "stop_sequence" if out["stop"] else "end_turn")
    usage = server.usage(ep, out["ids"])
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": server.model,
            "content": content, "stop_reason": reason, "stop_sequence": out["stop"],
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


def chat_messages(messages: list[dict]) -> list[dict]:
    """Messages of content blocks as Chat Completions messages: tool_use blocks are the assistant's tool calls, each
    tool_result block a tool message (before the user's text in the same message)."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str) or m.get("role") not in ("user", "assistant"):
            out.append({"role": m.get("role"), "content": content})
            continue
        if not isinstance(content, list):
            raise OpenAIError(400, f"messages.{i}.content must be a string or a list of blocks",
                              param=f"messages.{i}.content")
        blocks = [b for b in content if isinstance(b, dict)]
        for b in blocks:
            if b.get("type") == "tool_result":
                result = b.get("content")
                text = result if isinstance(result, str) else _text(result if isinstance(result, list) else [])
                out.append({"role": "tool", "content": text})
        calls = [{"type": "function", "function": {"name": b.get("name"), "arguments": b.get("input") or {}}}
                 for b in blocks if b.get("type") == "tool_use"]
        text = _text(blocks)
        if m["role"] == "assistant" or text:
            out.append({"role": m["role"], "content": text, **({"tool_calls": calls} if calls else {})})
    return out


def _text(blocks: list) -> str:
    return "".join(b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text"
                   and isinstance(b.get("text"), str))


async def events(message: dict, body: MessagesBody):
    """The message as Anthropic's server-sent events: message_start, each content block (start, delta, stop),
    message_delta with the stop reason and usage, message_stop."""
    def event(kind: str, **data) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    yield event("message_start", message={**message, "content": [], "stop_reason": None, "stop_sequence": None,
                                          "usage": {**message["usage"], "output_tokens": 0}})
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield event("content_block_start", index=i, content_block={"type": "text", "text": ""})
            yield event("content_block_delta", index=i, delta={"type": "text_delta", "text": block["text"]})
        else:
            yield event("content_block_start", index=i, content_block={**block, "input": {}})
            yield event("content_block_delta", index=i,
                        delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        yield event("content_block_stop", index=i)
    yield event("message_delta", delta={"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
                usage={"output_tokens": message["usage"]["output_tokens"]})
    yield event("message_stop")
