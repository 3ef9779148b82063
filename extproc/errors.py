"""The errors extproc raises, each knowing how a client should see it.

    ExtProcError              500  internal_error        a bug; logged with the request id
    ├── BadRequest            400  invalid_request_error the body cannot be routed as sent
    │   └── BodyTooLarge      413  invalid_request_error over the configured body limit
    ├── ModelNotFound         404  not_found_error       no known pod serves the model
    ├── NoCapacity            429  rate_limit_error      the filters removed every pod
    ├── Overloaded            429  rate_limit_error      flow control refused it (shed, queue
    │                                                   full, time to live); with Retry-After
    └── NoReadyPods           503  service_unavailable   pods serve the model, none is ready

    ConfigError                                         bad configuration; stops start-up

The server turns an ``ExtProcError`` into an Envoy ImmediateResponse with an OpenAI-style
body (``to_body``); nothing else about errors lives in the gRPC layer.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson


class ExtProcError(Exception):
    """Base of every error answered to a client."""

    http_status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param

    default_code: ClassVar[str] = "internal_error"
    # Seconds a client should wait before retrying (the reply's ``Retry-After``); None: no header.
    retry_after_s: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_body(self) -> bytes:
        return orjson.dumps(self.to_dict())


class BadRequest(ExtProcError):
    http_status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class BodyTooLarge(BadRequest):
    http_status = 413
    default_code = "body_too_large"


class ModelNotFound(ExtProcError):
    http_status = 404
    error_type = "not_found_error"
    default_code = "model_not_found"


class NoCapacity(ExtProcError):
    http_status = 429
    error_type = "rate_limit_error"
    default_code = "no_capacity"


class Overloaded(ExtProcError):
    """Flow control refused the request while every pod was saturated: it is sheddable,
    the queue was full, or its time to live ended in the queue."""

    http_status = 429
    error_type = "rate_limit_error"
    default_code = "overloaded"

    def __init__(self, message: str, *, code: str, retry_after_s: int) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class NoReadyPods(ExtProcError):
    http_status = 503
    error_type = "service_unavailable"
    default_code = "no_ready_pods"


class ConfigError(Exception):
    """Configuration that cannot be used; the message names the file and the problem."""
