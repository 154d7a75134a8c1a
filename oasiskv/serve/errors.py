"""The server's errors, each with its HTTP status and OpenAI's error object
(`{"error": {"message", "type", "param", "code"}}`), as a JSON response or an SSE event."""

from __future__ import annotations

import json


class APIError(Exception):
    """An error the client sees: `status`, and OpenAI's `type` / `param` / `code`."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def sse(self) -> str:
        """The error event that ends a stream that had already started."""
        return f"data: {json.dumps(self.body())}\n\n"


class BadRequest(APIError):
    status = 400


class Unauthorized(APIError):
    status = 401
    type = "authentication_error"


class ModelNotFound(APIError):
    status = 404
    type = "not_found_error"


class BodyTooLarge(APIError):
    status = 413


class QueueFull(APIError):
    status = 503
    type = "service_unavailable_error"


class StoreFullError(QueueFull):
    """The remote store had no room for the request's blocks (its capacity is taken by other
    requests' and the prefix cache's): nothing of it was kept; retry after a while."""

    RETRY_AFTER_S = 2

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": str(self.RETRY_AFTER_S)})


class EngineFailure(APIError):
    """The engine failed the request (its own error text) or the stepping loop broke."""

    status = 500
    type = "server_error"


class RequestTimeout(APIError):
    """The request ran past --request-timeout; it was aborted."""

    status = 504
    type = "timeout_error"
