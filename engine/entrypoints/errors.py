"""Errors in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "BadRequestError",
    413: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class APIError(Exception):
    """An error answer; ``param`` names the offending request field, as OpenAI does."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param), self.status)


class ClientGone(Exception):
    """The client went away before its request body was complete (already logged)."""
