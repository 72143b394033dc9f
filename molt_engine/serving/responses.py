"""The Responses API face of the loopback server (`POST /v1/responses`): input items to chat messages, the request
core's reply to output items and, when streamed, to the Responses event stream."""
import itertools
import json
import time
import uuid

from pydantic import Field

from .core import Body, OpenAIError, template_message


class ResponsesBody(Body):
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    max_output_tokens: int | None = Field(None, gt=0)
    previous_response_id: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


async def reply(server, ep, body: ResponsesBody) -> dict:
    earlier = []
    if body.previous_response_id is not None:  # within the episode only: its context, then this input
        if body.previous_response_id not in ep.responses:
            raise OpenAIError(400, f"previous_response_id: no response {body.previous_response_id!r} in this episode",
                              param="previous_response_id")
        earlier = ep.responses[body.previous_response_id]
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages = system + earlier + [template_message(m, i) for i, m in enumerate(chat_messages(body.input))]
    tools = [chat_tool(t, i) for i, t in enumerate(body.tools)] if body.tools else None
    choice = body.tool_choice
    if isinstance(choice, dict):  # {"type": "function", "name": ...}: Chat Completions' named function
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    out = await server.chat_turn(ep, body, messages, tools, choice, body.max_output_tokens, body.top_logprobs)
    rid = f"resp_{uuid.uuid4().hex}"
    ep.responses[rid] = out["context"][len(system):]  # instructions are not carried over (as OpenAI's)
    output = []
    if out["content"] or not out["calls"]:
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": out["content"], "annotations": [],
                                    "logprobs": out["logprobs"]}]})
    output += [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": f"call_{uuid.uuid4().hex[:24]}",
                "name": c["name"], "arguments": json.dumps(c["arguments"]), "status": "completed"}
               for c in out["calls"]]
    usage = server.usage(ep, out["ids"])
    cut = out["finish"] == "length"
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": server.model,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "instructions": body.instructions, "output": output, "parallel_tool_calls": True,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "temperature": body.temperature,
            "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "metadata": {},
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def chat_messages(items: str | list[dict]) -> list[dict]:
    """Input items as Chat Completions messages: a function call joins the assistant message before it (or makes
    one), a function call's output is a tool message; reasoning items carry nothing the template renders."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            messages.append({"role": role, "content": item.get("content")})
        elif kind == "function_call":
            call = {"type": "function", "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind != "reasoning":
            raise OpenAIError(400, f"input[{i}] is a {kind!r} item; this endpoint takes messages, function_call and "
                              "function_call_output items", param=f"input[{i}].type")
    return messages


def chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function" or not tool.get("name"):
        raise OpenAIError(400, f"tools[{i}] must be a function tool with a name (the policy calls only functions)",
                          param=f"tools[{i}]")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


async def events(response: dict, body: ResponsesBody):
    """The response as the Responses event stream: created, each output item with its text or arguments, completed."""
    sequence = itertools.count()

    def event(kind: str, **data) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(sequence), **data})}\n\n"

    yield event("response.created", response={**response, "status": "in_progress", "output": []})
    for i, item in enumerate(response["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            yield event("response.output_item.added", output_index=i, item={**item, "status": "in_progress",
                                                                             "content": []})
            yield event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                        part={**part, "text": ""})
            yield event("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0,
                        delta=part["text"], logprobs=[])
            yield event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                        text=part["text"], logprobs=[])
            yield event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
        else:
            yield event("response.output_item.added", output_index=i, item={**item, "status": "in_progress",
                                                                             "arguments": ""})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                        arguments=item["arguments"])
        yield event("response.output_item.done", output_index=i, item=item)
    yield event("response.completed", response=response)
