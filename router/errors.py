"""Errors a router request can end with, each knowing its HTTP status, OpenAI error type and gRPC code.

The HTTP front end renders them in the OpenAI error shape, the gRPC front end aborts with their code;
neither decides the mapping itself. Worker statuses are translated here too (``from_worker_status``), so a
worker's INVALID_ARGUMENT reaches the client as a 400 with the worker's (the engine's) own message.
"""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """Base: a request failed in a way the client should hear about."""

    http_status = 500
    openai_type = "InternalServerError"
    grpc_code = grpc.StatusCode.INTERNAL
    metric_status = "error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_openai(self) -> dict[str, object]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.http_status,
            }
        }


class InvalidRequestError(RouterError):
    """Malformed body, wrong field types, bad sampling values, prompt too long."""

    http_status = 400
    openai_type = "BadRequestError"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    metric_status = "invalid"


class ModelNotFoundError(RouterError):
    """The request names a model this router does not serve."""

    http_status = 404
    openai_type = "NotFoundError"
    grpc_code = grpc.StatusCode.NOT_FOUND
    metric_status = "not_found"


class NotFoundError(RouterError):
    """The request names something (a stored response) that is not here."""

    http_status = 404
    openai_type = "NotFoundError"
    grpc_code = grpc.StatusCode.NOT_FOUND
    metric_status = "not_found"


class NoWorkerAvailableError(RouterError):
    """No worker of a needed role is reachable, or every one refused the request for lack of room."""

    http_status = 503
    openai_type = "ServiceUnavailableError"
    grpc_code = grpc.StatusCode.UNAVAILABLE
    metric_status = "unavailable"


class UpstreamError(RouterError):
    """A worker failed after the request was under way (or in a way no retry could mend)."""

    http_status = 502
    openai_type = "BadGatewayError"
    grpc_code = grpc.StatusCode.UNAVAILABLE
    metric_status = "upstream_error"

    def __init__(self, message: str, grpc_code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if grpc_code is not None:
            self.grpc_code = grpc_code


class UpstreamTimeoutError(UpstreamError):
    """The request ran past the router's request timeout."""

    http_status = 504
    openai_type = "GatewayTimeoutError"
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    metric_status = "timeout"


def from_worker_status(code: grpc.StatusCode, details: str, worker: str) -> RouterError:
    """The error a client sees for a worker status no retry will mend."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeoutError(f"worker {worker} did not finish in time: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return NoWorkerAvailableError(f"worker {worker} could not take the request ({code.name}: {details})")
    return UpstreamError(f"worker {worker} failed ({code.name}: {details})", grpc_code=code)
