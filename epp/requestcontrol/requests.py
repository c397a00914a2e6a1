"""Parse an OpenAI request body into what scheduling needs; reject what cannot be served."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from infergate.epp.types import InferenceRequest

CHARS_PER_TOKEN = 4
MAX_TOKEN_ID = 1 << 32
#: One reusable decoder: msgspec parses a 220 KB body ~2.5x faster than ``json.loads``.
#: It rejects what ``json.loads`` would let through to crash later: lone UTF-16
#: surrogates (which cannot be encoded for prefix hashing or a rewrite), integers beyond
#: 64 bits and floats beyond double range; deep nesting raises RecursionError, caught below.
_DECODER = msgspec.json.Decoder()


class BadRequest(ValueError):
    """The body is not a usable OpenAI request (answered with 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _content_text(content: Any) -> str:
    """The text of one message's ``content``: a string, null, or a list of parts.

    Non-text parts (images, audio) carry no prefix text; anything else is a 400, as
    OpenAI answers it, rather than an empty prompt that would route as a cache miss.
    """
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        texts = []
        for part in content:
            text = part.get("text")
            if text is None:
                continue
            if not isinstance(text, str):
                raise BadRequest("a content part's 'text' must be a string", "messages")
            texts.append(text)
        return "".join(texts)
    raise BadRequest(
        "a message's 'content' must be a string, null or a list of content parts", "messages"
    )


def _token_id(value: Any) -> bool:
    """A token id: a non-negative int that fits a vocabulary index (not a bool)."""
    return type(value) is int and 0 <= value < MAX_TOKEN_ID


def parse_body(raw: bytes, request: InferenceRequest) -> dict[str, Any]:
    """Fill ``request`` from the JSON body and return the decoded body."""
    try:
        body = _DECODER.decode(raw)
    except RecursionError:
        raise BadRequest("request body is not valid JSON: nested too deeply") from None
    except (msgspec.DecodeError, UnicodeDecodeError, ValueError) as error:
        reason = str(error).removeprefix("JSON is malformed: ")[:200]
        raise BadRequest(f"request body is not valid JSON: {reason}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    request.body = body
    request.model = request.target_model = model
    messages = body.get("messages")
    prompt = body.get("prompt")
    token_count = 0
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a list of objects", "messages")
        request.prompt_text = "\n".join(_content_text(m.get("content")) for m in messages)
    elif prompt is not None:
        if isinstance(prompt, str):
            request.prompt_text = prompt
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            request.prompt_text = "\n".join(prompt)
        elif isinstance(prompt, list) and all(_token_id(p) for p in prompt):
            token_count = len(prompt)
            request.prompt_text = " ".join(map(str, prompt))
        elif isinstance(prompt, list) and all(
            isinstance(p, list) and all(_token_id(t) for t in p) for p in prompt
        ):
            token_count = sum(len(p) for p in prompt)
            request.prompt_text = "\n".join(" ".join(map(str, p)) for p in prompt)
        else:
            raise BadRequest("'prompt' must be a string, a list of strings, or token ids", "prompt")
    elif isinstance(body.get("input"), str):  # Responses / embeddings style
        request.prompt_text = body["input"]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    request.stream = stream
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadRequest(f"'{field}' must be a non-negative integer", field)
        request.max_tokens = value
    salt = body.get("cache_salt", "")
    if not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string", "cache_salt")
    request.cache_salt = salt
    request.prompt_tokens_estimate = token_count or (len(request.prompt_text) // CHARS_PER_TOKEN)
    return body


def openai_error(status: int, message: str, param: str | None = None) -> bytes:
    kinds = {
        400: "BadRequestError",
        413: "RequestTooLargeError",
        429: "TooManyRequestsError",
        503: "ServiceUnavailableError",
    }
    error = {
        "error": {
            "message": message,
            "type": kinds.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }
    return json.dumps(error).encode()
