"""ASGI middleware that refuses before any work: a missing API key, an oversized body."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .config import ServerConfig
from .errors import APIError

# Besides /v1/*: routes that read the model's tokenizer or change engine state.
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/reset_prefix_cache"})


def needs_key(path: str) -> bool:
    return path.startswith("/v1") or path in KEYED_PATHS


class Guard:
    """API key on /v1 (as vLLM), /tokenize, /detokenize and /reset_prefix_cache; a
    Content-Length cap."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app, self.config = app, config
        self.expected = f"Bearer {config.api_key}".encode() if config.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            error: APIError | None = None
            if (
                self.expected is not None
                and needs_key(scope["path"])
                and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            ):
                error = APIError(401, "Invalid or missing API key.")
            length = headers.get(b"content-length", b"")
            if error is None and length.isdigit() and int(length) > self.config.max_body_bytes:
                error = APIError(413, f"Request body over {self.config.max_body_bytes} bytes.")
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
