"""OpenAI's Responses API request and input items, as pydantic models.

The request body is validated strictly like the other APIs (:mod:`.protocol`): wrong types
are a 400 naming the field, unknown fields are ignored with a warning. Input items are
kept as raw objects in the body model and validated one by one in :func:`parse_items`,
so an error can name the item (``input[2].type``) instead of pydantic's union noise.
Known fields the engine cannot honour are listed in :func:`unsupported_fields`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TextConfig(_Open):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(_Open):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's scheduling priority (--scheduling-policy priority): lower runs first.
    priority: int = 0
    # Known, but not honoured: refused when set to anything but their neutral value.
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    service_tier: str | None = None


def unsupported_fields(req: ResponsesRequest) -> tuple[str, str] | None:
    """(param, message) for the first known field set to a value the engine cannot honour."""
    reasoning_set = req.reasoning is not None and any(v is not None for v in req.reasoning.values())
    checks: list[tuple[bool, str, str]] = [
        (bool(req.background), "background", "background=true is not supported"),
        (reasoning_set, "reasoning", "reasoning is not supported (no reasoning parser)"),
        (bool(req.include), "include", "include is not supported"),
        (bool(req.top_logprobs), "top_logprobs", "top_logprobs is not supported"),
        (
            req.truncation not in (None, "disabled"),
            "truncation",
            "only truncation='disabled' is supported",
        ),
        (req.max_tool_calls is not None, "max_tool_calls", "max_tool_calls is not supported"),
        (req.conversation is not None, "conversation", "conversation is not supported"),
        (req.prompt is not None, "prompt", "prompt templates are not supported"),
        (
            req.service_tier not in (None, "auto", "default"),
            "service_tier",
            "only service_tier 'auto' or 'default' is supported",
        ),
        (
            req.text is not None and req.text.verbosity not in (None, "medium"),
            "text.verbosity",
            "text.verbosity is not supported",
        ),
    ]
    return next(((param, msg) for bad, param, msg in checks if bad), None)


# -- input items ----------------------------------------------------------------------


class MessageItem(_Open):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Open):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEM_MODELS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}
#: Item types OpenAI defines that this engine cannot take as input.
KNOWN_UNSUPPORTED_ITEMS = frozenset({
    "reasoning", "item_reference", "file_search_call", "web_search_call", "computer_call",
    "computer_call_output", "image_generation_call", "code_interpreter_call",
    "local_shell_call", "local_shell_call_output", "mcp_call", "mcp_list_tools",
    "mcp_approval_request", "mcp_approval_response", "custom_tool_call",
    "custom_tool_call_output", "compaction",
})  # fmt: skip
#: Content part types that carry text (OpenAI's ``refusal`` is text the model wrote).
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class ItemError(ValueError):
    """A bad input item; ``param`` names it (``input[1].content[0].type``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


def _item_type(raw: Any, where: str) -> str:
    if not isinstance(raw, dict):
        raise ItemError(where, f"{where} must be an object.")
    kind = raw.get("type", "message" if "role" in raw else None)
    if not isinstance(kind, str):
        raise ItemError(f"{where}.type", f"{where}.type is required.")
    if kind in KNOWN_UNSUPPORTED_ITEMS:
        raise ItemError(f"{where}.type", f"input items of type {kind!r} are not supported.")
    if kind not in _ITEM_MODELS:
        raise ItemError(f"{where}.type", f"unknown input item type {kind!r}.")
    return kind


def _validate(model: type[BaseModel], raw: dict[str, Any], where: str) -> BaseModel:
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(p) for p in first["loc"][:1])
        param = f"{where}.{field}" if field else where
        raise ItemError(param, f"Invalid value for '{param}': {first['msg']}") from None


def message_text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of ``content`` (a string or parts; ``where`` names the parts list in
    errors); parts other than text are refused by name."""
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind not in TEXT_PARTS:
            raise ItemError(
                f"{where}[{j}].type",
                f"content part type {kind!r} is not supported (only text parts).",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ItemError(f"{where}[{j}].text", "text must be a string.")
        out.append(text)
    return "".join(out)


def parse_items(raw: str | list[Any], prefix: str = "input") -> list[Item]:
    """The request's ``input`` as validated items (a string is one user message)."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    items: list[Item] = []
    for i, entry in enumerate(raw):
        where = f"{prefix}[{i}]"
        kind = _item_type(entry, where)
        item = _validate(_ITEM_MODELS[kind], {"type": kind, **entry}, where)
        if isinstance(item, MessageItem):
            message_text(item.content, f"{where}.content")  # refuses non-text parts now
        if isinstance(item, FunctionCallOutputItem) and not isinstance(item.output, str):
            message_text(item.output, f"{where}.output")
        items.append(item)  # type: ignore[arg-type]
    return items
