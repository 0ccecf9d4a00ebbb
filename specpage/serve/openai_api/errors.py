"""Errors as OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`,
with the HTTP status its clients retry or give up on (the `openai` SDK retries
429 and 5xx, honouring `Retry-After`)."""

from __future__ import annotations

import math

import msgspec
from starlette.responses import Response

from specpage.core.request import ValidationError
from specpage.engine.async_engine import DrainingError, EngineFaultError, QueueFullError
from specpage.serve.frontend import LoadingError


class ErrorBody(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class APIError(Exception):
    """An error response: status, OpenAI's error object and any headers."""

    def __init__(self, status: int, body: ErrorBody,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(body.message)
        self.status = status
        self.body = body
        self.headers = headers or {}

    def response(self) -> Response:
        return Response(msgspec.json.encode({"error": self.body}), self.status,
                        self.headers, media_type="application/json")


def invalid(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, ErrorBody(message, "invalid_request_error", param, code))


def api_error(error: Exception, renamed: dict[str, str] | None = None) -> APIError:
    """The response for an error the front end raised; renamed maps the engine's
    field names to the parameter the client sent."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValidationError):
        param = (renamed or {}).get(error.field, error.field)
        message = str(error).removeprefix(f"{error.field}: ")
        return invalid(param, f"{param}: {message}")
    if isinstance(error, QueueFullError):
        # Retry-After is whole seconds: round up, so a client never comes back early.
        seconds = math.ceil(error.retry_after_ms / 1000)
        return APIError(429, ErrorBody(str(error), "rate_limit_error", None, "queue_full"),
                        {"Retry-After": str(seconds)})
    if isinstance(error, LoadingError | DrainingError):
        return unavailable(str(error))
    if isinstance(error, EngineFaultError):
        return APIError(500, ErrorBody(str(error), "server_error", None, "engine_fault"))
    raise error


def unavailable(message: str) -> APIError:
    return APIError(503, ErrorBody(message, "service_unavailable_error", None, "unavailable"))
