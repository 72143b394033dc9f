"""Chat-native episodes: the policy's chat template as token deltas, its tool calls parsed from what it sampled, and
the calls run as tools whose results (or errors) go back as `tool` messages."""
import asyncio
import inspect
import json
import re

from transformers.utils import get_json_schema


def stop_ids(tokenizer, generation_config=None) -> list[int]:
    """The ids a policy turn ends at: eos, the generation config's eos ids, and the chat template's end-of-turn token
    (<|im_end|>, <|eot_id|>): the first special token the template puts after a reply's content."""
    eos = getattr(generation_config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    if tokenizer.chat_template:
        turn = [{"role": "user", "content": "1"}]
        prompt = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        reply = tokenizer.apply_chat_template(turn + [{"role": "assistant", "content": "2"}], tokenize=False)
        if reply.startswith(prompt):
            rest = tokenizer(reply[len(prompt):], add_special_tokens=False)["input_ids"]
            ids.add(next((t for t in rest if t in tokenizer.all_special_ids), None))
    return sorted(i for i in ids if i is not None)


class Template:
    """Messages -> token ids with the policy's chat template and the tools' schemas (of Python functions, or OpenAI
    tool schemas as agents send them)."""

    def __init__(self, tokenizer, tools, stops: list[int]):
        if not tokenizer.chat_template:
            raise ValueError("a chat env needs a tokenizer with a chat template (a preset: tiny-chat)")
        self.tokenizer, self.stops = tokenizer, set(stops)
        self.tools = [t if isinstance(t, dict) else get_json_schema(t) for t in tools] or None

    def ids(self, messages: list[dict], generation: bool = False) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def suffix(self, history: list[dict], new: list[dict], generation: bool, before: list[int] | None = None
               ) -> tuple[list[int], bool]:
        """render(history + new) minus render(history), checked as a token prefix (the history rendered with a
        generation prompt when `generation` is false: `new` is then the reply to it). When the template renders the
        history differently once `new` follows (Qwen3 drops earlier <think> blocks), `new` is rendered after the first
        message alone, which keeps the template's preamble out of it; the second value says so (a prefix break).
        `before`: the history's render, when the caller has it already."""
        before = self.ids(history, not generation) if before is None else before
        after = self.ids(history + new, generation)
        if after[:len(before)] == before:
            return after[len(before):], False
        before, after = self.ids(history[:1], not generation), self.ids(history[:1] + new, generation)
        if after[:len(before)] == before:
            return after[len(before):], True
        return self.ids(new, generation), True

    def reply(self, history: list[dict], message: dict) -> list[int]:
        """A demonstration's assistant message as the template renders it, through its end-of-turn token."""
        ids, _ = self.suffix(history, [message], generation=False)
        end = next((i for i, t in enumerate(ids) if t in self.stops), len(ids) - 1)
        return ids[:end + 1]

    def after_reply(self, history: list[dict], new: list[dict], ended: bool) -> tuple[list[int], bool]:
        """The non-action tokens after a sampled reply (the last message of `history`): the rest of the template's
        closing of the turn (the newline after <|im_end|>; the end-of-turn itself when the reply was cut off), then
        the new messages and the next generation prompt; and whether that was a prefix break."""
        rendered = self.ids(history)
        ends = [i for i, t in enumerate(rendered) if t in self.stops]
        closing = rendered[ends[-1] + ended:] if ends else []
        delta, broke = self.suffix(history, new, generation=True, before=rendered)  # rendered without a prompt
        return closing + delta, broke


TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def hermes(text: str) -> tuple[str, list[dict]]:
    """Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number. Returns the
    content before the first call and the calls; one that does not parse is {"error": why}."""
    start = text.find("<tool_call>")
    if start < 0:
        return text.strip(), []
    calls = []
    for body in TOOL_CALL.findall(text[start:]):
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append({"name": name, "arguments": arguments})
        except (ValueError, KeyError, TypeError) as e:
            calls.append({"error": f"malformed tool call {body.strip()[:200]!r} ({type(e).__name__}: {e})"})
    return text[:start].strip(), calls


PARSERS = {"hermes": hermes}  # or module:function of an env directory (envs.resolve)


async def run_tools(tools: dict, calls: list[dict], timeout: float) -> list[tuple[str, str, bool]]:
    """Run a turn's calls concurrently: (tool name, result text, whether it is an error) per call. Whatever goes
    wrong (a malformed or unknown call, wrong arguments, a tool that raises or times out) becomes an error message
    for the policy, never an exception."""
    async def one(call: dict) -> tuple[str, str, bool]:
        if "error" in call:
            return "", f"error: {call['error']}", True
        name, arguments = call["name"], call["arguments"]
        if (tool := tools.get(name)) is None:
            return name, f"error: unknown tool {name!r}; tools: {', '.join(tools)}", True
        try:
            inspect.signature(tool).bind(**arguments)
        except TypeError as e:
            return name, f"error: wrong arguments for {name}: {e}", True
        try:
            # A plain function runs in a thread: a slow tool must not block the loop.
            running = tool(**arguments) if inspect.iscoroutinefunction(tool) else asyncio.to_thread(tool, **arguments)
            out = await asyncio.wait_for(running, timeout)
        except TimeoutError:
            return name, f"error: {name} timed out after {timeout:g} s", True
        except Exception as e:
            return name, f"error: {name} raised {type(e).__name__}: {e}", True
        return name, out if isinstance(out, str) else json.dumps(out), False
    return await asyncio.gather(*(one(c) for c in calls))
