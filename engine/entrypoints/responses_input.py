"""A Responses request → what the chat path already knows: chat messages, chat-shaped
tools and tool_choice, and a grammar spec.

Turning items into chat messages lets the Responses API reuse the model's chat template,
the tool parsers and the xgrammar path unchanged, as vLLM does for models without their
own Responses format: a ``function_call`` item becomes an assistant message's tool call,
a ``function_call_output`` a ``tool`` message, ``developer`` the ``system`` role.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from infergate.engine.entrypoints.protocol import ChatMessage
from infergate.engine.entrypoints.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    Item,
    MessageItem,
    message_text,
)
from infergate.engine.structured_output import GrammarSpec, GrammarSpecError, spec_from_request

from .errors import APIError

#: Built-in tool types OpenAI hosts; the engine runs none of them.
_BUILTIN_TOOLS = ("web_search", "file_search", "computer", "code_interpreter", "image_generation",
                  "mcp", "local_shell", "custom", "shell", "apply_patch")  # fmt: skip


def to_messages(instructions: str | None, items: list[Item]) -> list[ChatMessage]:
    """The conversation as chat messages (instructions first, as a system message)."""
    messages: list[ChatMessage] = []
    if instructions:
        messages.append(ChatMessage(role="system", content=instructions))
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=message_text(item.content, "input")))
        elif isinstance(item, FunctionCallItem):
            _add_call(messages, item)
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output
            text = output if isinstance(output, str) else message_text(output, "input")
            messages.append(
                ChatMessage.model_validate(
                    {"role": "tool", "content": text, "tool_call_id": item.call_id}
                )
            )
    return messages


def _add_call(messages: list[ChatMessage], item: FunctionCallItem) -> None:
    """A call joins the assistant message just before it (text then calls is one turn)."""
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        extra = last.model_extra if last.model_extra is not None else {}
        extra.setdefault("tool_calls", []).append(call)
        return
    messages.append(ChatMessage.model_validate({"role": "assistant", "content": "",
                                                "tool_calls": [call]}))  # fmt: skip


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) → chat tools (``{"type", "function": {...}}``)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            hosted = isinstance(kind, str) and kind.startswith(_BUILTIN_TOOLS)
            why = "built-in tools are not supported" if hosted else "unknown tool type"
            raise APIError(400, f"tools[{i}]: {why} ({kind!r}); only function tools.", "tools")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools[{i}].name is required.", "tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses ``tool_choice`` → the chat form; other hosted choices are a 400."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else type(choice).__name__
    raise APIError(400, f"tool_choice of type {kind!r} is not supported.", "tool_choice")


def grammar_spec(fmt: dict[str, Any] | None) -> GrammarSpec | None:
    """``text.format`` (text, json_object, json_schema) → the grammar the chat path uses."""
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    response_format: dict[str, Any] = {"type": kind}
    if kind == "json_schema":
        if "schema" not in fmt:
            raise APIError(400, "text.format.schema is required for json_schema.", "text.format")
        response_format["json_schema"] = {"name": fmt.get("name"), "schema": fmt["schema"]}
    try:
        spec = spec_from_request(SimpleNamespace(response_format=response_format))
    except GrammarSpecError as error:
        message = error.message.replace("response_format", "text.format")
        raise APIError(400, message, "text.format") from None
    return GrammarSpec(spec.kind, spec.value, "text.format") if spec is not None else None
